"""Resuming a run, in two steps around the engine's construction (`Trainer.build`):

    resume = Resume.find(cfg, root, ws)   # which checkpoint; may the config continue it; grad-accum for this layout
    resume.load_weights(model)            # another world size or ZeRO stage: the full weights, before partitioning
    step, run_id = resume.restore(engine, model, loader, rank, ws)   # optimizer, schedule, data, objective, RNG

`checkpoint.resume` = auto (the newest intact checkpoint of the run directory, pipeline/rundir.py), none, a
checkpoint dir or a run dir; a damaged newest checkpoint is passed over with a warning. A checkpoint written by
the same number of ranks under the same ZeRO stage loads as DeepSpeed wrote it (each rank its own state file);
another layout goes through pipeline/train/reshard.py, every rank continuing from rank 0's state (its RNG states
are the same on every rank). A fresh run (nothing to resume) passes through every step unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import Config, ConfigError, ModelConfig, upgrade
from pipeline.rundir import damage, lost_by_start, move_aside, newest_intact, own_checkpoint
from pipeline.train import checkpoint as ckpt, reshard
from pipeline.train.logger import log


@dataclass
class Resume:
    """What a run continues from: nothing (`path` None), or checkpoint dir `path` with rank 0's training state
    (`saved`: its step, world size, config, RNG states), what the resume adapted or what changed (`note`, logged
    when the run starts) and whether the layout changed (`reshard`)."""

    path: Path | None = None
    saved: dict | None = None
    note: str = ""
    reshard: bool = False
    state: dict | None = None  # this rank's training state, once `restore` has read it (callbacks' states)
    _full: dict | None = field(
        default=None, repr=False
    )  # resharding: the full per-parameter state (reshard.full_state)

    @classmethod
    def find(cls, cfg: Config, root: Path, ws: int, overwrite: bool = False) -> Resume:
        """The checkpoint to resume from under run directory `root` (`claim`: rank 0 checks its files and that the
        start overwrites nothing, for every rank), checked against cfg (`check_compatible`); on another world size
        or ZeRO stage cfg's grad-accum is adapted (`adapt_to_layout`)."""
        path = on_rank0(lambda: claim(cfg, root, overwrite))
        if path is None:
            return cls()
        saved = ckpt.read_state(path, 0, None)
        changed = check_compatible(cfg, saved["config"], path)
        layout = adapt_to_layout(cfg, saved, ws)
        return cls(path, saved, "; ".join(n for n in (layout, changed) if n), bool(layout))

    def load_weights(self, model) -> None:
        """Resharding: the checkpoint's full fp32 weights into the fresh network, before the engine partitions them
        (a no-op otherwise: DeepSpeed loads its own files in `restore`)."""
        if self.reshard:
            self._full = reshard.full_state(self.path)
            reshard.load_weights(model, self._full)

    def branch(self, root: Path, run_id: str | None) -> dict:
        """Where a run that starts from a checkpoint outside its run directory `root` branched from (a cooldown
        from another run's stable checkpoint, or a run moved aside by --overwrite): {"branched_from": the checkpoint,
        "branched_from_step", "branched_from_run": its MLflow run id or ""}; {} for a fresh run or a resume of root's
        own checkpoint. Such a run logs to a new MLflow run with these tags, never to the source's."""
        if self.path is None or own_checkpoint(root, self.path):
            return {}
        return {
            "branched_from": str(self.path),
            "branched_from_step": int(self.saved["step"]),
            "branched_from_run": run_id or "",
        }

    def restore(self, engine, model, loader, rank: int, ws: int) -> tuple[int, str | None]:
        """Optimizer, LR schedule and step counters, data position, the Objective's own state and the RNG states
        (last, so nothing after it draws); returns (step, MLflow run id), (0, None) for a fresh run."""
        if self.path is None:
            return 0, None
        # another world size: every rank continues from rank 0's state (RNG states are the same on every rank)
        state = ckpt.read_state(self.path, rank, ws) if self.saved["world_size"] == ws else self.saved
        self.state = state
        if self.reshard:  # the full state `load_weights` read
            reshard.load_optimizer(engine, model, self._full, rank)
        else:
            ckpt.load_engine(engine, self.path)
        loader.load_state_dict(state["loader"])
        try:  # the Objective's own state (the kind table)
            engine.module.load_state(state.get("objective", {}), str(self.path))
        except ValueError as e:
            raise ckpt.CheckpointError(str(e)) from e
        _schedule_from_config(engine)
        ckpt.set_rng_state(state["rng"])
        step = int(state["step"])
        if engine.global_steps != step:
            raise ckpt.CheckpointError(f"{self.path}: DeepSpeed is at step {engine.global_steps}, our state at {step}")
        return step, state.get("mlflow_run_id")


def _schedule_from_config(engine) -> None:
    """The learning rate of the next update from this run's schedule (its LambdaLR's lambda, built from the config)
    at the restored step, not the one the checkpoint's optimizer holds, which its own schedule computed: a run
    resumed with another schedule.max_steps (a wsd run extended, or cooled down) continues on the new curve. The
    same schedule gives the same float."""
    sched = engine.lr_scheduler
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]


