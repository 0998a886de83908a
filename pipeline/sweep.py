"""`tlf sweep SCALE`: train and evaluate the paper's eight variants with one command, then compare them.

Sequentially on this machine (default), or `--print` the launch commands (one line each) for a cluster:

    tlf sweep paper --print --launcher "deepspeed --num_gpus 8 --hostfile hosts" > sweep.sh

Every trained model gets its own checkpoint dir (`<out>/checkpoints/<variant>`) and is logged to the MLflow
experiment `sweep-<scale>` (or `--experiment`), so the final `tlf compare` finds all eight variants.
naive-loop-ee is base-loop evaluated at M < L: it is not trained again, its evaluation reads the base-loop
checkpoint under its own name (`tlf eval ... --variant naive-loop-ee`). The stages are
`pipeline/orchestrate.py`'s, shared with `make demo`.
"""

from __future__ import annotations

from pathlib import Path

import click

from data_prep.clitypes import CommaList, ShellWords
from data_prep.files import check_writable
from pipeline import orchestrate
from pipeline.config import SCALES, VARIANTS, load_config


def plan(
    scale: str,
    variants: list[str],
    out: str,
    experiment: str,
    launcher: list[str],
    overrides: list[str],
    eval_args: list[str],
    tracking_uri: str = "",
) -> list[orchestrate.Stage]:
    """The stages of a sweep, in order: train each model once (naive-loop-ee is the base-loop checkpoint read
    at M < L), evaluate each variant, compare."""
    log = [f"logging.experiment={experiment}"] + ([f"logging.tracking_uri={tracking_uri}"] if tracking_uri else [])
    for v in variants:
        load_config(f"{scale}/{v}", overrides)  # fail now, not after hours of training, on a bad override
    return orchestrate.variant_stages(
        scale,
        variants,
        out,
        lambda v: [*log, *overrides],
        [*eval_args, *log],
        ["--experiment", experiment, "--out", f"{out}/compare"]
        + (["--tracking-uri", tracking_uri] if tracking_uri else []),
        launcher,
    )


def _fail(stage: orchestrate.Stage, code: int) -> None:
    raise click.ClickException(
        f"sweep stopped: `{stage.shell()}` exited {code} (rerun the sweep: training resumes from its last checkpoint)"
    )


@click.command("sweep")
@click.argument("scale", type=click.Choice(SCALES))
@click.argument("overrides", nargs=-1)
@click.option(
    "--variants",
    type=CommaList(click.Choice(VARIANTS), "variant {}", "base,t-loopformer", none="all"),
    metavar="VARIANT1,VARIANT2,...|all",
    default="all",
    show_default=True,
    help="Variants, distinct, or all: " + ", ".join(VARIANTS) + ".",
)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Output root (default runs/sweep-<scale>).")
@click.option("--experiment", default=None, help="MLflow experiment (default sweep-<scale>).")
@click.option("--tracking-uri", default="", help="MLflow tracking URI (default sqlite:///<cwd>/mlflow.db).")
@click.option(
    "--launcher", type=ShellWords(), default="", help='Training launcher prefix, e.g. "deepspeed --num_gpus 8".'
)
@click.option(
    "--eval-args", type=ShellWords(), default="", help='Extra `tlf eval` arguments, e.g. "--loops 2,4,8 --limit 500".'
)
@click.option("--print", "print_only", is_flag=True, help="Print the commands (one per line) instead of running them.")
def sweep(scale, overrides, variants, out, experiment, tracking_uri, launcher, eval_args, print_only):
    """Train and evaluate every variant at SCALE (tiny, small, paper, depth), then compare them."""
    names = list(variants or VARIANTS)  # (none="all": the empty tuple)
    out = out or f"runs/sweep-{scale}"
    if not print_only:
        check_writable(out, "--out")  # before hours of training
    stages = plan(
        scale,
        names,
        str(Path(out)),
        experiment or f"sweep-{scale}",
        launcher,
        list(overrides),
        eval_args,
        tracking_uri,
    )
    if print_only:
        for st in stages:
            click.echo(st.shell())
        return
    orchestrate.run(stages, lambda st: click.echo(f"$ {st.shell()}", err=True), _fail)
