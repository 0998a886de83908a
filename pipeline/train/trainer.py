"""The training loop: `Trainer.build(cfg)` sets a run up once, `train_step()` runs one optimizer step's
micro-batches, `fit()` loops over steps and calls the callbacks (pipeline.train.callbacks: speed/MFU, memory,
validation, checkpoints, console, MLflow). `run(cfg)` = `Trainer.build(cfg).fit()` is the whole of `tlf train`
(the CLI is a thin wrapper; tests call it).

One step = train.grad_accum_steps micro-batches through the DeepSpeed engine, which trains the `Objective`
(pipeline/train/objective.py) wrapped around the network: `engine(x, y)` computes the whole training objective in
one forward; `engine.backward`; `engine.step`. The shortcut pass's schedule is one per optimizer step, drawn from
(train.seed, step) (`step_shortcut`, `Trainer.shortcut`): every micro-batch of the step on every rank runs it (ZeRO-3
gathers parameters per block call, so all ranks must run the same loops), whatever the world size, grad-accum or
ZeRO stage, so a run resumed on another layout draws what the uninterrupted run drew. The rule is saved in the
training state (`schedule`); a checkpoint without one (tlf's older ones) keeps its run's rule: the objective draws
one schedule per micro-batch from torch's RNG. Host syncs: the loss, its parts, the router statistics, a
non-finite flag per micro-batch, the stop-signal flag and the gradient norm stay on the device (`StepMeter`) and
are summed over ranks in one all-reduce and read once, after the step's last micro-batch: one device -> host sync
per optimizer step, so every rank takes the same decision; callbacks get host values only. A non-finite loss
stops the run naming the step and micro-batch (train.nan_policy=stop; the step's update is never saved, the last
good checkpoint stays the newest). nan_policy=skip must decide before each backward, so it reads one flag per
micro-batch (all-reduced) and drops a bad micro-batch, drawing the next one (at most train.nan_skip_limit in a
row). SIGTERM/SIGINT end the run after the current step with a checkpoint. A non-finite gradient norm always stops.
At the accumulation boundary the callbacks see the gradients (`pre_update`) and may discard the update
(`ds.discard_update`: no optimizer or LR step): train.spike_policy=skip does so at a loss spike, reading the step's
loss once more there (pipeline/train/spikes.py); the gradient statistics of log steps (gradstats.py) add their sums
to the step's one read (`StepMeter.add_sum`).
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.config import Config
from pipeline.model.schedule import step_shortcut
from pipeline.rundir import run_dir
from pipeline.train import checkpoint as ckpt
from pipeline.train.logger import log
from pipeline.train.objective import Objective, ObjectiveOutput
from pipeline.train.validation import sum_over_ranks


STEP_KEYED = "step-keyed"  # the training state's `schedule`: one shortcut schedule per (train.seed, step)
GLOBAL_RNG = "global-rng"  # ... of a checkpoint written before it: one per micro-batch from torch's RNG (each rank's)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message names the step and the last good checkpoint."""


@dataclass
class TrainResult:
    start_step: int  # optimizer steps done before this invocation (resumed from)
    step: int  # optimizer steps done at the end
    losses: list[float] = field(default_factory=list)  # mean training loss of each step of this invocation
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (first val dir)
    checkpoint: str | None = None  # newest checkpoint written or resumed from
    run_id: str | None = None  # MLflow run
    stopped_by: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early
    skipped: int = 0  # micro-batches dropped under nan_policy=skip
    spikes: list[int] = field(default_factory=list)  # steps of this invocation whose loss was a spike
    skipped_updates: int = 0  # updates discarded under spike_policy=skip, the run's resumes included


