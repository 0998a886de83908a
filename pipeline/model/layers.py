"""Building blocks of the LoopedLM: RMSNorm, attention, MLP, the (modulated) layer, Fourier embeddings.

Shapes: B batch, T tokens (possibly a compacted active set), d model width, H heads, K distinct
conditioning values (depth, loop) pairs of one pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.config import ModelConfig


NORM_EPS = 1e-5  # RMSNorm's epsilon
FOURIER_MAX_PERIOD = 10000.0  # the longest period of the time/step embeddings' Fourier features

# torch's fused RMSNorm kernel (one kernel forward, one backward; keeps x and a per-row factor for backward), where
# this build has it for CUDA. Elsewhere F.rms_norm is composed of an fp32 upcast of x, which autograd keeps: twice
# the bytes of a bf16 x, so there RMSNorm runs the formula, whose bytes kept for backward are the fused kernel's.
_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm") and torch._C._dispatch_has_kernel_for_dispatch_key(
    "aten::_fused_rms_norm", "CUDA"
)


class RMSNorm(nn.Module):
    """RMSNorm; `affine=False` inside modulated blocks (the modulator's gamma scales instead)."""

    def __init__(self, d: int, affine: bool = True, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
        if x.is_cuda and _FUSED_RMS_NORM:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * self.weight if self.weight is not None else y


class FourierEmbedding(nn.Module):
    """phi(s): `dim` sinusoidal features (cos, sin; max period FOURIER_MAX_PERIOD) then Linear-SiLU-Linear to d."""

    def __init__(self, d: int, dim: int, max_period: float = FOURIER_MAX_PERIOD):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.mlp = nn.Sequential(nn.Linear(dim, d), nn.SiLU(), nn.Linear(d, d))

    def forward(self, s: torch.Tensor) -> torch.Tensor:  # (K,) -> (K, d)
        args = s.float()[:, None] * self.freqs[None]
        feats = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))


class Attention(nn.Module):
    """Multi-head self-attention through PyTorch SDPA. `qkv` and `out` are split out for the KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv_proj = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def qkv(self, x: torch.Tensor):  # (B, T, d) -> 3 x (B, H, T, hd)
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def out(self, y: torch.Tensor) -> torch.Tensor:  # (B, H, T, hd) -> (B, T, d)
        B, H, T, hd = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, attend=None) -> torch.Tensor:
        """x (B, T, d); mask None = causal, else bool (B, 1, T, T) with True = may attend.
        attend: optional callable (q, k, v) -> y (B, H, T, hd) replacing SDPA (the KV cache hooks in here)."""
        q, k, v = self.qkv(x)
        if attend is not None:
            y = attend(q, k, v)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        return self.proj(F.gelu(self.fc(x)))


# torch.mm(..., out_dtype=torch.float32) of bf16/fp16 operands: a CUDA kernel in recent torch versions
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


class RowMod(NamedTuple):
    """Per-token modulation given by reference: row idx[b, t] of a (K, 4d) table (K = the distinct (depth, loop)
    pairs of a pass). Layers scale by the picked rows without materialising (B, T, 4d) for backward. onehot:
    idx as a (B*T, K) one-hot in the table's dtype, the operand of the table's gradient (`SharedBlock` builds
    it once per loop for its J layers; None: built by the layer when the table needs a gradient)."""

    table: torch.Tensor  # (K, 4d)
    idx: torch.Tensor  # (B, T) int64 row of each token
    onehot: torch.Tensor | None = None  # (B*T, K)


def _one_hot(idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(B*T, K): the rows idx (B, T) picks from table (K, ...) as a one-hot in the table's dtype (two kernels,
    no host read)."""
    flat = idx.reshape(-1, 1)
    return torch.zeros(flat.shape[0], table.shape[0], dtype=table.dtype, device=table.device).scatter_(1, flat, 1.0)


