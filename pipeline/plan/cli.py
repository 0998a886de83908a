"""`tlf plan CONFIG [OVERRIDES] --gpus N --gpu NAME`: the plan of a run before spending GPU time on it
(pipeline/plan/core.py; docs/planning.md)."""

from __future__ import annotations

import json

import click

from data_prep.clitypes import CommaList, Finite, KeyedList
from data_prep.files import check_writable, write_json
from pipeline.cli import config_arguments
from pipeline.config import ConfigError, load_config
from pipeline.hardware import GPUS, gpu
from pipeline.train.ac import MODES
from pipeline.train.logger import fmt_duration

GiB = 2**30
SWEEP = KeyedList(
    {
        "zero": CommaList(click.Choice([0, 1, 2, 3]), "zero={}", "1,2,3"),
        "ac": CommaList(click.Choice(MODES), "ac={}", "none,loop"),
        "mb": CommaList(click.IntRange(min=1), "mb={}", "1,2"),
    }
)


def _gb(x: float) -> str:
    return f"{x / GiB:7.2f}"


def print_plan(p: dict) -> None:
    m, cap = p["memory"], p["capacity"]
    click.echo(
        f"{p['config']} on {p['gpus']} x {p['gpu']} ({p['precision']}, ZeRO-{p['zero_stage']}, activation "
        f"checkpointing {p['activation_checkpointing']}, micro-batch {p['micro_batch']} x grad-accum "
        f"{p['grad_accum']})" + (f", router mean depth {p['mean_depth']:.2f}" if p["mean_depth"] else "")
    )
    click.echo("per-GPU memory (GiB):")
    for label, key in [
        ("parameters", "params"),
        ("gradients", "grads"),
        ("optimizer state", "optimizer"),
        ("ZeRO gradient reduction buffers", "reduce_buffers"),
        ("activations kept for backward, loops", "activations_loops"),
        ("  embeddings + router", "embed_router"),
        ("  fused LM heads + losses", "heads"),
        ("transient (peak - the above)", "transient"),
    ]:
        click.echo(f"  {label:<40}{_gb(m[key])}")
    per = "  ".join(f"{k} {v / GiB:.2f}" for k, v in m["activations_per_loop"].items())
    if per:
        click.echo(f"  per loop application: {per}")
    if m["optimizer_step"]:  # ZeRO-1/2: the gradient partition and the fp32 copy one group steps with
        click.echo(
            f"  {'peak of backward / of the optimizer step':<40}{_gb(m['peak_backward'])} / "
            f"{m['peak_optimizer_step'] / GiB:.2f}"
        )
    verdict = "FITS" if m["fits"] else "DOES NOT FIT"
    click.echo(
        f"  {'peak':<40}{_gb(m['peak'])} of {cap / GiB:.1f}: {verdict} (headroom {m['headroom'] / GiB:+.2f} GiB)"
    )
    click.echo(
        f"FLOPs per optimizer step per GPU {p['flops_per_step_per_gpu']:.3e} "
        f"({p['flops_per_token']:.3e} per token, traced)"
    )
    click.echo(
        f"step time {p['step_time_s']:.3f} s at MFU {100 * p['mfu']:.0f}% ({p['step_time_roofline_s']:.3f} s "
        f"at the roofline), {p['tokens_per_s']:,.0f} tokens/s"
    )
    click.echo(
        f"{p['tokens'] / 1e9:.2f}B tokens ({p['steps']} steps): {fmt_duration(p['wall_clock_s'])} wall clock, "
        f"{p['gpu_hours']:,.0f} GPU-hours at MFU {100 * p['mfu']:.0f}% "
        f"({fmt_duration(p['wall_clock_roofline_s'])} at the roofline)"
    )
    click.echo(
        "largest micro-batch that fits, per activation-checkpointing mode "
        f"(ZeRO-{p['zero_stage']}; keeping global batch):"
    )
    for ac, r in p["checkpointing_modes"].items():
        keep = f"micro-batch {r['micro_batch']} x grad-accum {r['grad_accum']}" if r["micro_batch"] else "does not fit"
        click.echo(f"  {ac:<6} max {r['max_micro_batch']:>4}  -> {keep}")