class _Signals:
    """SIGTERM/SIGINT set a flag (acted on after the current step); a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        log.info(f"{self.name} received: saving a checkpoint after this step, then exiting")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class StepWork:
    """What an optimizer step computed per token, for MFU (`LoopedLM.flops_per_token`): the loops executed (mean
    depth, both passes summed) and the LM-head applications."""

    loops: float
    lm_heads: int


class StepMeter:
    """One optimizer step's losses, non-finite flags and router statistics, accumulated on the device; `read`
    sums them over ranks in one all-reduce and reads them with the step's one host sync. The names are the
    `ObjectiveOutput`'s (its parts, its statistics under `router/`)."""

    PARTS = ObjectiveOutput.PARTS

    def __init__(self, accum: int, device):
        self.device, self.n = device, 0
        self.grad_norm = None  # the step's gradient norm (device tensor, float or None), set by Trainer.train_step
        self.losses = torch.zeros(1 + len(self.PARTS), dtype=torch.float64, device=device)  # loss, parts: sums
        self.bad = torch.zeros(accum, dtype=torch.float64, device=device)  # 1 where micro-batch k was non-finite
        self.stats: dict[str, torch.Tensor] = {}  # key -> sum over micro-batches (vectors zero-padded)
        self.hists: set[str] = set()  # the keys that are histograms (a vector per micro-batch, not a scalar)
        self.parts: list[str] = []  # the parts the objective has, in PARTS order
        self.loops = torch.zeros(1, dtype=torch.float64, device=device)  # sum of ObjectiveOutput.loops_executed
        self.lm_heads = 1
        self.discarded = False  # the step's update was discarded (a callback's pre_update said so)
        self.sums: dict[str, torch.Tensor] = {}  # callbacks' device values (`add_sum`), summed over ranks in `read`
        self.summed: dict[str, list[float]] = {}  # ... and read: host values, after `read`

    def add_sum(self, key: str, value: torch.Tensor) -> None:
        """A callback's device value (any shape), summed over ranks in the step's one all-reduce and read with it:
        `summed[key]` (a list of floats) after `read`. Every rank adds the same keys in the same order."""
        self.sums[key] = value.detach().to(self.device, torch.float64).reshape(-1)

    def add(self, out: ObjectiveOutput, k: int) -> None:
        loss = out.loss.detach().double()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        parts = out.parts
        vals = torch.stack([loss] + [parts[p].double() if p in parts else zero for p in self.PARTS])
        finite = torch.isfinite(loss)
        self.losses += torch.where(finite, vals, 0.0)
        self.bad[k] = (~finite).double()
        for key, v in out.stats.items():
            if v.dim() > 0:  # a histogram such as depth_hist (M,), whatever its length: one depth is still one
                self.hists.add(key)
            v = v.detach().to(self.device, torch.float64).reshape(-1)
            cur = self.stats.get(key)
            if cur is not None:  # histograms of shortcut passes of different S: pad to the longer
                n = max(cur.numel(), v.numel())
                cur, v = F.pad(cur, (0, n - cur.numel())), F.pad(v, (0, n - v.numel()))
                v = cur + v
            self.stats[key] = v
        self.parts = [p for p in self.PARTS if p in parts or p in self.parts]
        self.loops += out.loops_executed.detach().to(self.device, torch.float64)
        self.lm_heads = out.lm_heads
        self.n += 1

    def read(self, signal: bool, ws: int) -> dict:
        """All-reduce + the one host read (`grad_norm`: a device tensor, read here, a float or None).
        Returns loss/parts means over micro-batches and ranks (0 for a part the objective lacks; `parts` names
        those it has), the first non-finite micro-batch (1-based, 0: none), whether any rank was signalled, the
        gradient norm, the `router/...` metrics and the step's `work` (StepWork)."""
        sig = torch.tensor([1.0 if signal else 0.0], dtype=torch.float64, device=self.device)
        grad_norm = self.grad_norm
        gn = grad_norm.detach().double().reshape(1).to(self.device) if isinstance(grad_norm, torch.Tensor) else None
        keys = list(self.stats)
        vec = torch.cat(
            [self.losses, self.bad, sig, self.loops]
            + ([gn] if gn is not None else [])
            + [self.stats[k] for k in keys]
            + list(self.sums.values())
        )
        v = sum_over_ranks(vec)  # the optimizer step's one device -> host sync
        a = len(self.bad)
        n = max(self.n, 1)
        n_loss = 1 + len(self.PARTS)
        losses, bad, rest = v[:n_loss], v[n_loss : n_loss + a], v[n_loss + a :]
        out = {
            "loss": losses[0] / ws / n,
            **{p: x / ws / n for p, x in zip(self.PARTS, losses[1:])},
            "parts": list(self.parts),
            "bad_micro_batch": next((k + 1 for k, b in enumerate(bad) if b > 0), 0),
            "signal": rest[0] > 0,
            "work": StepWork(rest[1] / ws / n, self.lm_heads),
        }
        rest = rest[2:]
        if gn is not None:
            out["grad_norm"], rest = rest[0] / ws, rest[1:]
        else:
            out["grad_norm"] = grad_norm
        metrics = {}
        for key in keys:
            vals, rest = rest[: self.stats[key].numel()], rest[self.stats[key].numel() :]
            if key not in self.hists:
                metrics[f"router/{key}"] = vals[0] / ws / n
            else:  # depth_hist: share of tokens per depth 1..M (one entry when the pass ran one loop)
                for i, x in enumerate(vals, 1):
                    metrics[f"router/{key.replace('depth_hist', 'depth_share')}_{i}"] = x / ws / n
        out["router"] = metrics
        for key, v in self.sums.items():
            self.summed[key], rest = rest[: v.numel()], rest[v.numel() :]
        return out


