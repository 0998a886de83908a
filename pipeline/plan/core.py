"""`plan(cfg, gpus, gpu)`: per-GPU peak memory (with its parts), FITS / DOES NOT FIT, FLOPs, step time and
the run's wall clock and GPU-hours, and the largest micro-batch per activation-checkpointing mode, from traces
of the real training step (pipeline/plan/trace.py) and DeepSpeed's partitioning rules (pipeline/plan/zero.py).
docs/design.md §8 explains the accounting."""

from __future__ import annotations

import copy

import numpy as np
import torch

from pipeline.config import Config, ConfigError
from pipeline.hardware import GPU
from pipeline.plan.trace import StepTrace, trace_step
from pipeline.plan.zero import model_state_bytes, optimizer_step_bytes, persistent_numel
from pipeline.train.ac import MODES

GiB = 2**30


class PlanError(ValueError):
    """The run cannot be planned as asked (it fits nowhere): a one-line message."""


def default_mean_depth(cfg: Config) -> float:
    """The router's prior mean: objective.router.target_depth, or (loops + 1) / 2 when it is 0 or the recipe has
    none."""
    return getattr(cfg.objective.router, "target_depth", 0.0) or (cfg.model.loops + 1) / 2


def prior_counts(cfg: Config, mean_depth: float | None) -> np.ndarray | None:
    """(1, L) |A_i| per loop of a row whose T depths follow the router's maximum-entropy prior with this mean
    (pipeline.train.recipes.depth_prior); None without a router or with a recipe that trains exits (every token
    runs every loop in training)."""
    from pipeline.train.recipes import RECIPES, depth_prior

    m = cfg.model
    if not m.router or RECIPES[cfg.objective.router.recipe].exits:
        return None
    mean = default_mean_depth(cfg) if mean_depth is None else mean_depth
    if not 1.0 < mean < m.loops:
        raise ConfigError(f"--mean-depth {mean} must lie strictly between 1 and model.loops ({m.loops})")
    q = depth_prior(m.loops, mean).numpy()
    at_least = q[::-1].cumsum()[::-1]  # P(depth >= i), i = 1..L
    return np.maximum(np.rint(m.block_size * at_least), 1).astype(np.int64)[None]


def worst_shortcut(L: int) -> torch.Tensor:
    """S = L - 1, the shortcut pass with the most loops: the step of the largest peak (bench/train_step.py's)."""
    return torch.tensor([2] + [1] * (L - 2)) if L > 2 else torch.tensor([1] * L)


def mean_shortcut(L: int) -> torch.Tensor:
    """A schedule of S = round(E[S]) = round(L / 2) loops (S ~ U{1..L-1}): the mean step's FLOPs."""
    S = max(1, min(L - 1, round(L / 2)))
    return torch.tensor([L - S + 1] + [1] * (S - 1))


def with_settings(cfg: Config, **train) -> Config:
    c = copy.deepcopy(cfg)
    for k, v in train.items():
        setattr(c.train, k, v)
    return c


MAX_MICRO_BATCH = 256  # the largest micro-batch `tlf plan` searches for (more if the per-rank batch is larger)


