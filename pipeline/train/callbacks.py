"""Callbacks of `pipeline.train.trainer.Trainer`: everything a run does around its steps. `default_callbacks()`
is what `tlf train` uses; a bench or a test builds the Trainer with its own list.

Hooks (all optional; `self.trainer` is set by the Trainer, see its class doc for when each is called; the base
class, pipeline/train/hooks.py): pre_train(), pre_step(step), pre_update(step, meter), post_update(step, meter),
post_step(step, metrics), log_metrics(step, metrics), end_step(step), post_train(), post_checkpoint_saved(step,
path), on_error(exc), close(status), and state_dict() / load_state_dict(state) for what a resume needs. `metrics`
holds host floats only (the step's one device read is done before post_step): a callback that reads a device
tensor adds a host sync per step.
The router statistics are not a callback: they travel in the step's one all-reduce (StepMeter).
"""

from __future__ import annotations

import time

from data_prep import valsplit
from pipeline.memory import memory_metrics
from pipeline.hardware import GPU, gpu, this_gpu  # logging.peak_flops=0 on CUDA: the GPU table's peak
from pipeline.train.logger import fmt_duration, log
from pipeline.train.gradstats import GradStats
from pipeline.train.hooks import Callback  # the base class, in its own module (spikes.py, gradstats.py subclass it)
from pipeline.train.spikes import Spikes
from pipeline.train.validation import default_budgets, evaluate, mix


def scale_tag(cfg) -> str:
    """The MLflow `scale` tag: SCALE of a SCALE/VARIANT preset name ("" for a YAML file). Parsed from the name
    because the config has no field for it (a `scale` field in pipeline.config would be the better source)."""
    return cfg.name.split("/")[0] if "/" in cfg.name else ""


def val_basis(t) -> list[tuple[str, int, object]]:
    """(metric name, tokens its validation loss is computed on, the ValLoader) of each validation set: the
    distinct windows train.eval_batches micro-batches read on all ranks, times the context."""
    n = t.cfg.train.eval_batches
    return [(name, v.distinct_windows(n) * v.T, v) for name, v in t.val if hasattr(v, "distinct_windows")]


def run_tags(t) -> dict:
    """The tags of a training run (how `tlf compare` finds runs; `val_tokens`: the tokens val/loss rests on,
    `val_split_tokens`: those of the split they are drawn from)."""
    c = t.cfg
    basis = val_basis(t)
    return {
        **({"val_tokens": basis[0][1], "val_split_tokens": basis[0][2].shards.num_tokens} if basis else {}),
        "variant": c.model.variant,
        "preset": c.name,
        "scale": scale_tag(c),
        "world_size": t.ws,
        "device": t.device_kind,
        "precision": t.precision,
        "zero_stage": c.train.zero_stage,
        "activation_checkpointing": c.train.activation_checkpointing,
        "compile": c.train.compile,
        **t.branch,
    }


_warned_gpu = []


def cuda_row() -> GPU:
    """The GPU table's row for this CUDA device (MFU's default peak), or an A100-80GB's, said once."""
    row = this_gpu()
    if row is None:
        if not _warned_gpu:
            _warned_gpu.append(True)
            log.warn(
                "this GPU is not in pipeline/hardware.py: MFU is against an A100's bf16 peak unless "
                "logging.peak_flops is set"
            )
        row = gpu("a100-80gb")
    return row


class Speed(Callback):
    """step_time_s (wall clock from the previous step's end: logging, validation and saves included),
    tokens_per_s and MFU over the executed loops and heads of the step (`trainer.work`, a StepWork;
    model.flops_per_token; docs/training.md "MFU"). The peak is `logging.peak_flops`, else on CUDA the GPU table's row for
    this device (`hardware.this_gpu`: A100, H100, H200), else an A100's, said once at the start."""

    def pre_train(self) -> None:
        t = self.trainer
        self.peak = t.cfg.logging.peak_flops
        if not self.peak and t.device_kind == "cuda":
            self.peak = cuda_row().peak_flops
        self.t_last = time.time()

    def post_step(self, step: int, metrics: dict) -> None:
        t = self.trainer
        now = time.time()
        dt, self.t_last = now - self.t_last, now
        metrics.update(tokens_per_s=t.tokens_per_step / dt, step_time_s=dt)
        fpt = t.model.flops_per_token(
            loops_executed=t.work.loops, seq_len=t.cfg.model.block_size, lm_heads=t.work.lm_heads
        )
        if self.peak:  # on CPU no MFU unless logging.peak_flops says what the peak is (an A100's would read 0.00%)
            metrics["mfu"] = metrics["tokens_per_s"] * fpt / (self.peak * t.ws)