class Trainer:
    """One training run, built once from the config (`build`); `fit()` trains it, `train_step()` is one step.

    Callbacks (pipeline.train.callbacks.Callback) get `trainer` set to this object and their hooks called in
    list order: pre_train, then per step pre_step(step), pre_update(step, meter) and post_update(step, meter) around
    the optimizer step at the accumulation boundary (a pre_update returning False discards the update),
    post_step(step, metrics) (add to the host-side metrics), log_metrics(step, metrics) (emit them), end_step(step)
    (not after a stop signal); post_train (the loop is over, also after a stop signal); post_checkpoint_saved(step,
    path) from `save_checkpoint`; on_error(exc) when anything raises; close(status) always, last (status FINISHED,
    KILLED after a signal, FAILED). Each callback's state_dict() goes into every checkpoint's training state and
    comes back through load_state_dict when a run resumes from it (in `build`)."""

    def __init__(
        self,
        cfg: Config,
        *,
        rank: int,
        world_size: int,
        device_kind: str,
        precision: str,
        root: Path,
        loader,
        val: list,
        model,
        engine,
        step: int,
        run_id: str | None,
        resume_from: Path | None,
        callbacks: list,
    ) -> None:
        self.cfg, self.rank, self.ws, self.device_kind, self.precision = cfg, rank, world_size, device_kind, precision
        self.root, self.loader, self.val, self.model, self.engine = root, loader, val, model, engine
        self.device, self.accum = engine.device, cfg.train.grad_accum_steps
        self.step, self.run_id, self.resume_from = step, run_id, resume_from
        self.max_steps = cfg.schedule.max_steps
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.block_size
        self.result = TrainResult(
            start_step=step, step=step, checkpoint=str(resume_from) if resume_from else None, run_id=run_id
        )
        self.last_saved = step if resume_from is not None else -1
        self.consecutive_bad = 0  # nan_policy=skip: non-finite micro-batches in a row
        self._signals: _Signals | None = None
        self.resume_note = ""  # how a resume on another world size or ZeRO stage adapted (logged by fit)
        self.branch: dict = {}  # a start from another run's checkpoint: where it branched from (MLflow tags)
        self.data_wait_s = 0.0  # seconds this step's micro-batches waited for the loader (perf/data_wait_ms)
        self.schedule = STEP_KEYED  # how shortcut schedules are drawn (build: the resumed checkpoint's rule)
        self.work = StepWork(float(cfg.model.loops), 1)  # the last step's work per token (Speed's MFU)
        # seconds spent in optimizer steps (validation, checkpoints and logging excluded) and the tokens they
        # trained, summed over the run and its resumes: train_time_s, train_tokens (tlf compare's tokens/s)
        self.train_time_s, self.train_tokens = 0.0, 0
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            cb.trainer = self

    @classmethod
    def build(
        cls, cfg: Config, callbacks: list | None = None, *, loader=None, model=None, overwrite: bool = False
    ) -> "Trainer":
        """Device, process group, determinism, resume, loaders, network, DeepSpeed engine, in that order. callbacks:
        None for `default_callbacks()`; loader: instead of the TrainLoader over data.dir (anything with next() ->
        (x, y), epoch, state_dict(), load_state_dict()); model: a fresh LoopedLM(cfg.model) to train instead of a new
        one (e.g. with weights set by a benchmark before the engine is built); overwrite: a start that would overwrite
        what the run directory holds moves it aside instead of refusing (pipeline/train/resume.py `claim`)."""
        from pipeline.train import determinism, ds
        from pipeline.train.callbacks import default_callbacks
        from pipeline.train.data import build_loaders
        from pipeline.train.resume import Resume

        device_kind = ds.resolve_device(cfg)
        precision = ds.resolve_precision(cfg, device_kind)
        rank, _, ws = ds.init_distributed(device_kind)
        determinism.apply(cfg.train.deterministic, device_kind)
        root = run_dir(cfg)
        log.open(rank)  # so a damaged newest checkpoint is reported (once, by rank 0) as it is passed over
        resume = Resume.find(cfg, root, ws, overwrite)  # another world size or ZeRO stage: grad-accum adapts
        ds_config = ds.build_ds_config(cfg, ws, precision)  # checks the batch sizes against ws (check_world_size)
        loader, val = build_loaders(cfg, rank, ws, loader)
        model = _network(cfg, model)
        resume.load_weights(model)  # resharding: the full weights go in before the engine partitions them
        optimizer, scheduler = ds.build_optimizer(cfg, model)
        engine = ds.initialize(Objective(model, cfg.objective), optimizer, scheduler, ds_config)
        step, run_id = resume.restore(engine, model, loader, rank, ws)
        branch = resume.branch(root, run_id)  # from another run's checkpoint: a new MLflow run, tagged
        run_id = None if branch else run_id
        trainer = cls(
            cfg,
            rank=rank,
            world_size=ws,
            device_kind=device_kind,
            precision=precision,
            root=root,
            loader=loader,
            val=val,
            model=model,
            engine=engine,
            step=step,
            run_id=run_id,
            resume_from=resume.path,
            callbacks=default_callbacks() if callbacks is None else callbacks,
        )
        trainer.resume_note, trainer.branch = resume.note, branch
        saved = (resume.state or {}).get("callbacks", {})  # each callback's own state, from this rank's file
        for cb in trainer.callbacks:
            if type(cb).__name__ in saved:
                cb.load_state_dict(saved[type(cb).__name__])
        if resume.saved is not None:  # a checkpoint written before they were kept: counted from this resume on
            trainer.train_time_s = float(resume.saved.get("train_time_s", 0.0))
            trainer.train_tokens = int(resume.saved.get("train_tokens", 0))
        trainer.schedule = resume.saved.get("schedule", GLOBAL_RNG) if resume.saved is not None else STEP_KEYED
        return trainer

    # ------------------------------------------------------------------------------------------- one step
    def train_step(self) -> StepMeter:
        """The micro-batches of one optimizer step: forward, backward, engine.step each (DeepSpeed updates after
        the last); nan_policy=skip drops a non-finite micro-batch before its backward and draws the next. Returns
        the step's meter, still on the device (`read` is the step's host sync); its grad_norm is set."""
        engine, device = self.engine, self.device
        meter = StepMeter(self.accum, device)
        done, zero0_norm = 0, None
        shortcut = self.shortcut(self.step + 1)  # (S,) on the CPU, or None
        while done < self.accum:
            t0 = time.perf_counter()
            x, y = self.loader.next()  # (B, T) each
            self.data_wait_s += time.perf_counter() - t0
            out = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True), shortcut=shortcut)
            if self.cfg.train.nan_policy == "skip" and self._skip(out.loss, done):
                del out
                continue
            engine.backward(out.loss)
            meter.add(out, done)
            if done == self.accum - 1:
                zero0_norm = _zero0_grad_norm(engine)
                self._update(meter)  # the boundary: engine.step(), or the update discarded
            else:
                engine.step()
            done += 1
        gn = None if meter.discarded else engine.get_global_grad_norm()  # (discarded: DeepSpeed's says inf)
        meter.grad_norm = zero0_norm if gn is None else gn
        return meter

    def _update(self, meter: StepMeter) -> None:
        """The accumulation boundary of step self.step + 1: the callbacks see the gradients (pre_update; a False
        from any discards the update), then engine.step() or `ds.discard_update` (the gradients dropped, no
        optimizer or LR step), then post_update."""
        from pipeline.train.ds import discard_update

        step = self.step + 1
        keep = [cb.pre_update(step, meter) for cb in self.callbacks]  # every callback sees it
        meter.discarded = any(k is False for k in keep)
        if meter.discarded:
            discard_update(self.engine)
        else:
            self.engine.step()
        self._call("post_update", step, meter)

    def shortcut(self, step: int) -> torch.Tensor | None:
        """The shortcut schedule of optimizer step `step` (1-based), the same on every rank and micro-batch; None
        without a shortcut pass, or under a checkpoint's old rule (the objective draws per micro-batch)."""
        c = self.cfg
        if not c.objective.shortcut or self.schedule != STEP_KEYED:
            return None
        return step_shortcut(c.model.loops, c.train.seed, step)

    def _skip(self, loss: torch.Tensor, done: int) -> bool:
        """nan_policy=skip: whether micro-batch done+1 is non-finite on any rank (one read, before its backward)."""
        if sum_over_ranks((~torch.isfinite(loss.detach())).double().reshape(1))[0] == 0:
            self.consecutive_bad = 0
            return False
        msg = f"non-finite loss at step {self.step + 1} (micro-batch {done + 1}/{self.accum})"
        self.consecutive_bad += 1
        self.result.skipped += 1
        log.warn(f"{msg}; skipped (train.nan_policy=skip, {self.consecutive_bad} in a row)")
        if self.consecutive_bad >= self.cfg.train.nan_skip_limit:
            raise NonFiniteError(
                f"{msg}: {self.consecutive_bad} non-finite batches in a row "
                f"(train.nan_skip_limit); stopping. Last good checkpoint: {self.last_good()}"
            )
        return True

    def read(self, meter: StepMeter) -> dict:
        """The step's one host read (all ranks: losses, flags, stop signal, grad norm, router statistics)."""
        signalled = self._signals is not None and self._signals.name is not None
        return meter.read(signalled, self.ws)

    def last_good(self) -> str:
        return self.result.checkpoint or "none (no checkpoint was written)"

    def is_log_step(self, step: int) -> bool:
        """Console line and MLflow flush: every train.log_interval steps, the first step run and the last."""
        return step % self.cfg.train.log_interval == 0 or step == self.max_steps or step == self.result.start_step + 1

    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "world_size": self.ws,
            "rank": self.rank,
            "loader": self.loader.state_dict(),
            "rng": ckpt.rng_state(),
            "objective": self.engine.module.state(),
            "schedule": self.schedule,
            "callbacks": {type(cb).__name__: st for cb in self.callbacks if (st := cb.state_dict()) is not None},
            "train_time_s": self.train_time_s,
            "train_tokens": self.train_tokens,
            "config": self.cfg.to_dict(),
            "mlflow_run_id": self.run_id,
        }
        path = ckpt.save(self.engine, self.model, self.cfg, self.root, self.step, state, self.rank)
        self.last_saved, self.result.checkpoint = self.step, str(path)
        self._call("post_checkpoint_saved", self.step, path)
        return path

    # ------------------------------------------------------------------------------------------- the loop
    def fit(self) -> TrainResult:
        """Trains to schedule.max_steps (or a stop signal), calling the callbacks; see the class doc."""
        res, status = self.result, "FAILED"
        log.open(self.rank)
        if self.resume_note:
            log.info(self.resume_note)
        if self.schedule != STEP_KEYED and self.cfg.objective.shortcut:
            log.info(OLD_SCHEDULE)
        try:
            with _Signals() as self._signals:
                self._call("pre_train")
                while self.step < self.max_steps:
                    self._call("pre_step", self.step + 1)
                    t0 = time.perf_counter()
                    r = self.read(self.train_step())
                    self.train_time_s += time.perf_counter() - t0
                    self.train_tokens += self.tokens_per_step
                    if r["bad_micro_batch"]:
                        raise NonFiniteError(
                            f"non-finite loss at step {self.step + 1} (micro-batch "
                            f"{r['bad_micro_batch']}/{self.accum}); stopping. Last good checkpoint: "
                            f"{self.last_good()}"
                        )
                    self.step += 1
                    self.work = r["work"]
                    res.losses.append(r["loss"])
                    if r["grad_norm"] is not None and not math.isfinite(r["grad_norm"]):
                        raise NonFiniteError(
                            f"non-finite gradient norm at step {self.step}; stopping. Last good "
                            f"checkpoint: {self.last_good()}"
                        )
                    metrics = self._metrics(r)
                    self._call("post_step", self.step, metrics)
                    self._call("log_metrics", self.step, metrics)
                    if r["signal"]:
                        res.stopped_by = self._signals.name or "signal"
                        log.info(f"stopping at step {self.step} ({res.stopped_by} on some rank)")
                        break
                    self._call("end_step", self.step)
                self._call("post_train")
            status = "KILLED" if res.stopped_by else "FINISHED"
        except BaseException as e:
            self._call("on_error", e)
            raise
        finally:
            res.step = self.step
            self._signals = None
            try:
                self._call("close", status)
            finally:
                log.close()
        return res

    def _metrics(self, r: dict) -> dict:
        """The step's own metrics from its readout: loss and parts, lr, epoch, grad norm, router statistics."""
        out = {"loss": r["loss"], "lr": _lr_of_step(self.engine), "epoch": self.loader.epoch}
        out["perf/data_wait_ms"], self.data_wait_s = 1e3 * self.data_wait_s, 0.0
        out.update(train_time_s=self.train_time_s, train_tokens=self.train_tokens)
        out.update({p: r[p] for p in r["parts"]})
        if r["grad_norm"] is not None:
            out["grad_norm"] = r["grad_norm"]
        out.update(r["router"])
        return out

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)


