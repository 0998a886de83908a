"""`tlf export CHECKPOINT --out DIR`: re-writes a model export (any checkpoint `tlf generate` accepts) as a
self-contained directory: config.yaml + model.safetensors (the default, also what training writes), the
legacy model.pt, or (`hf`) a transformers directory (pipeline.hf.export).

The export is written whole or not at all: into a hidden sibling `.DIR.tmp-export<pid>`, then renamed to DIR. An
existing export at DIR (ours: config.yaml, or a transformers one: config.json) is replaced as a whole, so no file
of another format stays beside the new ones; a DIR holding anything else is refused. A kill leaves DIR as it was
(or, between the two renames, absent) plus hidden temp dirs, which the next export to DIR removes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import click

from data_prep.files import check_writable
from pipeline.model.io import find_export, load_model, save_model

FORMATS = ("safetensors", "pt", "hf")


def _check_out(out: Path) -> None:
    """--out must be new, empty, or an earlier export (replaced whole); it and its parent must be creatable."""
    if out.is_dir() and any(out.iterdir()) and not ((out / "config.yaml").is_file() or (out / "config.json").is_file()):
        raise click.UsageError(
            f"--out {out}: exists and is not an export (no config.yaml or config.json); choose a new or empty directory"
        )
    check_writable(out, "--out")
    check_writable(out.parent, "--out")  # the export is built beside out, then renamed into place


def _temp_dirs(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.tmp-export*")) + list(out.parent.glob(f".{out.name}.trash-export*"))


def _replace_dir(tmp: Path, out: Path) -> None:
    """Puts the finished tmp dir at out, moving an earlier out aside first (a directory cannot be renamed over a
    non-empty one)."""
    trash = out.with_name(f".{out.name}.trash-export{os.getpid()}")
    if out.exists():
        os.replace(out, trash)
    os.replace(tmp, out)
    shutil.rmtree(trash, ignore_errors=True)


EVAL_ROOT = Path("out") / "eval"  # where `tlf eval` writes by default (eval.out_dir empty)


def export(checkpoint: str, out: str, fmt: str = "safetensors", evals: tuple = ()) -> Path:
    """Writes `checkpoint`'s model to `out` in fmt; the hf model card holds the checkpoint's evaluation found under
    out/eval, the `evals` directories and its run dir (pipeline.hf.export.find_evaluation)."""
    dest = Path(out)
    _check_out(dest)  # before the weights are read
    model, cfg = load_model(checkpoint, "cpu")
    if Path(out).resolve() == find_export(checkpoint).resolve():
        raise click.UsageError(f"--out {out}: is the source export itself; choose another directory")
    if fmt in ("safetensors", "hf"):
        from pipeline.model.io import have_safetensors

        if not have_safetensors():
            raise click.UsageError(f"--format {fmt} needs the safetensors package (pip install tlf[hf])")
    for stale in _temp_dirs(dest):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.with_name(f".{dest.name}.tmp-export{os.getpid()}")
    dest.parent.mkdir(parents=True, exist_ok=True)  # once the checkpoint has loaded: a failed export leaves nothing
    try:
        if fmt == "hf":
            from pipeline.hf.export import export_hf

            export_hf(model, cfg, tmp, find_export(checkpoint), [EVAL_ROOT, *map(Path, evals)])
        else:
            save_model(tmp, model, cfg, fmt)
        _replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@click.command("export")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write the export to.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="safetensors",
    show_default=True,
    help="safetensors / pt: a tlf export (config.yaml + weights); hf: a transformers directory.",
)
@click.option(
    "--evals",
    multiple=True,
    type=click.Path(file_okay=False),
    help="--format hf: also look here for the checkpoint's `tlf eval` results (default: out/eval and its run dir).",
)
def export_cmd(checkpoint: str, out: str, fmt: str, evals: tuple[str, ...]) -> None:
    """Write CHECKPOINT (an export dir, a checkpoint dir holding model/, or a run dir) to --out as an export."""
    try:
        d = export(checkpoint, out, fmt, evals)
    except FileNotFoundError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {d}")
