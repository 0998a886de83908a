"""Matplotlib, headless, for every chart tlf writes (depth, compare, ablate)."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot with the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lays out, writes the PNG (creating its directory) and closes the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
