"""`tlf eval CHECKPOINT [section.key=value ...]`: a thin wrapper over `evaluation.evaluate.run`."""

from __future__ import annotations

import json

import click

from data_prep.clitypes import CommaList, Device, IntOrZero
from evaluation.tasks import TASK_ORDER
from pipeline.cliopts import stored_config
from pipeline.config import VARIANTS, ConfigError
from pipeline.device import DEVICE_HELP
from pipeline.tracking import TrackingError

# --ppl-tokens (tlf eval, tlf ablate): 0 scores the whole set; else at least 2 predicted tokens
PPL_TOKENS = IntOrZero(2)


@click.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("overrides", nargs=-1)
@click.option(
    "--loops",
    type=CommaList(click.IntRange(min=1), "loop budget {}", "2,4,8"),
    metavar="M1,M2,...",
    default=None,
    help="Loop budgets M, each in 1..L, distinct (default: eval.loops, else the training L).",
)
@click.option(
    "--tasks",
    type=CommaList(click.Choice(TASK_ORDER), "task {}", "copa,piqa", none="none"),
    metavar="TASK1,TASK2,...|none",
    default=None,
    help="Zero-shot tasks, distinct, of: "
    + ", ".join(TASK_ORDER)
    + "; 'none' for none (default: eval.tasks, all ten).",
)
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Examples per task (0: all).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Sequences per forward.")
@click.option(
    "--source", type=click.Choice(["auto", "hub", "offline"]), default=None, help="Where task data comes from."
)
@click.option(
    "--race-file", type=click.Path(dir_okay=False), default=None, help="Local RACE file (EleutherAI/race schema)."
)
@click.option(
    "--ppl-tokens",
    type=PPL_TOKENS,
    default=None,
    help="Tokens per validation set for perplexity: 0 (all) or at least 2, so a perplexity averages over "
    "more than one prediction.",
)
@click.option(
    "--stride",
    type=click.IntRange(min=0),
    default=None,
    help="Sliding-window stride for perplexity (0, or the context or more: non-overlapping windows).",
)
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
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, help="Output directory.")
@click.option(
    "--check-preset",
    "config",
    default=None,
    metavar="PRESET",
    help="Refuse a checkpoint whose model section differs from this preset's.",
)
@click.option("--config", "config_alias", default=None, hidden=True)  # refused: eval reads the checkpoint's config
@click.option("--device", type=Device(), default="auto", show_default=True, help=DEVICE_HELP)
@click.option(
    "--variant",
    type=click.Choice(VARIANTS),
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
    ov = list(overrides) + option_overrides(**opts)
    if loops:  # held against the checkpoint's L before its weights load
        try:
            _, cfg = stored_config(checkpoint, ov, quiet=True)
        except FileNotFoundError:
            pass  # said by run, as every other path to the model is
        else:
            resolve_budgets_of(cfg, loops)
    try:
        label = "--out" if opts["out_dir"] else "eval.out_dir"
        run(checkpoint, ov, loops=loops, config=config, device=device, variant=variant, log=click.echo, out_label=label)
    except (TaskDataError, OSError, ValueError) as e:  # OSError: a missing file, an unwritable --out
        if isinstance(e, ConfigError):
            raise
        raise click.ClickException(str(e)) from None
    except TrackingError as e:
        raise click.ClickException(f"{e} (--no-mlflow evaluates without it)") from None


def resolve_budgets_of(cfg, loops) -> None:
    """--loops against the checkpoint's L (evaluation.evaluate.resolve_budgets: a base model, L = 1, runs any
    budget as its single pass): a usage error naming --loops."""
    from evaluation.evaluate import resolve_budgets

    try:
        resolve_budgets(cfg, list(loops))
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="'--loops'") from None


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
    if tasks is not None:
        ov.append(f"eval.tasks=[{','.join(tasks)}]")
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