@click.command("plan", context_settings={"help_option_names": ["-h", "--help"]})
@config_arguments
@click.option(
    "--gpus", type=click.IntRange(min=1), default=8, show_default=True, help="World size (data-parallel ranks)."
)
@click.option(
    "--gpu",
    "gpu_name",
    type=click.Choice(list(GPUS)),
    default="a100-80gb",
    show_default=True,
    help="Device of pipeline/hardware.py.",
)
@click.option(
    "--mfu",
    type=Finite(0, 1, min_open=True),
    default=0.4,
    show_default=True,
    help="Model FLOPs utilisation assumed for the step time.",
)
@click.option(
    "--mean-depth",
    type=Finite(1, min_open=True),
    default=None,
    help="Router mean depth, in (1, L) (default: the router's prior mean, objective.router.target_depth or (L+1)/2).",
)
@click.option(
    "--sweep",
    "sweep_items",
    type=SWEEP,
    multiple=True,
    help="A table over zero=0..3, ac=none,loop,layer, mb=N>=1 (repeatable; values distinct) instead of the "
    "single plan.",
)
@click.option(
    "--json", "json_out", default=None, metavar="PATH", help="Also write the plan as JSON (- for stdout only)."
)
def plan_cmd(config, overrides, gpus, gpu_name, mfu, mean_depth, sweep_items, json_out):
    """Plan CONFIG's run on GPUS x GPU: per-GPU peak memory with its parts, FITS / DOES NOT FIT, FLOPs, step
    time, wall clock and GPU-hours, from the real training step traced on the meta device (nothing allocated).

    \b
    tlf plan paper/t-loopformer --gpus 8 --gpu a100-80gb
    tlf plan paper/loopformer --gpus 8 --gpu a100-40gb --sweep zero=1,2,3 --sweep ac=none,loop,layer
    """
    from pipeline.plan.core import PlanError, plan, prior_counts, sweep

    hw, grid = gpu(gpu_name), dict(sweep_items)  # (a key given twice: its last values)
    if json_out and json_out != "-":  # before the minutes of planning, not after them
        check_writable(json_out, "--json", directory=False)
    try:
        cfg = load_config(config, overrides)
        prior_counts(cfg, mean_depth)  # --mean-depth against L, before the tracing
        click.echo(f"[tlf] planning {cfg.name} on {gpus} x {hw.name}: tracing the training step", err=True)
        if grid:
            out = {"config": cfg.name, "gpu": hw.name, "gpus": gpus, "rows": sweep(cfg, gpus, hw, grid, mean_depth)}
        else:
            out = plan(cfg, gpus, hw, mfu, mean_depth)
    except ConfigError as e:
        raise click.UsageError(f"config error: {e}") from None
    except PlanError as e:
        raise click.ClickException(str(e)) from None
    if json_out != "-" and grid:
        print_sweep(out, hw)
    elif json_out != "-":
        print_plan(out)
    if json_out == "-":
        click.echo(json.dumps(out, indent=2))
    elif json_out:
        try:
            write_json(json_out, out)
        except OSError as e:
            raise click.ClickException(f"--json {json_out}: not written ({e.strerror or e})") from None


def print_sweep(out: dict, hw) -> None:
    click.echo(f"{out['config']} on {out['gpus']} x {hw.name}: per-GPU peak (GiB) of {hw.memory / GiB:.1f}")
    click.echo(f"{'ZeRO':>4} {'ckpt':>6} {'mb':>4} {'peak':>8} {'headroom':>9} {'max mb':>7}  verdict")
    for r in out["rows"]:
        click.echo(
            f"{r['zero_stage']:>4} {r['activation_checkpointing']:>6} {r['micro_batch']:>4} "
            f"{r['peak'] / GiB:8.2f} {r['headroom'] / GiB:+9.2f} {r['max_micro_batch']:>7}  "
            f"{'FITS' if r['fits'] else 'DOES NOT FIT'}"
        )
