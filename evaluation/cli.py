"""`tlf eval CHECKPOINT [section.key=value ...]`: a thin wrapper over `evaluation.evaluate.run`."""

from __future__ import annotations

import json

import click
from pipeline.config import ConfigError
from pipeline.device import DEVICE_HELP
from pipeline.tracking import TrackingError


@click.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("overrides", nargs=-1)
@click.option(
    "--loops", "loops", default=None, help="Loop budgets M, e.g. 2,4,8 (default: eval.loops, else the training L)."
)
@click.option(
    "--tasks", default="", help="Comma-separated zero-shot tasks (default: eval.tasks, all ten); 'none' for none."
)
@click.option("--limit", type=int, default=None, help="Examples per task (0: all).")
@click.option("--batch-size", type=int, default=None, help="Sequences per forward.")
@click.option(
    "--source", type=click.Choice(["auto", "hub", "offline"]), default=None, help="Where task data comes from."
)
@click.option("--race-file", default=None, help="Local RACE file (EleutherAI/race schema).")
@click.option("--ppl-tokens", type=int, default=None, help="Tokens per validation set for perplexity (0: all).")
@click.option("--stride", type=int, default=None, help="Sliding-window stride for perplexity (0: non-overlapping).")
@click.option("--no-ppl", is_flag=True, help="Skip perplexity and the depth distribution.")
@click.option("--no-latency", is_flag=True, help="Skip TTFT/TPOT.")
@click.option("--no-mlflow", is_flag=True, help="Do not log to MLflow.")
@click.option(
    "--strict",
    is_flag=True,
    help="A task whose data cannot be reached is an error (default: skipped, "
    "with one warning line, and marked in results.json and table1.md).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (it is drawn on stderr only on a terminal).")
@click.option("--out", "out_dir", default=None, help="Output directory.")
@click.option(
    "--check-preset",
    "config",
    default=None,
    metavar="PRESET",
    help="Refuse a checkpoint whose model section differs from this preset's.",
)
@click.option("--config", "config_alias", default=None, hidden=True)  # refused: eval reads the checkpoint's config
@click.option("--device", default="auto", show_default=True, help=DEVICE_HELP)
@click.option(
    "--variant",
    default=None,
    help="Label the results as this variant of the same trained model (naive-loop-ee: a base-loop checkpoint).",
)
def eval_cmd(checkpoint, overrides, loops, config, config_alias, device, variant, **opts):
    """Evaluate CHECKPOINT: perplexity, the ten zero-shot tasks, depth distribution and latency per budget."""
    from evaluation.evaluate import run
    from evaluation.tasks import TaskDataError

    if config_alias is not None:
        raise click.UsageError(
            f"--config {config_alias}: tlf eval reads the checkpoint's own config; --check-preset PRESET refuses a "
            "checkpoint whose model section differs from a preset's, and section.key=value overrides change eval's keys"
        )
    if loops is not None and not loops.strip():  # as `--loops ' '` is: no budget named
        raise click.BadParameter(f"{loops!r} names no loop budget (expected e.g. 2,4,8)", param_hint="--loops")
    ov = list(overrides) + option_overrides(**opts)
    try:
        label = "--out" if opts["out_dir"] else "eval.out_dir"
        run(checkpoint, ov, loops=loops, config=config, device=device, variant=variant, log=click.echo, out_label=label)
    except (TaskDataError, OSError, ValueError) as e:  # OSError: a missing file, an unwritable --out
        if isinstance(e, ConfigError):
            raise
        raise click.ClickException(str(e)) from None
    except TrackingError as e:
        raise click.ClickException(f"{e} (--no-mlflow evaluates without it)") from None


def option_overrides(
    tasks,
    limit,
    batch_size,
    source,
    race_file,
    ppl_tokens,
    stride,
    no_ppl,
    no_latency,
    no_mlflow,
    strict,
    no_progress,
    out_dir,
) -> list[str]:
    """The eval.* overrides that eval_cmd's options stand for."""
    ov = []
    if tasks:
        names = [] if tasks.strip() == "none" else [t.strip() for t in tasks.split(",") if t.strip()]
        ov.append(f"eval.tasks=[{','.join(names)}]")
    for key, val in (
        ("limit", limit),
        ("batch_size", batch_size),
        ("source", source),
        ("ppl_tokens", ppl_tokens),
        ("ppl_stride", stride),
    ):
        if val is not None:
            ov.append(f"eval.{key}={val}")
    for key, val in (("race_file", race_file), ("out_dir", out_dir)):
        if val is not None:  # a JSON string is a YAML scalar: any quote survives
            ov.append(f"eval.{key}={json.dumps(val)}")
    for flag, key in (
        (no_ppl, "perplexity"),
        (no_latency, "latency"),
        (no_mlflow, "mlflow"),
        (no_progress, "progress"),
        (no_ppl, "depth"),
    ):
        if flag:
            ov.append(f"eval.{key}=false")
    if strict:
        ov.append("eval.strict=true")
    return ov
