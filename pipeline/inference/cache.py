"""Recursion-wise KV cache (docs/design.md §2): one key/value cache per (loop i, layer j).

Two exact layouts, one class:

* ``compact`` (default): loop i's cache holds, per row, only the tokens that ran loop i, appended in
  position order; a per-row length n_i[b] = |A_i^b| says how many entries are valid. Entries past a row's
  length are never read (the attention mask or the slice stops at the length), so no validity mask is
  needed and the cache holds sum_i |A_i| entries per layer instead of M * T.
* ``slots`` (the paper's layout): loop i's cache has a slot at every original position and a validity
  mask mu_i[b, t] = [m_t >= i]. Exited tokens leave their slot empty (zeros) and the mask hides it.
  The authors' public code attends to those empty slots: a bug, which tests/test_inference.py reproduces by
  overriding `_slot_mask` to show that the exactness checks catch it.

Tensors: K/V of loop i, layer j are (B, H, cap_i, hd); capacities grow by doubling. Lengths are kept
both on the device (for masks) and on the host (for shapes and early exit, so a decode step syncs once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoopView:
    """What one loop of one decode step needs, for the rows that run (or write) it."""

    rows: torch.Tensor | None  # (R,) batch rows, None = every row (no gather)
    slot: torch.Tensor  # (R,) where each row writes its new entry
    S: int  # entries to read (max over the rows, new entry included)
    mask: torch.Tensor | None  # (R, 1, 1, S) bool, True = may attend; None = every read entry is valid
    full_read: bool = False  # rows is a subset but reads (and the mask, (B, 1, 1, S)) cover the whole batch


class RecursionKVCache:
    def __init__(
        self,
        loops: int,
        layers: int,
        batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "compact",
        max_len: int | None = None,
    ):
        assert layout in ("compact", "slots"), layout
        self.M, self.J, self.B, self.H, self.hd = loops, layers, batch, heads, head_dim
        self.dtype, self.device, self.layout = dtype, torch.device(device), layout
        self.max_len = max_len  # the model's block size: capacities never grow past it
        self.k: list[list[torch.Tensor | None]] = [[None] * layers for _ in range(loops)]
        self.v: list[list[torch.Tensor | None]] = [[None] * layers for _ in range(loops)]
        self.cap = [0] * loops
        self.n = torch.zeros(loops, batch, dtype=torch.long, device=self.device)  # (M, B) entries per row
        self.n_host = np.zeros((loops, batch), dtype=np.int64)
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)  # (B,) tokens seen per row
        self.pos_host = np.zeros(batch, dtype=np.int64)
        self.valid: list[torch.Tensor | None] = [None] * loops  # slots layout: (B, cap) mu_i

    # ------------------------------------------------------------------------------------ storage
    def _ensure(self, i: int, need: int) -> None:
        """Capacity of loop i (0-based) at least `need` entries; grows every layer by doubling."""
        if need <= self.cap[i]:
            return
        cap = max(need, 2 * self.cap[i], 16)
        if self.max_len is not None:
            cap = min(cap, max(self.max_len, need))
        shape = (self.B, self.H, cap, self.hd)
        for j in range(self.J):
            for store in (self.k, self.v):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)  # empty slots are zeros
                if store[i][j] is not None:
                    new[:, :, : self.cap[i]] = store[i][j]
                store[i][j] = new
        if self.layout == "slots":
            mu = torch.zeros(self.B, cap, dtype=torch.bool, device=self.device)
            if self.valid[i] is not None:
                mu[:, : self.cap[i]] = self.valid[i]
            self.valid[i] = mu
        self.cap[i] = cap

    # ------------------------------------------------------------------------------------ prefill
    def prefill_store(
        self, i: int, j: int, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor | None, n: np.ndarray, reserve: int
    ) -> None:
        """Loop i (1-based), layer j of a prefill. k, v (B, H, Tm, hd) of the compacted active tokens (row
        b's first n[b] are real, the rest tail padding); order (B, Tm) their original positions (None:
        identity, no compaction)."""
        i0 = i - 1
        Tm = k.shape[2]
        if self.layout == "compact":
            self._ensure(i0, int(n.max(initial=0)) + reserve)
            self.k[i0][j][:, :, :Tm] = k
            self.v[i0][j][:, :, :Tm] = v
            return
        T = int(self.pos_host.max(initial=0))
        self._ensure(i0, T + reserve)
        real = torch.arange(Tm, device=self.device)[None] < torch.as_tensor(n, device=self.device)[:, None]
        keep = real[:, None, :, None].to(k.dtype)  # padding never lands in a slot
        if order is None:
            order = torch.arange(Tm, device=self.device)[None].expand(self.B, Tm)
        idx = order[:, None, :, None].expand(self.B, self.H, Tm, self.hd)
        self.k[i0][j].scatter_(2, idx, k * keep)
        self.v[i0][j].scatter_(2, idx, v * keep)
        if j == 0:
            self.valid[i0].scatter_(1, order, real)

    def prefill_done(self, i: int, n: np.ndarray) -> None:
        """Loop i (1-based) of the prefill is finished: row b holds n[b] entries."""
        self.n_host[i - 1] = n
        self.n[i - 1] = torch.as_tensor(n, device=self.device)

    def set_lengths(self, lengths: np.ndarray) -> None:
        """Prompt lengths (tokens seen per row) after a prefill."""
        self.pos_host[:] = lengths
        self.pos.copy_(torch.as_tensor(lengths, device=self.device))

    # ------------------------------------------------------------------------------------- decode
    def begin_loop(self, i: int, rows_np: np.ndarray) -> LoopView:
        """Reserves the new token's entry in loop i (1-based) for rows `rows_np` (host indices, sorted)."""
        i0 = i - 1
        every = len(rows_np) == self.B
        rows = None if every else torch.as_tensor(rows_np, device=self.device)
        if self.layout == "compact":
            lens_host = self.n_host[i0, rows_np] + 1  # (R,) entries after the write
            S = int(lens_host.max())
            self._ensure(i0, S)
            n = self.n[i0] if every else self.n[i0, rows]
            slot = n.clone()
            self.n_host[i0, rows_np] = lens_host
            if every:
                self.n[i0] += 1
            else:
                self.n[i0, rows] += 1
            ar = torch.arange(S, device=self.device)[None]  # (1, S)
            if not every and 2 * len(rows_np) >= self.B:
                # most rows run this loop: attend over the whole batch's cache (a view, no copy of the
                # rows' entries); rows that skip the loop see only entry 0 and their output is dropped
                run = torch.zeros(self.B, dtype=torch.bool, device=self.device).index_fill_(0, rows, True)
                mask = torch.where(run[:, None], ar < self.n[i0][:, None], ar == 0)
                return LoopView(rows, slot, S, mask[:, None, None], full_read=True)
            uniform = bool((lens_host == S).all())
            mask = None if uniform else (ar < (slot + 1)[:, None])[:, None, None]
            return LoopView(rows, slot, S, mask)
        pos_host = self.pos_host[rows_np]  # slots layout: write at the original position
        S = int(pos_host.max()) + 1
        self._ensure(i0, S)
        slot = self.pos if every else self.pos[rows]
        slot = slot.clone()
        ridx = torch.arange(self.B, device=self.device) if every else rows
        self.n_host[i0, rows_np] += 1
        self.n[i0, ridx] += 1
        self.valid[i0][ridx, slot] = True
        causal = torch.arange(S, device=self.device)[None] <= slot[:, None]  # (R, S)
        return LoopView(rows, slot, S, self._slot_mask(causal, i0, ridx, S)[:, None, None])

    def _slot_mask(self, causal: torch.Tensor, i0: int, ridx: torch.Tensor, S: int) -> torch.Tensor:
        """(R, S) bool: the slots a row may read in loop i0 + 1, causal and valid (mu_i) ones only."""
        return causal & self.valid[i0][ridx, :S]

    def write(self, i: int, j: int, view: LoopView, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (R, H, 1, hd) of the new token at loop i (1-based), layer j."""
        ridx = torch.arange(self.B, device=self.device) if view.rows is None else view.rows
        self.k[i - 1][j][ridx, :, view.slot] = k[:, :, 0]
        self.v[i - 1][j][ridx, :, view.slot] = v[:, :, 0]

    def read(self, i: int, j: int, view: LoopView) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, H, S, hd) keys and values of loop i (1-based), layer j for the view's rows ((B, H, S, hd)
        views of the whole batch when view.full_read)."""
        K, V = self.k[i - 1][j], self.v[i - 1][j]
        if view.rows is None or view.full_read:
            return K[:, :, : view.S], V[:, :, : view.S]
        return K[view.rows, :, : view.S], V[view.rows, :, : view.S]

    def end_step(self, rows_np: np.ndarray) -> None:
        """One token was appended to each of these rows."""
        self.pos_host[rows_np] += 1
        if len(rows_np) == self.B:
            self.pos += 1
        else:
            self.pos[torch.as_tensor(rows_np, device=self.device)] += 1

    # ------------------------------------------------------------------------------------- memory
    def entries(self) -> int:
        """Valid key/value entries per layer: sum over loops i and rows of |A_i| (each entry is one key and
        one value of H * hd numbers). A cache in which every token wrote every loop holds M * sum(T)."""
        return int(self.n_host.sum())

    def entries_per_loop(self) -> list[int]:
        return [int(x) for x in self.n_host.sum(1)]

    def nbytes(self) -> int:
        """Bytes allocated by all K/V tensors (capacity, i.e. the longest row of each loop, plus headroom)."""
        return sum(
            t.numel() * t.element_size() for store in (self.k, self.v) for row in store for t in row if t is not None
        )

    def memory(self) -> dict:
        """Entries (sum_i |A_i|), the dense M * T count it replaces, and bytes used and allocated."""
        per_entry = 2 * self.J * self.H * self.hd * torch.empty((), dtype=self.dtype).element_size()
        dense = self.M * int(self.pos_host.sum())
        return {
            "entries": self.entries(),
            "entries_per_loop": self.entries_per_loop(),
            "dense_entries": dense,
            "ratio_to_dense": self.entries() / dense if dense else 0.0,
            "bytes_used": self.entries() * per_entry,
            "bytes_allocated": self.nbytes(),
        }