def _row_sums(onehot: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(K, d) = onehot.T @ p for onehot (N, K) and p (N, d): p's rows summed per table row in one matmul,
    accumulated in fp32 or wider (deterministic, no atomics: an index_add_ on a GPU is N*d atomic adds into the
    few rows one loop uses). bf16/fp16 on a GPU (or the plan's meta trace of one): the matmul writes fp32 itself;
    elsewhere they are upcast first."""
    oh = onehot.t() if onehot.dtype == p.dtype else onehot.t().to(p.dtype)  # (K, N); autocast: p in fp32
    if p.dtype not in (torch.float16, torch.bfloat16):
        return oh @ p
    if p.device.type in ("cuda", "meta") and _MM_OUT_DTYPE:
        return torch.mm(oh, p, out_dtype=torch.float32)
    return oh.float() @ p.float()


class _ScaleRows(torch.autograd.Function):
    """y = x * (c + r) for x (B, T, d), r = rows[idx] (B, T, d) gathered by the caller, rows (K, d), idx (B, T),
    onehot (B*T, K) idx's one-hot (None when rows need no gradient), c 1 (gamma: x + x * r, one fused op) or 0
    (gate).

    Saves x, the small table, the index and the one-hot, and gathers rows[idx] again in backward: the (B, T, d)
    gathered rows and c + rows[idx] that plain autograd would keep per token are never stored. The table's
    gradient is a sum over all B*T tokens accumulated in fp32 (`_row_sums`), cast back to the table's dtype."""

    @staticmethod
    def forward(ctx, x, rows, r, idx, onehot, c: float):
        assert c in (0.0, 1.0), c
        ctx.c = c
        ctx.save_for_backward(x, rows, idx, onehot)
        return torch.addcmul(x, x, r) if c else x * r

    @staticmethod
    def backward(ctx, gy):
        x, rows, idx, onehot = ctx.saved_tensors
        gx = grows = None
        if ctx.needs_input_grad[0]:
            r = F.embedding(idx, rows)  # (B, T, d) = rows[idx] (a row copy: ~3x faster than indexing)
            gx = torch.addcmul(gy, gy, r) if ctx.c else gy * r
        if ctx.needs_input_grad[1]:
            grows = _row_sums(onehot, (gy * x).reshape(-1, rows.shape[-1]))  # (K, d)
            grows = grows if grows.dtype == rows.dtype else grows.to(rows.dtype)
        return gx, grows, None, None, None, None


def _split(mod, parts: tuple[int, int] = (0, 4)) -> list:
    """Scales parts[0]..parts[1]-1 of (a_msa, a_mlp, g_msa, g_mlp) as callables scale(x, c) -> x * (c + part) for a
    dense mod tensor (B|1, T|1, 4d) or a RowMod; a RowMod's rows of all of them are gathered at once (one
    (B, T, k*d) gather per layer, not kept for backward)."""
    lo, hi = parts
    if not isinstance(mod, RowMod):
        return [lambda x, c, r=r: x * (r + c) if c else x * r for r in mod.chunk(4, dim=-1)[lo:hi]]
    d = mod.table.shape[-1] // 4
    table = mod.table if hi - lo == 4 else mod.table[:, lo * d : hi * d]  # (K, k*d)
    rows = F.embedding(mod.idx, table.detach()).chunk(hi - lo, dim=-1)  # k x (B, T, d) views of one gather
    onehot = mod.onehot
    if onehot is None and table.requires_grad and torch.is_grad_enabled():
        onehot = _one_hot(mod.idx, table)
    return [
        lambda x, c, t=t, r=r: _ScaleRows.apply(x, t, r, mod.idx, onehot, c)
        for t, r in zip(table.chunk(hi - lo, dim=-1), rows)
    ]


class Layer(nn.Module):
    """One layer of the shared block.

    Modulated: x <- x + a_msa * MHSA(RMSNorm(x) * (1 + g_msa)); x <- x + a_mlp * FFN(RMSNorm(x) * (1 + g_mlp)),
    with (a_msa, a_mlp, g_msa, g_mlp) = modulator(c) split in four, the modulator SiLU -> Linear(d, 4d)
    zero-initialised so the layer starts as the identity. Plain (unconditioned variants): standard
    pre-norm layer with affine RMSNorm, gates fixed to 1 and gamma to 0.
    """

    def __init__(self, cfg: ModelConfig, modulated: bool):
        super().__init__()
        self.modulated = modulated
        self.norm1 = RMSNorm(cfg.d_model, affine=not modulated)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, affine=not modulated)
        self.mlp = MLP(cfg)
        if modulated:
            self.modulator = nn.Sequential(nn.SiLU(), nn.Linear(cfg.d_model, 4 * cfg.d_model))

    def forward(
        self, x: torch.Tensor, mod: torch.Tensor | None, mask: torch.Tensor | None = None, attend=None
    ) -> torch.Tensor:
        """x (B, T, d); mod: per-token modulation as a tensor (B, T, 4d) or (1, 1, 4d), or a RowMod (table
        rows by index: nothing per token kept for backward), None for plain layers; attend: optional
        attention override passed to Attention.forward (KV cache)."""
        if mod is None:
            x = x + self.attn(self.norm1(x), mask, attend)
            return x + self.mlp(self.norm2(x))
        a_msa, a_mlp, g_msa, g_mlp = _split(mod)
        x = x + a_msa(self.attn(g_msa(self.norm1(x), 1.0), mask, attend), 0.0)
        return x + a_mlp(self.mlp(g_mlp(self.norm2(x), 1.0)), 0.0)

    def kv(self, x: torch.Tensor, mod) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, T, hd) this layer's attention would project from x (B, T, d) under mod,
        without running it (decoding's ablation writes them for tokens past their depth)."""
        a = self.norm1(x) if mod is None else _split(mod, (2, 3))[0](self.norm1(x), 1.0)
        _, k, v = self.attn.qkv(a)
        return k, v


class SharedBlock(nn.ModuleList):
    """The shared block Phi_J: its J layers applied in order, one loop. A ModuleList, so parameters keep their
    names (layers.{j}.*); activation checkpointing and compilation wrap this module or its layers from outside
    (pipeline/train/ac.py, pipeline/train/compile.py): nothing here knows about them."""

    def forward(
        self,
        h: torch.Tensor,
        mods: list | None = None,
        mask: torch.Tensor | None = None,
        attends: list | None = None,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h (B, T, d); mods: per layer a modulation as Layer.forward takes it, or None; attends: per layer an
        attention override (the KV cache), or None; keep (B, T) bool: states that stay as they came in through
        every layer (exited tokens that stay keys, model.exited_keys=frozen): each layer's keys and values of
        theirs come from that frozen state."""
        h_in = h
        mods = one_hot_once(mods)
        for j, layer in enumerate(self):
            h = layer(h, None if mods is None else mods[j], mask, None if attends is None else attends[j])
            if keep is not None:
                h = torch.where(keep[..., None], h_in, h)
        return h


def one_hot_once(mods: list | None) -> list | None:
    """mods with each RowMod's one-hot filled in, one per index tensor: the J layers of a loop share the index,
    so its one-hot is built and kept for backward once per loop (only where a table needs a gradient)."""
    if mods is None or not torch.is_grad_enabled():
        return mods
    made, out = {}, []
    for m in mods:
        if isinstance(m, RowMod) and m.onehot is None and m.table.requires_grad:
            key = (id(m.idx), m.table.shape[0], m.table.dtype)
            if key not in made:
                made[key] = _one_hot(m.idx, m.table)
            m = m._replace(onehot=made[key])
        out.append(m)
    return out