class Memory(Callback):
    """mem/cuda_max_{allocated,reserved}_gb on GPU, mem/{rss,peak_rss}_gb on CPU."""

    def post_step(self, step: int, metrics: dict) -> None:
        metrics.update(memory_metrics(self.trainer.device_kind))


class Validation(Callback):
    """Validation every train.eval_interval steps and at the last: val/loss (and val/<extra dir>) at M = L, and
    the loss of each budget of train.eval_loops (default_budgets), val/M{M}/loss, with a routed pass's depth and
    loop work (pipeline/train/validation.py); perf/val_s, the seconds it took (its all-reduce read ends it)."""

    def post_step(self, step: int, metrics: dict) -> None:
        t = self.trainer
        n = t.cfg.train.eval_interval
        if n > 0 and (step % n == 0 or step == t.max_steps):
            L = t.cfg.model.loops
            budgets = t.cfg.train.eval_loops or default_budgets(L)
            start = time.perf_counter()
            vl = evaluate(t.engine, t.val, t.cfg.train.eval_batches, t.device, budgets, L)
            metrics["perf/val_s"] = time.perf_counter() - start
            if t.cfg.data.dirs:  # a mixture: val/loss is its sources' weighted mean
                vl = mix(vl, [t.cfg.data.source_name(d) for d in t.cfg.data.dirs], t.cfg.data.weights)
            metrics.update(vl)
            t.result.val_losses[step] = vl["val/loss"]
            shown = {k: v for k, v in vl.items() if not k.endswith(("/mean_depth", "/loop_work"))}
            log.info(
                f"step {step}: "
                + ", ".join(f"{k} {v:.4f}" for k, v in shown.items())
                + f" ({metrics['perf/val_s']:.1f} s)"
            )


class DataMix(Callback):
    """data.dirs: the tokens each source has given the run, data/tokens/<dir name>, every step."""

    def post_step(self, step: int, metrics: dict) -> None:
        for name, n in getattr(self.trainer.loader, "tokens", {}).items():
            metrics[f"data/tokens/{name}"] = float(n)


class Profiler(Callback):
    """train.profile_steps=A:B: torch.profiler over steps A..B (CPU, and CUDA on a GPU), exported as a Chrome trace
    `profile_steps_A-B_rank<r>.json` in the run dir by every rank (stopped early by the run's end) and logged to the
    MLflow run as an artifact by rank 0, off the training thread."""

    def __init__(self) -> None:
        self.prof, self.span = None, None

    def pre_train(self) -> None:
        self.span = self.trainer.cfg.train.profile_range()  # (A, B) or None, read once

    def pre_step(self, step: int) -> None:
        if self.span is not None and step == self.span[0]:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.trainer.device_kind == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def end_step(self, step: int) -> None:
        if self.prof is not None and step == self.span[1]:
            self._export()

    def post_train(self) -> None:
        if self.prof is not None:
            self._export()

    def _export(self) -> None:
        t, prof, span, self.prof = self.trainer, self.prof, self.span, None
        prof.__exit__(None, None, None)
        path = t.root / f"profile_steps_{span[0]}-{span[1]}_rank{t.rank}.json"
        prof.export_chrome_trace(str(path))
        log.info(f"profile of steps {span[0]}..{span[1]}: {path}")
        if t.rank == 0:
            log.artifact(path, "profiles")


class Curriculum(Callback):
    """data.curriculum: after each validation, raise the trained level (the loader's level_cap) by one when every
    level up to it reaches the threshold on the val split (val/acc_L<k>); `data/level_cap` logged every step."""

    def post_step(self, step: int, metrics: dict) -> None:
        t = self.trainer
        thr = t.cfg.data.curriculum
        if thr <= 0:
            return
        cap = t.loader.level_cap
        accs = [metrics.get(f"val/acc_L{k}") for k in range(1, cap + 1)]
        if cap < t.loader.levels and all(a is not None and a >= thr for a in accs):
            t.loader.raise_level()
            log.info(f"step {step}: curriculum: levels 1..{cap} at >= {thr} on val; training levels 1..{cap + 1}")
        metrics["data/level_cap"] = float(t.loader.level_cap)


class Checkpointer(Callback):
    """A checkpoint every checkpoint.interval steps (0: none) and one at the end (after a stop signal too)."""

    def end_step(self, step: int) -> None:
        n = self.trainer.cfg.checkpoint.interval
        if n > 0 and step % n == 0:
            self.trainer.save_checkpoint()

    def post_train(self) -> None:
        if self.trainer.last_saved != self.trainer.step:
            self.trainer.save_checkpoint()


