"""`tlf export CHECKPOINT --out DIR`: re-writes a model export (any checkpoint `tlf generate` accepts) as a
self-contained directory: config.yaml + model.safetensors (the default, also what training writes), the
legacy model.pt, or (`hf`) a transformers directory (pipeline.hf.export)."""
from __future__ import annotations

from pathlib import Path

import click

from pipeline.model.io import find_export, load_model, save_model

FORMATS = ("safetensors", "pt", "hf")


def export(checkpoint: str, out: str, fmt: str = "safetensors") -> Path:
    model, cfg = load_model(checkpoint, "cpu")
    if Path(out).resolve() == find_export(checkpoint).resolve():
        raise click.UsageError(f"--out {out}: is the source export itself; choose another directory")
    if fmt in ("safetensors", "hf"):
        from pipeline.model.io import have_safetensors

        if not have_safetensors():
            raise click.UsageError(f"--format {fmt} needs the safetensors package (pip install tlf[hf])")
    if fmt == "hf":
        from pipeline.hf.export import export_hf

        return export_hf(model, cfg, Path(out), find_export(checkpoint))
    return save_model(out, model, cfg, fmt)


@click.command("export")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write the export to.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="safetensors", show_default=True,
              help="safetensors / pt: a tlf export (config.yaml + weights); hf: a transformers directory.")
def export_cmd(checkpoint: str, out: str, fmt: str) -> None:
    """Write CHECKPOINT (an export dir, a checkpoint dir holding model/, or a run dir) to --out as an export."""
    try:
        d = export(checkpoint, out, fmt)
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {d}")
