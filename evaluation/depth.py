"""The depth distribution chart (the paper's Figure 1b): share of validation tokens at each depth, the mean
depth, and per-depth perplexity, for one loop budget M."""

from __future__ import annotations

from pathlib import Path

from evaluation.figures import pyplot, save


def depth_chart(depth: dict, loops: int, path: str | Path, title: str = "") -> Path:
    """Writes a PNG: bars = share of tokens per depth 1..M, line = per-depth perplexity (right axis)."""
    plt = pyplot()
    M = int(loops)
    xs = list(range(1, M + 1))
    share = [100.0 * s for s in depth["share"]]
    fig, ax = plt.subplots(figsize=(6.0, 3.6), dpi=120)
    bars = ax.bar(xs, share, color="#4C72B0", label="share of tokens")
    for b, s in zip(bars, share):
        if s > 0:
            ax.annotate(
                f"{s:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7
            )
    ax.set_xlabel("depth (loops executed)")
    ax.set_ylabel("tokens (%)")
    ax.set_xticks(xs)
    ax.set_ylim(0, max(share + [1.0]) * 1.18)
    ax.axvline(depth["mean"], color="#C44E52", ls="--", lw=1)
    ax.text(depth["mean"], ax.get_ylim()[1] * 0.95, f" mean {depth['mean']:.2f}", color="#C44E52", fontsize=8, va="top")
    ppl = [(x, p) for x, p in zip(xs, depth["ppl"]) if p is not None]
    if ppl:
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in ppl], [p for _, p in ppl], "o-", color="#55A868", ms=3, lw=1, label="ppl at depth")
        ax2.set_ylabel("perplexity at depth")
        ax2.set_yscale("log")
    ax.set_title(title or f"Depth distribution, budget M={M}", fontsize=9)
    return save(fig, path, dpi=120)
