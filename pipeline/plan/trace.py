"""One training step of the real model traced on the meta device: nothing is allocated, so the paper scale runs
on a laptop CPU. `trace_step` builds the model and its activation checkpointing as `tlf train` does
(`LoopedLM(cfg.model)`, `pipeline.train.ac.apply_ac`), runs the objective's forward (`loss_of`) and backward,
and records

- the live bytes of every tensor created during the step (`LiveBytes`: each new storage counted once until
  autograd or Python frees it; the gradients counted apart, so a ZeRO stage that partitions them can rescale
  them), sampled at every allocation;
- the bytes autograd keeps for backward per loop application and for the embeddings/router and the fused heads
  (`pipeline.memory.SavedTensors`, labelled as bench/train_step.py labels them);
- the FLOPs of every op (torch.utils.flop_counter.FlopCounterMode; recomputation under checkpointing included).

Meta tensors have shapes but no values, so the one data-dependent step of the model, the router's depth map
read on the host (`pipeline.model.looped.active_counts`: |A_i| of each row and loop), is replaced by the plan's
depth map (`counts`). The rest of the forward runs unchanged (docs/design.md §8).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import flop_counter as fc
from torch.utils.flop_counter import FlopCounterMode

from pipeline.memory import SavedTensors


def loss_of(model, cfg, x: torch.Tensor, y: torch.Tensor, shortcut: torch.Tensor | None) -> torch.Tensor:
    """The training objective of one micro-batch, as the trainer computes it (`engine(x, y)`: the `Objective`
    with cfg.objective wrapped around the network)."""
    from pipeline.train.objective import Objective

    return Objective(model, cfg.objective).to(x.device)(x, y, shortcut).loss  # its own state (the kind table) too


def build_model(cfg, dtype: torch.dtype):
    """`tlf train`'s model on the meta device: LoopedLM(cfg.model) in train mode, cast to the run's dtype as
    DeepSpeed's bf16 engine casts it, with cfg.train.activation_checkpointing applied by the trainer's own
    `apply_ac`."""
    from pipeline.model import LoopedLM
    from pipeline.train.ac import apply_ac

    with torch.device("meta"):
        model = LoopedLM(cfg.model)
    model.to(device="meta", dtype=dtype).train()
    apply_ac(model, cfg.train.activation_checkpointing)
    return model


# Kernels whose CPU/GPU implementation allocates a temporary the dispatcher never sees (a meta kernel only
# computes shapes): logsumexp's `(x - max).exp()` of its input's size (aten's logsumexp_out_impl), used per
# chunk by the fused heads
SCRATCH = {torch.ops.aten.logsumexp.default: lambda x, *a, **k: x.numel() * x.element_size()}


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created by ops run inside it (once per storage, until freed), sampled as
    (live, grads) after every allocation; `grad_bytes` is kept up to date by the parameters' grad hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.grads = 0
        self.samples: list[tuple[int, int]] = []
        self._seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCRATCH:  # a temporary the kernel allocates and frees inside itself
            self.samples.append((self.live + SCRATCH[func](*args), self.grads))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s._cdata
                if key not in self._seen and s.nbytes() > 0:
                    self._seen.add(key)
                    self.live += s.nbytes()
                    weakref.finalize(s, self._free, key, s.nbytes())
                    self.samples.append((self.live, self.grads))
        return out

    def peak(self, grad_share: float = 1.0) -> float:
        """The peak of live bytes with the gradients scaled by grad_share (1/N when ZeRO-2/3 partitions them)."""
        return max((live - g + g * grad_share for live, g in self.samples), default=0.0)


@contextmanager
def on_meta(counts: np.ndarray | None, device_type: str = "cuda"):
    """Within it, the model's host read of the depth map returns `counts` ((B, L) |A_i| per row and loop,
    or (1, L) for every row; None: unchanged), the fused heads chunk their rows as on `device_type` (the planned
    run's: CPU chunks are smaller, head_loss.rows_per_chunk),
    attention (causal or masked) runs the flash kernel (on meta torch would pick the math one, which keeps the (B, H, T, T)
    weights for backward; the GPU's flash/efficient kernels and CPU's flash kernel keep q, k, v, the output and
    its log-sum-exp: this op's meta kernel), and autocast is off for the meta device (torch has no autocast there; `tlf train` runs no autocast:
    DeepSpeed's bf16 engine casts the module), so the fused heads compute in their input's dtype."""
    from pipeline.model import head_loss, looped

    real = looped.active_counts, head_loss._compute_dtype, torch.autocast, F.scaled_dot_product_attention
    real_rows = head_loss.rows_per_chunk
    head_loss.rows_per_chunk = lambda vocab_size, _meta: real_rows(vocab_size, device_type)
    if counts is not None:
        looped.active_counts = lambda depth, M: (
            counts[:, :M] if len(counts) == depth.shape[0] else np.broadcast_to(counts[:1, :M], (depth.shape[0], M))
        ).copy()
    head_loss._compute_dtype = lambda t: t.dtype
    torch.autocast = lambda device_type, *a, **k: (
        nullcontext() if device_type == "meta" else real[2](device_type, *a, **k)
    )
    F.scaled_dot_product_attention = lambda q, k, v, attn_mask=None, is_causal=False, **kw: (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=is_causal, attn_mask=None if attn_mask is None else _additive(attn_mask, q.dtype)
        )[0]
    )
    try:
        yield
    finally:
        looped.active_counts, head_loss._compute_dtype, torch.autocast, F.scaled_dot_product_attention = real
        head_loss.rows_per_chunk = real_rows


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA hands it to its fused kernels (and they keep it for backward): 0 where
    allowed, -inf elsewhere, in the queries' dtype."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _addmm(acc, a, b, *args, out_shape=None, **kwargs) -> int:  # shapes: (n, p) += (n, k) @ (k, p)
    return 2 * a[0] * a[1] * b[1]


def _flash_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_flop_count(q, k, v)


def _flash_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return fc.sdpa_backward_flop_count(grad_out, q, k, v)


# What torch's flop counter leaves out and this model runs: the fused heads' in-place gradient accumulation
# (addmm_) and the flash attention kernel the plan traces (`on_meta`); attention counted without a causal
# discount, as torch counts it and as model.flops_per_token does
EXTRA_FLOPS = {
    torch.ops.aten.addmm_: _addmm,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward,
}


@dataclass
class StepTrace:
    params: int  # numel
    largest_param: int  # numel of the largest parameter tensor
    grad_bytes: int
    live: LiveBytes
    saved: dict = field(default_factory=dict)  # label -> bytes kept for backward
    flops: float = 0.0  # the step's forward + backward FLOPs (recomputation included)
    sizes: tuple = ()  # numel of every parameter tensor (ZeRO-3 keeps the small ones whole: zero.py)
    group_sizes: tuple = ()  # numel of each of the optimizer's parameter groups (`LoopedLM.param_groups`)


def trace_step(
    cfg,
    batch: int,
    dtype: torch.dtype,
    counts: np.ndarray | None,
    shortcut: torch.Tensor | None,
    count_flops: bool = False,
    device_type: str = "cuda",
) -> StepTrace:
    """Forward of the objective and backward for a micro-batch of `batch` x block_size tokens on meta tensors.
    shortcut: the shortcut pass's schedule (None: the model samples one). count_flops: count FLOPs (flops stays 0
    otherwise); then the bytes are not the step's: the flop counter's module tracker wraps the modules' outputs,
    which keeps what activation checkpointing frees alive, so memory and FLOPs are traced apart. device_type: the
    planned run's device (cuda or cpu)."""
    model = build_model(cfg, dtype)
    T, L = cfg.model.block_size, cfg.model.loops
    x = torch.zeros(batch, T, dtype=torch.long, device="meta")
    y = torch.zeros(batch, T, dtype=torch.long, device="meta")
    live, saved = LiveBytes(), SavedTensors()
    params = list(model.parameters())
    # the weights and buffers are counted as model states, not here: a view of one (a Linear's `W.t()`, kept for
    # backward) shares its storage and must not count as a new allocation
    live._seen.update(t.untyped_storage()._cdata for t in [*params, *model.buffers()])

    def on_grad(p):
        live.grads += p.grad.untyped_storage().nbytes() if p.grad is not None else 0

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params]
    calls = [0]

    def loop_start(mod, args):  # layer 0 starts every loop application (bench/train_step.py's labels)
        calls[0] += 1
        saved.label = f"full/{calls[0]}" if calls[0] <= L else f"short/{calls[0] - L}"

    def head_start(mod, args):
        saved.label = "heads+losses"

    hooks += [model.layers[0].register_forward_pre_hook(loop_start), model.norm_f.register_forward_pre_hook(head_start)]
    saved.label = "embed+router"
    flops = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) if count_flops else None
    with on_meta(counts, device_type), flops or nullcontext(), live:
        with saved:
            loss = loss_of(model, cfg, x, y, shortcut)
        saved.label = None
        loss.backward()
        del loss
    for h in hooks:
        h.remove()
    return StepTrace(
        params=sum(p.numel() for p in params),
        largest_param=max(p.numel() for p in params),
        sizes=tuple(p.numel() for p in params),
        group_sizes=tuple(sum(p.numel() for p in g["params"]) for g in model.param_groups(cfg.optim.weight_decay)),
        grad_bytes=sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        live=live,
        saved=dict(saved.by_label),
        flops=float(flops.get_total_flops()) if flops else 0.0,
    )