OLD_SCHEDULE = (
    "the checkpoint resumed was written before step-keyed shortcut schedules: this run keeps drawing one schedule "
    "per micro-batch from each rank's torch RNG (a resume on another world size or ZeRO stage is not exact); a run "
    "started afresh draws one per optimizer step from (train.seed, step)"
)


def run(cfg: Config, overwrite: bool = False) -> TrainResult:
    """Trains cfg (a resolved Config) from scratch or from a checkpoint with the default callbacks; a start that
    would overwrite what checkpoint.dir holds is refused, or with `overwrite` moves it aside first."""
    return Trainer.build(cfg, overwrite=overwrite).fit()


def _zero0_grad_norm(engine) -> torch.Tensor | None:
    """ZeRO-0 fp32 does not report a gradient norm: compute it from the (already all-reduced) grads, as a
    device tensor (read with the step's other values)."""
    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.nn.utils.get_total_norm(grads)


def _lr_of_step(engine) -> float:
    """The learning rate of the step's update: of the update just taken (LambdaLR has already advanced to the next
    one), or of the one discarded (train.spike_policy=skip: LambdaLR did not advance)."""
    sched = engine.lr_scheduler
    f = sched.lr_lambdas[0]
    return sched.base_lrs[0] * f(sched.last_epoch - (1 if engine.was_step_applied() else 0))


def _network(cfg: Config, model=None):
    """The network to train: a new LoopedLM(cfg.model) unless `model` is given, with activation checkpointing and
    torch.compile applied. Seeded from train.seed first, the same on every rank: identical initial weights, and (a
    checkpoint's old rule: per micro-batch from this RNG) the same shortcut schedule sampled on every rank (ZeRO-3
    gathers parameters per block call, so all ranks must run the same number of loops; the step-keyed rule draws one
    per step, `Trainer.shortcut`)."""
    from pipeline.model import LoopedLM
    from pipeline.train.ac import apply_ac
    from pipeline.train.recipes import init_router

    _seed(cfg.train.seed)
    if model is None:
        model = LoopedLM(cfg.model)
        init_router(model, cfg.objective.router)  # the router recipe's init (the paper's: the network's own)
    apply_ac(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        from pipeline.train.compile import apply_compile

        apply_compile(model)
    return model


def _seed(seed: int) -> None:
    """Python's, numpy's and torch's (CPU and every CUDA device) RNGs seeded from `seed`."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
