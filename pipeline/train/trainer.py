"""The training loop: `run(cfg)` is the whole of `tlf train` (the CLI is a thin wrapper; tests call it).

One step = train.grad_accum_steps micro-batches through the DeepSpeed engine (`engine(x, y)` computes the whole
training objective in one forward; `engine.backward`; `engine.step`). Host syncs: the loss, its parts, the
router statistics, a non-finite flag per micro-batch, the stop-signal flag and the gradient norm stay on the
device (`StepMeter`) and are summed over ranks in one all-reduce and read once, after the step's last
micro-batch: one device -> host sync per optimizer step, so every rank takes the same decision. A non-finite loss
stops the run naming the step and micro-batch (train.nan_policy=stop; the step's update is never saved, the last
good checkpoint stays the newest). nan_policy=skip must decide before each backward, so it reads one flag per
micro-batch (all-reduced) and drops a bad micro-batch, drawing the next one (at most train.nan_skip_limit in a
row). SIGTERM/SIGINT end the run after the current step with a checkpoint. A non-finite gradient norm always stops.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.config import Config, ConfigError
from pipeline.train import checkpoint as ckpt
from pipeline.train.logger import fmt_duration, log, memory_metrics


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


def _sum_over_ranks(t: torch.Tensor) -> list[float]:
    """All-reduces a small float64 vector and reads it: the host sync of whoever calls it."""
    torch.distributed.all_reduce(t)
    return t.tolist()


class StepMeter:
    """One optimizer step's losses, non-finite flags and router statistics, accumulated on the device; `read`
    sums them over ranks in one all-reduce and reads them with the step's one host sync."""

    PARTS = ("loss_L", "loss_S", "loss_align", "loss_router")

    def __init__(self, accum: int, device):
        self.device, self.n = device, 0
        self.losses = torch.zeros(1 + len(self.PARTS), dtype=torch.float64, device=device)  # loss, parts: sums
        self.bad = torch.zeros(accum, dtype=torch.float64, device=device)  # 1 where micro-batch k was non-finite
        self.stats: dict[str, torch.Tensor] = {}  # key -> sum over micro-batches (vectors zero-padded)

    def add(self, out, k: int) -> None:
        loss = out.loss.detach().double()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        vals = torch.stack([loss] + [out.parts[p].double() if p in out.parts else zero for p in self.PARTS])
        finite = torch.isfinite(loss)
        self.losses += torch.where(finite, vals, 0.0)
        self.bad[k] = (~finite).double()
        for key, v in out.stats.items():
            v = v.detach().to(self.device, torch.float64).reshape(-1)
            cur = self.stats.get(key)
            if cur is not None:  # histograms of shortcut passes of different S: pad to the longer
                n = max(cur.numel(), v.numel())
                cur, v = F.pad(cur, (0, n - cur.numel())), F.pad(v, (0, n - v.numel()))
                v = cur + v
            self.stats[key] = v
        self.n += 1

    def read(self, signal: bool, grad_norm, ws: int) -> dict:
        """All-reduce + the one host read. grad_norm: a device tensor (read here), a float or None.
        Returns loss/parts means over micro-batches and ranks, the first non-finite micro-batch (1-based, 0:
        none), whether any rank was signalled, the gradient norm and the `router/...` metrics."""
        sig = torch.tensor([1.0 if signal else 0.0], dtype=torch.float64, device=self.device)
        gn = grad_norm.detach().double().reshape(1).to(self.device) if isinstance(grad_norm, torch.Tensor) else None
        keys = list(self.stats)
        vec = torch.cat([self.losses, self.bad, sig] + ([gn] if gn is not None else []) + [self.stats[k] for k in keys])
        v = _sum_over_ranks(vec)  # the optimizer step's one device -> host sync
        a = len(self.bad)
        n = max(self.n, 1)
        n_loss = 1 + len(self.PARTS)
        losses, bad, rest = v[:n_loss], v[n_loss:n_loss + a], v[n_loss + a:]
        out = {"loss": losses[0] / ws / n, **{p: x / ws / n for p, x in zip(self.PARTS, losses[1:])},
               "bad_micro_batch": next((k + 1 for k, b in enumerate(bad) if b > 0), 0), "signal": rest[0] > 0}
        rest = rest[1:]
        if gn is not None:
            out["grad_norm"], rest = rest[0] / ws, rest[1:]
        else:
            out["grad_norm"] = grad_norm
        metrics = {}
        for key in keys:
            vals, rest = rest[: self.stats[key].numel()], rest[self.stats[key].numel():]
            if len(vals) == 1:
                metrics[f"router/{key}"] = vals[0] / ws / n
            else:  # depth_hist: share of tokens per depth 1..M
                for i, x in enumerate(vals, 1):
                    metrics[f"router/{key.replace('depth_hist', 'depth_share')}_{i}"] = x / ws / n
        out["router"] = metrics
        return out