class Planner:
    """Traces cached by (activation checkpointing, micro-batch, shortcut): ZeRO stage and world size only change
    the model-state accounting."""

    def __init__(self, cfg: Config, hw: GPU, mean_depth: float | None = None, counts: np.ndarray | None = None):
        self.cfg, self.hw = cfg, hw
        p = cfg.train.precision
        self.bf16 = (p == "bf16") or (p == "auto" and hw.bf16)
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.counts = prior_counts(cfg, mean_depth) if counts is None else counts
        self._cache: dict = {}
        self._zero_cfg: dict = {}  # (stage, ranks) -> zero_optimization of the run's DeepSpeed config

    def trace(self, ac: str, batch: int, worst: bool = True) -> StepTrace:
        """worst: the memory trace (the longest shortcut pass); else the FLOPs trace (the mean one)."""
        key = (ac, batch, worst)
        if key not in self._cache:
            L = self.cfg.model.loops
            sc = (worst_shortcut(L) if worst else mean_shortcut(L)) if self.cfg.objective.shortcut else None
            self._cache[key] = trace_step(
                with_settings(self.cfg, activation_checkpointing=ac),
                batch,
                self.dtype,
                self.counts,
                sc,
                count_flops=not worst,
                device_type="cpu" if self.hw.name == "cpu" else "cuda",
            )
        return self._cache[key]

    def reduce_bucket(self, zero: int, ranks: int, key: str = "reduce_bucket_size", default: float = 5e8) -> int:
        """zero_optimization.<key> of the run's DeepSpeed config (`ds.build_ds_config`), elements."""
        return int(self._zero_key(zero, ranks, key, default))

    def _zero_key(self, zero: int, ranks: int, key: str, default):
        """zero_optimization.<key> of the run's DeepSpeed config (built once per stage and world size), any type."""
        return self._ds_config(zero, ranks).get("zero_optimization", {}).get(key, default)

    def _ds_config(self, zero: int, ranks: int) -> dict:
        """The run's DeepSpeed config at this stage and world size (`ds.build_ds_config`), built once."""
        from pipeline.train.ds import build_ds_config

        if (zero, ranks) not in self._zero_cfg:
            c = with_settings(self.cfg, zero_stage=zero)
            c.train.grad_accum_steps = c.train.global_batch_size // (c.train.micro_batch_size * ranks) or 1
            try:
                ds = build_ds_config(c, ranks, "bf16" if self.bf16 else "fp32")
            except ConfigError:  # a batch that does not divide: plan() reports it; the values are DeepSpeed's defaults
                ds = {}
            self._zero_cfg[zero, ranks] = ds
        return self._zero_cfg[zero, ranks]

    def _check_grad_accum_dtype(self, zero: int, ranks: int) -> None:
        """The plan follows DeepSpeed's default, gradients accumulated in the run's dtype: a bf16 run that asks for
        fp32 (data_types.grad_accum_dtype) takes other optimizer paths (ZeRO-1: BF16_Optimizer; ZeRO-2: an fp32
        gradient partition held from backward on), which are not planned."""
        acc = str(self._ds_config(zero, ranks).get("data_types", {}).get("grad_accum_dtype") or "bf16")
        if self.bf16 and acc.removeprefix("torch.") not in ("bf16", "bfloat16"):
            raise PlanError(
                f"{self.cfg.train.ds_config or 'the DeepSpeed template'}: data_types.grad_accum_dtype={acc} in a "
                f"bf16 run is not planned (tlf plan models DeepSpeed's default, gradients accumulated in bf16); "
                f"remove the key to plan this run"
            )

    def _zero0_bucket(self, zero: int, ranks: int, params: int) -> int:
        """ZeRO-0's reduction: gradients flattened by buckets of at most reduce_bucket_size elements, transient;
        none in one process, where the trainer skips the all-reduce over a group of one (ds.py)."""
        if zero != 0 or ranks == 1:
            return 0
        return min(params, self.reduce_bucket(zero, ranks)) * (2 if self.bf16 else 4)

    def reduce_buffers(self, zero: int, ranks: int) -> int:
        """Bytes of the gradient reduction buffers ZeRO-1/2/3 allocate whole, whatever the model's size
        (DeepSpeed's contiguous_gradients, on by default): ZeRO-1/2 `setup_buckets` (stage_1_and_2.py, at each
        backward, released after the reduction) one buffer of reduce_bucket_size elements, a second with
        overlap_comm; ZeRO-3 one of its reduce_bucket_size (stage3.py, built with the optimizer, kept). All in the
        run's dtype (`_gradient_reduction_buffer_dtype`: fp32 only with an fp32 grad_accum_dtype, not planned).
        Equal to what a 2-rank fp32 engine and a 1-rank bf16 one allocate (tests/test_plan_zero.py)."""
        if zero == 0:
            return 0
        n = self.reduce_bucket(zero, ranks)
        overlap = zero == 2 and self._zero_key(zero, ranks, "overlap_comm", False)
        return int(n) * (2 if self.bf16 else 4) * (2 if overlap else 1)

    def memory(self, zero: int, ac: str, batch: int, ranks: int) -> dict:
        """Per-GPU bytes: parts and peak, the larger of the backward's (activations) and the optimizer step's."""
        tr = self.trace(ac, batch)
        if zero in (1, 2):
            self._check_grad_accum_dtype(zero, ranks)
        keep, gather = persistent_numel(
            tr.sizes, self.reduce_bucket(zero, ranks, "stage3_param_persistence_threshold", 1e5)
        )
        st = model_state_bytes(tr.params, zero, ranks, self.bf16, gather, keep)
        share = 1.0 / ranks if zero >= 2 else 1.0  # run-dtype gradients held per rank
        # ZeRO-1/2 allocate their reduction buffers at backward's first gradient, when forward's activations are
        # all still held (released after the reduction); ZeRO-3 holds its buffer from construction: either way
        # they add to the step's peak
        ipg = self.reduce_buffers(zero, ranks)
        # forward + backward: activations, transients and the gradients as they appear; then ZeRO-0's reduction
        # flattens the gradients by buckets of reduce_bucket_size elements (allreduce_bucket) beside them
        step_peak = max(tr.live.peak(share), tr.grad_bytes * share + self._zero0_bucket(zero, ranks, tr.params))
        held_fp32_grads = st["grads"] - tr.grad_bytes * share  # fp32 gradients held all step (BF16_Optimizer, ZeRO-3)
        backward = st["params"] + st["optimizer"] + held_fp32_grads + ipg + step_peak
        opt_step = optimizer_step_bytes(zero, ranks, self.bf16, tr.group_sizes, tr.largest_param)
        peak_opt = st["params"] + st["optimizer"] + opt_step
        peak = max(backward, peak_opt)
        saved = sum(tr.saved.values())
        loops = {k: v for k, v in tr.saved.items() if k.startswith(("full/", "short/"))}
        return {
            "peak": peak,
            "peak_backward": backward,
            "peak_optimizer_step": peak_opt,
            "step_peak": step_peak,  # forward + backward's own moment (activations, gradients), in peak_backward
            "optimizer_step": opt_step,
            "params": st["params"],
            "grads": st["grads"],
            "optimizer": st["optimizer"],
            "reduce_buffers": ipg,
            "activations_loops": sum(loops.values()),
            "activations_per_loop": loops,
            "embed_router": tr.saved.get("embed+router", 0),
            "heads": tr.saved.get("heads+losses", 0),
            "transient": backward - st["params"] - st["optimizer"] - st["grads"] - ipg - saved,
            "fits": peak <= self.hw.memory,
            "headroom": self.hw.memory - peak,
        }

    def max_micro_batch(self, zero: int, ac: str, ranks: int) -> int:
        """The largest micro-batch whose traced peak fits, searched up to MAX_MICRO_BATCH or the per-rank global
        batch, whichever is larger (a model that fits more is reported at that limit); 0 if 1 does not fit. A
        line fitted on traces at 1 and 2 gives the first guess; a search over traces (false position, then
        bisection) settles it, since at small micro-batches the peak can be a moment that grows slower than the
        rest or not at all (the fused heads' chunk buffers on a GPU, the head's weight gradient late in
        backward), and the line then misses either way."""
        share = 1.0 / ranks if zero >= 2 else 1.0
        peak = lambda b: self.memory(zero, ac, b, ranks)["peak"]
        fits = lambda b: peak(b) <= self.hw.memory
        limit = max(MAX_MICRO_BATCH, self.cfg.train.global_batch_size // ranks)
        m1 = self.memory(zero, ac, 1, ranks)
        if m1["peak"] > self.hw.memory:
            return 0
        t1, t2 = self.trace(ac, 1), self.trace(ac, 2)
        a1, a2 = t1.live.peak(share), t2.live.peak(share)
        other = m1["peak_backward"] - m1["step_peak"]
        slope = max(a2 - a1, sum(t2.saved.values()) - sum(t1.saved.values()), 1.0)
        guess = min(limit, max(1, int(1 + (self.hw.memory - other - a1) // slope)))
        if fits(guess):
            if guess == limit or fits(limit):
                return limit
            lo, hi = guess, limit  # lo fits, hi does not
        else:
            lo, hi = 1, guess
        for step in range(64):  # false position (the chord's crossing, then its neighbour), bisection after 4
            if hi - lo <= 1:
                break
            p_lo, p_hi = peak(lo), peak(hi)  # traced already: cached
            m = lo + int((self.hw.memory - p_lo) * (hi - lo) // max(p_hi - p_lo, 1.0)) if step < 4 else (lo + hi) // 2
            m = min(max(m, lo + 1), hi - 1)
            if fits(m):
                lo = m
                if step < 4 and m + 1 < hi and not fits(m + 1):
                    hi = m + 1
            else:
                hi = m
                if step < 4 and m - 1 > lo and fits(m - 1):
                    lo = m - 1
        return lo

    def flops_per_micro_batch(self, batch: int) -> float:
        """Model FLOPs of one micro-batch's forward + backward (no recomputation: traced without checkpointing),
        at the mean shortcut length."""
        return self.trace("none", batch, worst=False).flops


def grad_accum_for(cfg: Config, batch: int, ranks: int) -> int | None:
    """The grad-accum that keeps train.global_batch_size with this micro-batch on `ranks` (None: it does not divide)."""
    g = cfg.train.global_batch_size
    return g // (batch * ranks) if batch > 0 and g % (batch * ranks) == 0 else None


def largest_dividing(cfg: Config, cap: int, ranks: int) -> int:
    """The largest micro-batch <= cap that divides global_batch_size / ranks (0 if none)."""
    per_rank = cfg.train.global_batch_size // ranks
    return next((b for b in range(min(cap, per_rank), 0, -1) if per_rank % b == 0), 0)


def plan(cfg: Config, ranks: int, hw: GPU, mfu: float = 0.4, mean_depth: float | None = None) -> dict:
    """The plan of cfg as configured (train.zero_stage, train.activation_checkpointing, train.micro_batch_size)
    on `ranks` GPUs `hw`: memory, FLOPs, time, and the largest micro-batch per checkpointing mode."""
    t = cfg.train
    accum = grad_accum_for(cfg, t.micro_batch_size, ranks)
    if accum is None:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size} x {ranks} GPUs"
        )
    t.grad_accum_steps = accum
    cfg.check_world_size(ranks)
    pl = Planner(cfg, hw, mean_depth)
    modes = checkpointing_modes(cfg, pl, ranks)
    return {
        "config": cfg.name,
        "gpu": hw.name,
        "gpus": ranks,
        "precision": "bf16" if pl.bf16 else "fp32",
        "zero_stage": t.zero_stage,
        "activation_checkpointing": t.activation_checkpointing,
        "micro_batch": t.micro_batch_size,
        "grad_accum": accum,
        "capacity": hw.memory,
        "mean_depth": None if pl.counts is None else float(pl.counts.sum() / cfg.model.block_size),
        "memory": pl.memory(t.zero_stage, t.activation_checkpointing, t.micro_batch_size, ranks),
        **time_and_cost(cfg, pl, ranks, mfu, accum),
        "checkpointing_modes": modes,
    }


def checkpointing_modes(cfg: Config, pl: Planner, ranks: int) -> dict:
    """{activation-checkpointing mode: the largest micro-batch that fits (`max_micro_batch`), the largest that also
    divides the per-rank global batch (`micro_batch`) and its grad-accum}, at train.zero_stage; a PlanError when
    micro-batch 1 fits under none."""
    t = cfg.train
    modes = {}
    for ac in MODES:
        cap = pl.max_micro_batch(t.zero_stage, ac, ranks)
        b = largest_dividing(cfg, cap, ranks)
        modes[ac] = {"max_micro_batch": cap, "micro_batch": b, "grad_accum": grad_accum_for(cfg, b, ranks)}
    if not any(r["max_micro_batch"] for r in modes.values()):
        raise PlanError(
            f"{cfg.name or 'the model'} does not fit on {pl.hw.name} at ZeRO-{t.zero_stage} on {ranks} GPUs "
            f"with micro-batch 1 under any activation-checkpointing mode (try a higher ZeRO stage, more "
            f"GPUs or a larger GPU)"
        )
    return modes


def time_and_cost(cfg: Config, pl: Planner, ranks: int, mfu: float, accum: int) -> dict:
    """FLOPs per optimizer step and per token (per GPU, traced at the mean shortcut length), the step time at `mfu`
    of the GPU's peak and at its roofline (MFU 1), tokens/s, and the run's tokens, wall clock and GPU-hours."""
    t = cfg.train
    tokens_mb = t.micro_batch_size * cfg.model.block_size
    flops_step = pl.flops_per_micro_batch(t.micro_batch_size) * accum  # per GPU per optimizer step
    roof_s = flops_step / pl.hw.peak_flops
    step_s = roof_s / mfu
    steps = cfg.schedule.max_steps
    return {
        "flops_per_step_per_gpu": flops_step,
        "flops_per_token": flops_step / (tokens_mb * accum),
        "mfu": mfu,
        "step_time_s": step_s,
        "step_time_roofline_s": roof_s,
        "tokens_per_s": t.global_batch_size * cfg.model.block_size / step_s,
        "tokens": steps * t.global_batch_size * cfg.model.block_size,
        "steps": steps,
        "wall_clock_s": steps * step_s,
        "wall_clock_roofline_s": steps * roof_s,
        "gpu_hours": steps * step_s * ranks / 3600,
    }


def sweep(cfg: Config, ranks: int, hw: GPU, grid: dict[str, list], mean_depth: float | None = None) -> list[dict]:
    """Per-GPU peak for every combination of grid's zero / ac / mb values (other settings as configured)."""
    pl = Planner(cfg, hw, mean_depth)
    t = cfg.train
    rows = []
    for z in grid.get("zero", [t.zero_stage]):
        for ac in grid.get("ac", [t.activation_checkpointing]):
            for mb in grid.get("mb", [t.micro_batch_size]):
                m = pl.memory(int(z), ac, int(mb), ranks)
                rows.append(
                    {
                        "zero_stage": int(z),
                        "activation_checkpointing": ac,
                        "micro_batch": int(mb),
                        "peak": m["peak"],
                        "fits": m["fits"],
                        "headroom": m["headroom"],
                        "max_micro_batch": pl.max_micro_batch(int(z), ac, ranks),
                    }
                )
    return rows