class MLflowLogger(Callback):
    """The run's metrics.jsonl (always) and MLflow run (rank 0; logging.mlflow=false: none): opened with the
    config as params and `run_tags`, or the resumed run reopened; metrics written every step, sent to MLflow off
    the training thread (woken at log steps); final_step tag; ended with the run's status."""

    def pre_train(self) -> None:
        t = self.trainer
        t.run_id = t.result.run_id = log.start(t.cfg, run_tags(t), resume_run_id=t.run_id, root=t.root, step=t.step)

    def log_metrics(self, step: int, metrics: dict) -> None:
        log.metrics(metrics, step)
        if self.trainer.is_log_step(step):
            log.flush()

    def close(self, status: str) -> None:
        log.set_tags({"final_step": self.trainer.step})
        log.end(status)


class Console(Callback):
    """The set-up line, a progress line at log steps (loss and parts, lr, grad norm, tokens/s, MFU, router
    depth, elapsed, ETA from an average of step times) and each checkpoint written."""

    def pre_train(self) -> None:
        t, c = self.trainer, self.trainer.cfg
        self.t_start, self.ema = time.time(), None
        log.info(
            f"{c.name or c.model.variant}: {t.model.num_params() / 1e6:.2f}M params, {t.ws} rank(s) on "
            f"{t.device_kind} ({t.precision}, ZeRO-{c.train.zero_stage}), global batch "
            f"{c.train.global_batch_size} x {c.model.block_size} tokens, checkpoints in {t.root}"
            + (f", resumed from {t.resume_from}" if t.resume_from else "")
        )
        for name, tokens, v in val_basis(t):
            split = v.shards.num_tokens
            log.info(
                f"{name} rests on {tokens:,} tokens ({tokens // v.T} windows of {v.T}; train.eval_batches="
                f"{c.train.eval_batches}) of {v.shards.dir}'s {v.shards.split} split ({split:,} tokens)"
            )
            note = valsplit.short_note(split)
            if note:
                log.warn(f"{name}: {v.shards.dir}'s {v.shards.split} split {note}")

    def log_metrics(self, step: int, m: dict) -> None:
        t, c = self.trainer, self.trainer.cfg
        dt = m.get("step_time_s", 0.0)
        self.ema = dt if self.ema is None else 0.9 * self.ema + 0.1 * dt
        if not t.is_log_step(step):
            return
        extra = f" (L {m['loss_L']:.3f} S {m['loss_S']:.3f} align {m['loss_align']:.4f})" if "loss_S" in m else ""
        depth = f" | depth {m['router/full/mean_depth']:.2f}" if c.model.router else ""
        gns = f" | gnorm {m['grad_norm']:.3f}" if "grad_norm" in m else ""
        speed = f" | {m['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in m else ""
        speed += f" | MFU {100 * m['mfu']:.2f}%" if "mfu" in m else ""  # none on CPU without logging.peak_flops
        log.info(
            f"step {step}/{t.max_steps} | loss {m['loss']:.4f}{extra} | lr {m['lr']:.2e}{gns}{speed}{depth}"
            f" | {fmt_duration(time.time() - self.t_start)} elapsed, ETA {fmt_duration(self.ema * (t.max_steps - step))}"
        )

    def post_checkpoint_saved(self, step: int, path) -> None:
        log.info(f"checkpoint {path}")


# Callbacks of the packages above pipeline (evaluation's zero-shot tasks during training) register themselves as
# entry points of this group (setup.py), as `tlf`'s subcommands do in `tlf.commands`: pipeline names none of them
CALLBACK_GROUP = "tlf.callbacks"


def registered_callbacks() -> list[Callback]:
    """One of each `tlf.callbacks` entry point (a Callback class, or a function of no argument returning one), in
    name order. Each decides from the config whether it does anything (train.zeroshot_interval=0: nothing)."""
    from importlib.metadata import entry_points

    return [ep.load()() for ep in sorted(entry_points(group=CALLBACK_GROUP), key=lambda ep: ep.name)]


def default_callbacks() -> list[Callback]:
    """What `tlf train` runs with: pipeline's own, then the registered ones (their post_step sees the metrics of
    pipeline's)."""
    return pipeline_callbacks() + registered_callbacks()


def pipeline_callbacks() -> list[Callback]:
    """Pipeline's own callbacks. Order matters within a hook: MLflow opens its run before the console's first
    line; the metric callbacks fill `metrics` before validation prints."""
    return [
        MLflowLogger(),
        Console(),
        Speed(),
        Memory(),
        DataMix(),
        Spikes(),
        GradStats(),
        Validation(),
        Curriculum(),
        Profiler(),
        Checkpointer(),
    ]
