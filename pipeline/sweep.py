"""`tlf sweep SCALE`: train and evaluate the paper's eight variants with one command, then compare them.

Sequentially on this machine (default), or `--print` the launch commands (one line each) for a cluster:

    tlf sweep paper --print --launcher "deepspeed --num_gpus 8 --hostfile hosts" > sweep.sh

Every variant gets its own checkpoint dir (`<out>/checkpoints/<variant>`) and is logged to the MLflow
experiment `sweep-<scale>` (or `--experiment`), so the final `tlf compare` finds all eight runs.
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import click

from pipeline.config import SCALES, VARIANTS, load_config


def plan(scale: str, variants: list[str], out: str, experiment: str, launcher: str, overrides: list[str],
         eval_args: list[str], tracking_uri: str = "") -> list[list[str]]:
    """The commands of a sweep, in order: train each variant, evaluate each, compare."""
    tlf = ["tlf"]
    train_prefix = shlex.split(launcher) + ["$(which tlf)"] if launcher else tlf
    log = [f"logging.experiment={experiment}"] + ([f"logging.tracking_uri={tracking_uri}"] if tracking_uri else [])
    cmds = []
    for v in variants:
        load_config(f"{scale}/{v}", overrides)  # fail now, not after hours of training, on a bad override
        cmds.append(train_prefix + ["train", f"{scale}/{v}", f"checkpoint.dir={out}/checkpoints/{v}", *log, *overrides])
    for v in variants:
        cmds.append(tlf + ["eval", f"{out}/checkpoints/{v}", "--out", f"{out}/eval/{v}", *eval_args, *log])
    cmds.append(tlf + ["compare", "--experiment", experiment, "--out", f"{out}/compare"]
                + (["--tracking-uri", tracking_uri] if tracking_uri else []))
    return cmds


def shell_line(cmd: list[str]) -> str:
    return " ".join(c if c == "$(which tlf)" else shlex.quote(c) for c in cmd)


def run_plan(cmds: list[list[str]]) -> None:
    for cmd in cmds:
        click.echo(f"$ {shell_line(cmd)}", err=True)
        argv = [sys.executable, "-m", "pipeline.cli", *cmd[1:]] if cmd[0] == "tlf" else cmd
        res = subprocess.run(argv)
        if res.returncode != 0:
            raise click.ClickException(f"sweep stopped: `{shell_line(cmd)}` exited {res.returncode} "
                                       "(rerun the sweep: training resumes from its last checkpoint)")


@click.command("sweep")
@click.argument("scale", type=click.Choice(SCALES))
@click.argument("overrides", nargs=-1)
@click.option("--variants", default="all", show_default=True, help="Comma-separated variants, or all eight.")
@click.option("--out", default=None, help="Output root (default runs/sweep-<scale>).")
@click.option("--experiment", default=None, help="MLflow experiment (default sweep-<scale>).")
@click.option("--tracking-uri", default="", help="MLflow tracking URI (default sqlite:///<cwd>/mlflow.db).")
@click.option("--launcher", default="", help='Training launcher prefix, e.g. "deepspeed --num_gpus 8".')
@click.option("--eval-args", default="", help='Extra `tlf eval` arguments, e.g. "--loops 2,4,8 --limit 500".')
@click.option("--print", "print_only", is_flag=True, help="Print the commands (one per line) instead of running them.")
def sweep(scale, overrides, variants, out, experiment, tracking_uri, launcher, eval_args, print_only):
    """Train and evaluate every variant at SCALE (tiny, small, paper), then compare them."""
    names = list(VARIANTS) if variants == "all" else [v.strip() for v in variants.split(",") if v.strip()]
    for v in names:
        if v not in VARIANTS:
            raise click.BadParameter(f"{v!r} is not one of {', '.join(VARIANTS)}", param_hint="--variants")
    out = out or f"runs/sweep-{scale}"
    cmds = plan(scale, names, str(Path(out)), experiment or f"sweep-{scale}", launcher, list(overrides),
                shlex.split(eval_args), tracking_uri)
    if print_only:
        for c in cmds:
            click.echo(shell_line(c))
        return
    run_plan(cmds)
