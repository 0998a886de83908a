"""`tlf train CONFIG [OVERRIDES]` (also `python -m pipeline.train CONFIG [OVERRIDES]`): a thin wrapper over run()."""

from __future__ import annotations

import json
import os
import sys

import click

from pipeline.cli import config_arguments
from pipeline.config import ConfigError, load_config


def _check_batch(cfg, ws: int) -> None:
    """cfg.check_world_size(ws), except when a checkpoint is to be resumed and ws divides the global batch into
    micro-batches: grad-accum may then adapt to another world size (the trainer checks after reading it)."""
    t = cfg.train
    if cfg.checkpoint.resume != "none" and t.global_batch_size % (t.micro_batch_size * ws) == 0:
        from pipeline.rundir import complete_checkpoints, run_dir

        if cfg.checkpoint.resume != "auto" or complete_checkpoints(run_dir(cfg)):
            return
    cfg.check_world_size(ws)


def _finished(cfg) -> str | None:
    """The line saying the run is already complete, when checkpoint.resume finds a checkpoint at or past
    schedule.max_steps (None otherwise, also when the checkpoint cannot be read: the trainer then says why). The
    search goes by the files' sizes, and only a checkpoint that would end the run is hashed, so a run that goes on
    hashes its checkpoint once, in the trainer."""
    if cfg.checkpoint.resume == "none":
        return None
    from pipeline.rundir import STEP_DIR, damage, run_dir
    from pipeline.train.checkpoint import CheckpointError
    from pipeline.train.resume import find_resume

    def at(ck) -> int:  # the step of checkpoint dir ck, -1 for none
        m = STEP_DIR.match(ck.name) if ck is not None else None
        return int(m.group(1)) if m else -1

    try:
        ck = find_resume(cfg, run_dir(cfg), deep=False)
        if at(ck) >= cfg.schedule.max_steps and damage(ck) is not None:
            ck = find_resume(cfg, run_dir(cfg))  # an altered file: the checkpoint the trainer would take instead
    except CheckpointError:
        return None
    if at(ck) < cfg.schedule.max_steps:
        return None
    return (
        f"[tlf] run already complete: checkpoint {ck} is at step {at(ck)} of schedule.max_steps="
        f"{cfg.schedule.max_steps}; nothing to train. To train further, raise schedule.max_steps (the run resumes "
        "from this checkpoint); to train anew, checkpoint.resume=none or another checkpoint.dir"
    )


def _mlflow_settled(cfg) -> bool:
    """Whether a finished run leaves MLflow nothing to send: logging.mlflow=false, or the run its tracking.json
    names is FINISHED at this tracking URI. Otherwise its end found MLflow unreachable (or it never had a run),
    and a start replays metrics.jsonl's unsent steps (pipeline/train/spool.py), so the rerun goes on to do that."""
    if not cfg.logging.mlflow:
        return True
    from pipeline import tracking
    from pipeline.rundir import run_dir

    rec, uri = tracking.read_run_file(run_dir(cfg)), tracking.tracking_uri(cfg.logging.tracking_uri)
    if not rec.get("run_id") or rec.get("tracking_uri") != uri:
        return False
    try:
        return tracking.checked_client(uri).get_run(rec["run_id"]).info.status == "FINISHED"
    except Exception:  # noqa: BLE001 - a server down or a run gone: the start below deals with it as usual
        return False


def _nothing_left(cfg, line: str, rank0: bool) -> bool:
    """A finished run: says `line` (rank 0); True when nothing is left to do, False when MLflow still lacks steps
    (`_mlflow_settled`), which the start then sends. Every rank takes the same decision, so with more than one
    rank none asks the server (each would get its own answer) and only logging.mlflow=false stops at once."""
    if rank0:
        click.echo(line)
    if _mlflow_settled(cfg) if int(os.environ.get("WORLD_SIZE", "1")) == 1 else not cfg.logging.mlflow:
        return True
    if rank0:
        click.echo("[tlf] starting once more only to send MLflow the steps it has not received")
    return False


def _exit(code: int) -> None:
    """Leaves the process without running C++ static destructors: with gloo/DeepSpeed threads still alive those
    can abort with "terminate called without an active exception" (exit 250) after all results are written.
    Everything of ours is flushed and closed first; the process group is torn down when the run succeeded."""
    try:
        import torch.distributed as dist

        if code == 0 and dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@config_arguments
@click.option(
    "--resume",
    default=None,
    metavar="auto|none|PATH",
    help="Shorthand for checkpoint.resume=...: auto (newest complete checkpoint), none, or a path.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="When checkpoint.dir holds another run (or checkpoints past the one resumed), move it aside to "
    "<dir>.replaced-<time> and start there; without it such a start is refused. Nothing is deleted.",
)
def train(config: str, overrides: tuple[str, ...], resume: str | None, overwrite: bool) -> None:
    """Train CONFIG (a preset such as tiny/t-loopformer, or a YAML file) with OVERRIDES (section.key=value).

    \b
    Single process:     tlf train tiny/t-loopformer data.dir=data/demo
    Launcher, N ranks:  deepspeed --no_local_rank --num_gpus N $(which tlf) train CONFIG [OVERRIDES]
    (module form:       deepspeed --num_gpus N --module pipeline.train CONFIG [OVERRIDES])

    Metrics: every step is a line of <checkpoint dir>/metrics.jsonl; MLflow gets them off the training thread at
    logging.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db (logging.mlflow=false: none).

    Every key with its type, default and doc: tlf config show PRESET --doc
    """
    try:
        resume_ov = [] if resume is None else [f"checkpoint.resume={json.dumps(resume)}"]  # quotes survive
        cfg = load_config(config, [*overrides, *resume_ov])  # validated once, --resume included
        _check_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # fail fast, before the heavy imports
        done = _finished(cfg)  # a rerun of a finished run: said at once, before the heavy set-up
    except ConfigError as e:
        raise click.UsageError(f"config error: {e}") from None
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if done and _nothing_left(cfg, done, rank0):
        return
    from data_prep.files import new_dirs_removed_on_error
    from data_prep.shards import ShardError
    from pipeline.rundir import run_dir
    from pipeline.tracking import MetricsFileError
    from pipeline.train.checkpoint import CheckpointError, ensure_dir
    from pipeline.train.spikes import SpikeError
    from pipeline.train.trainer import NonFiniteError, run

    code = 0
    try:
        with new_dirs_removed_on_error(run_dir(cfg)):  # a failed start leaves no empty checkpoint.dir
            if rank0:  # every run saves at its end: a bad checkpoint.dir fails now
                ensure_dir(run_dir(cfg))
            res = run(cfg, overwrite)
        if res.stopped_by and rank0:
            click.echo(f"[tlf] stopped by {res.stopped_by} at step {res.step}; checkpoint {res.checkpoint}")
    except ConfigError as e:
        click.echo(f"Error: config error: {e}", err=True)
        code = 2
    except (ShardError, CheckpointError, NonFiniteError, SpikeError, MetricsFileError, OSError) as e:
        click.echo(f"Error: {e}", err=True)
        code = 1
    except KeyboardInterrupt:
        click.echo("Error: interrupted", err=True)
        code = 130
    except BaseException:  # noqa: BLE001 - anything else: print it, then exit through _exit like every path
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)