def on_rank0(fn):
    """fn() run by rank 0 alone (it reads and hashes files, or moves a run directory), its value or its exception
    given to every rank (a process group of one: just fn())."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box: list = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = fn()
        except (ConfigError, ckpt.CheckpointError, OSError) as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    return box[0]


def claim(cfg: Config, root: Path, overwrite: bool) -> Path | None:
    """The checkpoint a run in `root` starts from (`find_resume`), once it is sure the start overwrites nothing
    (`rundir.lost_by_start`): a start that would replace another run's checkpoints, metrics or MLflow run, or this
    run's checkpoints past the start, is a CheckpointError naming them and the two ways on; with `overwrite`, root
    is moved aside whole (`rundir.move_aside`; a start inside it follows it there) and the run starts in an empty
    root."""
    start = find_resume(cfg, root, log.warn)
    lost = lost_by_start(root, start, cfg.checkpoint.resume == "auto")
    if lost is None:
        return start
    where = f"from {start}" if start is not None else "at step 0"
    if not overwrite:
        raise ckpt.CheckpointError(
            f"checkpoint.dir={root} holds {lost}; a run starting {where} would overwrite it. Choose another "
            f"checkpoint.dir, or add --overwrite to move {root} aside to {root}.replaced-<time> (nothing is deleted)"
        )
    own = own_checkpoint(root, start)
    aside = move_aside(root)
    root.mkdir(parents=True)
    log.info(f"--overwrite: moved {root} ({lost}) aside to {aside}")
    return aside / start.name if own else start


def find_resume(cfg: Config, root: Path, warn=None, deep: bool = True) -> Path | None:
    """The checkpoint dir to resume from: checkpoint.resume = auto (newest intact under root, if any), none, a
    checkpoint dir, or a run dir (its newest intact checkpoint; `latest` is only a hint for other tools). A damaged
    newest checkpoint is passed over with `warn(one line naming it and the one used instead)`. deep=False: intact
    by the files' sizes alone (`rundir.damage`), no file read."""
    r = cfg.checkpoint.resume
    if r == "none":
        return None
    if r == "auto":
        return newest_intact(root, warn, deep)
    p = Path(r)
    if (p / "rank0_state.pt").is_file():
        why = damage(p, deep)
        if why:
            raise ckpt.CheckpointError(f"checkpoint.resume={r}: damaged checkpoint ({why}); resume from another one")
        return p
    found = newest_intact(p, warn, deep)
    if found is not None:
        return found
    raise ckpt.CheckpointError(
        f"checkpoint.resume={r}: no intact checkpoint there (expected global_step<N>/rank0_state.pt)"
    )


def adapt_to_layout(cfg: Config, saved: dict, ws: int) -> str:
    """Resuming a checkpoint written by another number of ranks or ZeRO stage: sets train.grad_accum_steps so
    that the global batch stays train.global_batch_size (when it divides); returns a line saying what changed,
    "" when nothing did (the checkpoint then loads as DeepSpeed wrote it)."""
    t = cfg.train
    was_ws, was_stage = int(saved["world_size"]), int(saved["config"]["train"].get("zero_stage", t.zero_stage))
    if was_ws == ws and was_stage == t.zero_stage:
        return ""
    per = t.micro_batch_size * ws
    if (
        was_ws != ws
        and t.global_batch_size % per == 0
        and t.micro_batch_size * t.grad_accum_steps * ws != t.global_batch_size
    ):
        t.grad_accum_steps = t.global_batch_size // per
    return (
        f"resuming a checkpoint of {was_ws} ranks under ZeRO-{was_stage} on {ws} ranks under ZeRO-{t.zero_stage}: "
        f"global batch {t.global_batch_size} = micro-batch {t.micro_batch_size} x grad-accum {t.grad_accum_steps} "
        f"x {ws} ranks; weights, AdamW moments, LR schedule and data position carried over"
    )


def check_compatible(cfg: Config, saved: dict, path: Path) -> str:
    """Resuming needs the same network and data order: a `model` field outside `ModelConfig.RESUMABLE`, or the
    batch sizes or seed, that differs from the checkpoint's (its config `upgrade`d: older checkpoints hold the
    objective under `model`) is an error naming each key. The `objective` section and the execution knobs may
    change (the other sections too: schedule length, logging, ...); returns a note naming those that did ("" when
    none)."""
    now, was = cfg.to_dict(), upgrade(saved)
    changed = {
        f"{sec}.{k}": (was.get(sec, {}).get(k), v)
        for sec in ("model", "objective")
        for k, v in now[sec].items()
        if was.get(sec, {}).get(k) != v
    }
    free = {f"model.{k}" for k in ModelConfig.RESUMABLE} | {f"objective.{k}" for k in now["objective"]}
    diff = [f"{k} ({a!r} -> {b!r})" for k, (a, b) in changed.items() if k not in free]
    for k in ("micro_batch_size", "global_batch_size", "seed"):  # world size and ZeRO stage may change
        if was["train"].get(k) != now["train"][k]:
            diff.append(f"train.{k} ({was['train'].get(k)!r} -> {now['train'][k]!r})")
    if diff:
        raise ConfigError(
            f"cannot resume from {path}: config differs in {', '.join(diff)} "
            "(use checkpoint.resume=none or another checkpoint.dir)"
        )
    kept = [f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items() if k in free]
    return f"resuming with the objective or execution changed: {', '.join(kept)}" if kept else ""