def evaluate(engine, loaders, n_batches: int, device) -> dict[str, float]:
    """Mean validation loss (the full pass at M = L) over n_batches micro-batches per rank, for each loader."""
    out = {}
    engine.eval()
    with torch.no_grad():
        for name, loader in loaders:
            tot, cnt = torch.zeros((), dtype=torch.float64, device=device), 0
            for x, y in loader.batches(n_batches):
                tot += engine(x.to(device), y.to(device)).loss.detach().double()
                cnt += 1
            s, c = _sum_over_ranks(torch.stack([tot, torch.tensor(float(cnt), dtype=torch.float64, device=device)]))
            out[name] = s / c
    engine.train()
    return out


def run(cfg: Config) -> TrainResult:
    """Trains cfg (a resolved Config) from scratch or from a checkpoint; see the module doc."""
    from pipeline.model import LoopedLM
    from pipeline.train import determinism, ds
    from pipeline.train.data import TrainLoader, ValLoader
    from pipeline.train.ac import apply_ac

    device_kind = ds.resolve_device(cfg)
    precision = ds.resolve_precision(cfg, device_kind)
    rank, local_rank, ws = ds.init_distributed(device_kind)
    determinism.apply(cfg.train.deterministic, device_kind)
    accum = cfg.check_world_size(ws)
    ds_config = ds.build_ds_config(cfg, ws, precision)
    root = ckpt.run_dir(cfg)
    resume_from = ckpt.find_resume(cfg, root)
    T, mb = cfg.model.block_size, cfg.train.micro_batch_size

    loader = TrainLoader(cfg.data.dir, cfg.data.train_split, T, mb, rank, ws, cfg.train.seed, cfg.model.vocab_size)
    val = []
    if cfg.train.eval_interval > 0:
        val = [(f"val/{Path(d).name or d}", ValLoader(d, cfg.data.val_split, T, mb, rank, ws, cfg.model.vocab_size))
               for d in [cfg.data.dir] + list(cfg.data.extra_val_dirs)]
        val[0] = ("val/loss", val[0][1])

    # Same seed on every rank: identical initial weights, and the same shortcut schedule sampled on every rank
    # (ZeRO-3 gathers parameters per block call, so all ranks must run the same number of loops).
    ckpt.set_rng_state(_seeded_rng(cfg.train.seed))
    model = LoopedLM(cfg.model)
    apply_ac(model, cfg.train.activation_checkpointing)
    if cfg.train.compile:
        from pipeline.train.compile import apply_compile
        apply_compile(model)
    optimizer, scheduler = ds.build_optimizer(cfg, model)
    engine = ds.initialize(model, optimizer, scheduler, ds_config)
    device = engine.device

    step, run_id = 0, None
    if resume_from is not None:
        state = ckpt.read_state(resume_from, rank, ws)
        _check_compatible(cfg, state["config"], resume_from)
        ckpt.load_engine(engine, resume_from)
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        step, run_id = int(state["step"]), state.get("mlflow_run_id")
        if engine.global_steps != step:
            raise ckpt.CheckpointError(f"{resume_from}: DeepSpeed is at step {engine.global_steps}, our state at {step}")

    scale = cfg.name.split("/")[0] if "/" in cfg.name else ""
    tags = {"variant": cfg.model.variant, "preset": cfg.name, "scale": scale, "world_size": ws,
            "device": device_kind, "precision": precision, "zero_stage": cfg.train.zero_stage,
            "activation_checkpointing": cfg.train.activation_checkpointing, "compile": cfg.train.compile}
    run_id = log.start(cfg, rank, tags, resume_run_id=run_id)
    n_params = model.num_params()
    log.info(f"{cfg.name or cfg.model.variant}: {n_params / 1e6:.2f}M params, {ws} rank(s) on {device_kind} "
             f"({precision}, ZeRO-{cfg.train.zero_stage}), global batch {cfg.train.global_batch_size} x {T} tokens, "
             f"checkpoints in {root}" + (f", resumed from {resume_from}" if resume_from else ""))

    res = TrainResult(start_step=step, step=step, checkpoint=str(resume_from) if resume_from else None, run_id=run_id)
    max_steps = cfg.schedule.max_steps
    tokens_per_step = cfg.train.global_batch_size * T
    last_saved = step if resume_from is not None else -1
    status = "FAILED"

    def save_now() -> None:
        nonlocal last_saved
        state = {"step": step, "world_size": ws, "rank": rank, "loader": loader.state_dict(), "rng": ckpt.rng_state(),
                 "config": cfg.to_dict(), "mlflow_run_id": run_id}
        path = ckpt.save(engine, model, cfg, root, step, state, rank)
        last_saved, res.checkpoint = step, str(path)
        log.info(f"checkpoint {path}")

    def last_good() -> str:
        return res.checkpoint or "none (no checkpoint was written)"

    try:
        with _Signals() as sig:
            t_start, t_last, ema = time.time(), time.time(), None
            consecutive_bad, stop_signal = 0, False
            while step < max_steps:
                meter = StepMeter(accum, device)
                done, zero0_norm = 0, None
                while done < accum:
                    x, y = loader.next()
                    out = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    loss = out.loss
                    if cfg.train.nan_policy == "skip":  # decided before the backward: one read per micro-batch
                        if _sum_over_ranks((~torch.isfinite(loss.detach())).double().reshape(1))[0] > 0:
                            msg = f"non-finite loss at step {step + 1} (micro-batch {done + 1}/{accum})"
                            consecutive_bad += 1
                            res.skipped += 1
                            log.warn(f"{msg}; skipped (train.nan_policy=skip, {consecutive_bad} in a row)")
                            if consecutive_bad >= cfg.train.nan_skip_limit:
                                raise NonFiniteError(f"{msg}: {consecutive_bad} non-finite batches in a row "
                                                     f"(train.nan_skip_limit); stopping. Last good checkpoint: {last_good()}")
                            del out, loss
                            continue
                        consecutive_bad = 0
                    engine.backward(loss)
                    if done == accum - 1:
                        zero0_norm = _zero0_grad_norm(engine)
                    engine.step()
                    meter.add(out, done)
                    done += 1
                gn = engine.get_global_grad_norm()
                r = meter.read(sig.name is not None, zero0_norm if gn is None else gn, ws)
                if r["bad_micro_batch"]:
                    raise NonFiniteError(f"non-finite loss at step {step + 1} (micro-batch {r['bad_micro_batch']}/"
                                         f"{accum}); stopping. Last good checkpoint: {last_good()}")
                stop_signal = r["signal"]
                step += 1
                loss_mean = r["loss"]
                res.losses.append(loss_mean)
                gn = r["grad_norm"]
                if gn is not None and not math.isfinite(gn):
                    raise NonFiniteError(f"non-finite gradient norm at step {step}; stopping. Last good checkpoint: "
                                         f"{last_good()}")

                now = time.time()
                dt, t_last = now - t_last, now
                ema = dt if ema is None else 0.9 * ema + 0.1 * dt
                metrics = {"loss": loss_mean, "lr": _lr_of_step(engine), "tokens_per_s": tokens_per_step / dt,
                           "step_time_s": dt, "epoch": loader.epoch}
                metrics["loss_L"] = r["loss_L"]
                if cfg.model.shortcut:
                    metrics.update(loss_S=r["loss_S"], loss_align=r["loss_align"])
                if cfg.model.router and cfg.model.router_recipe != "paper":
                    metrics["loss_router"] = r["loss_router"]
                if gn is not None:
                    metrics["grad_norm"] = gn
                sm = r["router"]
                metrics.update(sm)
                loops = sm.get("router/full/mean_depth", cfg.model.loops) + sm.get("router/short/mean_depth", 0.0)
                fpt = model.flops_per_token(loops_executed=loops, seq_len=T, lm_heads=2 if "router/short/loops" in sm else 1)
                metrics["mfu"] = metrics["tokens_per_s"] * fpt / (cfg.logging.peak_flops * ws)
                metrics.update(memory_metrics(device_kind))
                if cfg.train.eval_interval > 0 and (step % cfg.train.eval_interval == 0 or step == max_steps):
                    vl = evaluate(engine, val, cfg.train.eval_batches, device)
                    metrics.update(vl)
                    res.val_losses[step] = vl["val/loss"]
                    log.info(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in vl.items()))
                log.metrics(metrics, step)
                if step % cfg.train.log_interval == 0 or step == max_steps or step == res.start_step + 1:
                    eta = fmt_duration(ema * (max_steps - step))
                    extra = f" (L {metrics['loss_L']:.3f} S {metrics['loss_S']:.3f} align {metrics['loss_align']:.4f})" \
                        if cfg.model.shortcut else ""
                    depth = f" | depth {sm['router/full/mean_depth']:.2f}" if cfg.model.router else ""
                    gns = f" | gnorm {gn:.3f}" if gn is not None else ""
                    log.info(f"step {step}/{max_steps} | loss {loss_mean:.4f}{extra} | lr {metrics['lr']:.2e}{gns}"
                             f" | {metrics['tokens_per_s']:,.0f} tok/s | MFU {100 * metrics['mfu']:.2f}%{depth}"
                             f" | {fmt_duration(now - t_start)} elapsed, ETA {eta}")
                    log.flush()
                if stop_signal:
                    res.stopped_by = sig.name or "signal"
                    log.info(f"stopping at step {step} ({res.stopped_by} on some rank)")
                    break
                if cfg.checkpoint.interval > 0 and step % cfg.checkpoint.interval == 0:
                    save_now()
            if last_saved != step:
                save_now()
        status = "KILLED" if res.stopped_by else "FINISHED"
    finally:
        res.step = step
        log.set_tags({"final_step": step})
        log.end(status)
    return res


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
    """The learning rate used by the update just taken (LambdaLR has already advanced to the next one)."""
    sched = engine.lr_scheduler
    f = sched.lr_lambdas[0]
    return sched.base_lrs[0] * f(engine.global_steps - 1)


def _seeded_rng(seed: int) -> dict:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return ckpt.rng_state()


def _check_compatible(cfg: Config, saved: dict, path: Path) -> None:
    """Resuming needs the same model; other sections (schedule length, logging, ...) may change."""
    now = cfg.to_dict()
    diff = [f"model.{k} ({saved['model'][k]!r} -> {v!r})" for k, v in now["model"].items() if saved["model"].get(k) != v]
    for k in ("micro_batch_size", "global_batch_size", "seed", "zero_stage"):
        if saved["train"].get(k) != now["train"][k]:
            diff.append(f"train.{k} ({saved['train'].get(k)!r} -> {now['train'][k]!r})")
    if diff:
        raise ConfigError(f"cannot resume from {path}: config differs in {', '.join(diff)} "
                          "(use checkpoint.resume=none or another checkpoint.dir)")
