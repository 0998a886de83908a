"""Prefill and early-exit decode with the recursion-wise KV cache (docs/design.md §2, paper §3.3 and appendix).

    prefill(prompts)   the prompts (right-padded, pads get depth 0 so they are never active) go through
                       the model's own gather-scatter loops (`LoopedLM.run_loops` with cache hooks) in one
                       call; every (loop, layer) attention writes its compacted keys/values into that
                       loop's cache.
    step(tokens)       each row's new token gets its depth m from the router; loop i runs only the rows
                       with m >= i (gathered), each attending to loop i's cache plus itself, appends its
                       k/v there, and is scattered back; loops past a row's depth are skipped (early exit;
                       with one row, the loop simply stops). The loop itself is the model's `loop`, the one
                       the training path runs: the decoder only chooses its rows and its attention.

Modulation (shift/gate per (depth, loop) pair) is a (K, 4d) table per layer, built by each `Decoder` from
`model.modulation_tables(uniform(M))` when it is created and only indexed while decoding: no modulator
weight is read per token. A new `Decoder` always sees the model's current weights, dtype and device.
The router's straight-through factor 1 + s - sg(s) is 1 in value and is skipped here; outputs match the
model's forward within fp32 rounding (tests: atol 1e-5).

The full-depth path: every token writes every loop's cache. A token that exited after m loops keeps its state
h^(m) and, in loops i > m, still projects keys/values from it (one k/v projection per layer) so later tokens
attend to all tokens at every loop (CALM-style state propagation; the paper's "without recursion-wise KV
cache"). For a model with `model.exited_keys=frozen` this is the model itself, taken automatically, and its
outputs match the forward. For the default (`drop`) it is `full_depth=True`, the benchmark's ablation (b): its
outputs differ from the model's whenever depths differ; with every depth = M it is the ordinary cache.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.inference.cache import LoopView, RecursionKVCache
from pipeline.model.interface import LoopedNetwork
from pipeline.model.schedule import uniform


def modulation_tables(model: LoopedNetwork, M: int):
    """The per-layer (K, 4d) modulation tables of budget M (K = M(M+1)/2), built from the model's weights as
    they are now, in their dtype and on their device. Each `Decoder` builds its own: a table kept across
    decoders could go stale when weights change in ways no cheap stamp sees (`.data` writes, a distributed
    optimizer's copies, `model.to(dtype)`), while rebuilding costs one small MLP pass over K rows."""
    with torch.no_grad():
        return model.modulation_tables(uniform(M))


def pad_prompts(prompts, device) -> tuple[torch.Tensor, np.ndarray]:
    """list of token lists (or a (B, T) tensor) -> right-padded idx (B, T) int64 and lengths (B,)."""
    if isinstance(prompts, torch.Tensor):
        assert prompts.dim() == 2, "a prompt tensor must be (B, T)"
        return prompts.to(device=device, dtype=torch.long), np.full(prompts.shape[0], prompts.shape[1], np.int64)
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    if len(lengths) == 0 or lengths.min() < 1:
        raise ValueError("every prompt needs at least one token")
    idx = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):  # building the input, not the hot path
        idx[b, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    return idx.to(device), lengths


class _PrefillHooks:
    """Connects LoopedLM.run_loops to the cache during a prefill (the `LoopHooks` of pipeline/model/interface.py):
    every layer's k/v of the compacted active tokens is stored (then attention runs causally among them), and
    each finished loop records |A_i|."""

    def __init__(self, dec: "Decoder", reserve: int):
        self.dec, self.reserve = dec, reserve

    def attend(self, i: int, j: int, order, n: np.ndarray):
        return partial(self.dec._prefill_attend, i, j, order, n, self.reserve)

    def loop_done(self, i: int, n: np.ndarray) -> None:
        self.dec.cache.prefill_done(i, n)


class Decoder:
    """One batch's generation state: the cache and the modulation tables of its budget M (built here, from the
    model's current weights)."""

    def __init__(
        self,
        model: LoopedNetwork,
        loops: int | None = None,
        threshold: float | None = None,
        layout: str = "compact",
        full_depth: bool = False,
        router: bool = True,
    ):
        cfg = model.cfg
        self.model, self.M = model, cfg.loops if loops is None else int(loops)
        if not 1 <= self.M <= cfg.loops:
            raise ValueError(f"loop budget {self.M} must lie in 1..{cfg.loops}")
        self.theta = cfg.router_threshold if threshold is None else threshold
        self.router = router  # False: every token runs the whole budget (the router is not consulted)
        # frozen exited keys (model.exited_keys=frozen) are the model itself on the full-depth path; with dropped
        # ones that path is the benchmark's ablation (b)
        self.layout, self.full_depth = layout, full_depth or cfg.exited_keys == "frozen"
        self.tables = modulation_tables(model, self.M)  # per layer (K, 4d) or None
        self.cache: RecursionKVCache | None = None

    # ----------------------------------------------------------------------------------- helpers
    def _depth(self, h0: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T) int64 in 1..M
        r = self.model.route(h0, self.router)
        if r is None:
            return torch.full(h0.shape[:2], self.M, dtype=torch.long, device=h0.device)
        return r.depth(self.M, self.theta)

    def _prefill_attend(self, i, j, order, n, reserve, q, k, v):
        self.cache.prefill_store(i, j, k, v, order, n, reserve)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _decode_attend(self, i: int, j: int, view: LoopView, q, k, v):
        self.cache.write(i, j, view, k, v)
        K, V = self.cache.read(i, j, view)  # (R, H, S, hd), or (B, H, S, hd) with full_read
        if view.full_read:  # queries placed at their rows of the whole batch, results taken back
            qf = q.new_zeros((K.shape[0],) + q.shape[1:]).index_copy(0, view.rows, q)  # (B, H, 1, hd)
            return F.scaled_dot_product_attention(qf, K, V, attn_mask=view.mask)[view.rows]
        return F.scaled_dot_product_attention(q, K, V, attn_mask=view.mask)

    def _new_cache(self, B: int, device) -> RecursionKVCache:
        m = self.model
        attn = m.layers[0].attn
        return RecursionKVCache(
            self.M,
            len(m.layers),
            B,
            attn.n_heads,
            attn.head_dim,
            m.wte.weight.dtype,
            device,
            layout=self.layout,
            max_len=m.cfg.block_size,
        )

    # ----------------------------------------------------------------------------------- prefill
    @torch.no_grad()
    def prefill(self, prompts, reserve: int = 0, all_logits: bool = False, use_cache: bool = True):
        """Runs the prompts (list of token lists or (B, T) tensor) in one call and fills every cache.
        reserve: decode steps to pre-allocate. Returns (logits, depth): logits (B, V) at each row's last
        prompt token, or (B, T, V) with all_logits; depth (B, T) int64 (0 on padding).
        use_cache=False runs the same path without keeping any cache (the no-cache baseline)."""
        m = self.model
        dev = m.wte.weight.device
        idx, lengths = pad_prompts(prompts, dev)
        B, T = idx.shape
        h = m.embed(idx)  # (B, T, d): learned positions 0..T-1, added once
        depth = self._depth(h)
        real = torch.arange(T, device=dev)[None] < torch.as_tensor(lengths, device=dev)[:, None]  # (B, T)
        depth = torch.where(real, depth, 0)
        self.cache = self._new_cache(B, dev) if use_cache else None
        if use_cache:
            self.cache.set_lengths(lengths)
        if self.full_depth:
            for i in range(1, self.M + 1):
                h = self._prefill_loop_full(h, depth, i, lengths, reserve)
        else:  # the model's own gather-scatter loops, the cache filled through its hooks
            hooks = _PrefillHooks(self, reserve) if use_cache else None
            h = m.run_loops(h, uniform(self.M), depth, None, tables=self.tables, hooks=hooks)
        if all_logits:
            return m.head(h)[0], depth
        last = h[torch.arange(B, device=dev), torch.as_tensor(lengths - 1, device=dev)]  # (B, d)
        return m.head(last)[0], depth

    def _prefill_loop_full(self, h, depth, i, lengths, reserve):
        """Every real token writes loop i (dense, no compaction); an exited token's state stays frozen through
        every layer of the loop (its keys and values at layer j come from its final state, as `_write_exited`
        projects them while decoding): the model's loop with `keep`, as its dense path runs
        model.exited_keys=frozen."""
        active = depth >= i  # (B, T)
        attends = [partial(self._prefill_attend, i, j, None, lengths, reserve) for j in range(len(self.model.layers))]
        h = self.model.loop(h, i, self.M, self.tables, depth, attends=attends, active=active, keep=~active)
        self.cache.prefill_done(i, lengths)
        return h

    # ------------------------------------------------------------------------------------ decode
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, live: np.ndarray | None = None):
        """Appends one token per row. tokens (B,) int64; live (B,) bool on the host (rows that stopped get
        depth 0: no compute, no cache write). Returns (logits (B, V), depth (B,) int64, 0 for stopped rows)."""
        m, cache = self.model, self.cache
        assert cache is not None, "prefill first"
        B = tokens.shape[0]
        if int(cache.pos_host.max()) >= m.cfg.block_size:
            raise ValueError(f"sequence would exceed block_size {m.cfg.block_size}")
        h = m.embed(tokens[:, None], cache.pos)  # (B, 1, d): each row at its own position
        depth = self._depth(h)[:, 0]  # (B,)
        live = np.ones(B, dtype=bool) if live is None else np.asarray(live, dtype=bool)
        if not live.all():
            depth = torch.where(torch.as_tensor(live, device=h.device), depth, 0)
        dh = depth.cpu().numpy()  # the step's only sync: shapes and early exit are decided on the host
        for i in range(1, self.M + 1):
            rows_np = np.flatnonzero(dh >= i)
            exited_np = np.flatnonzero(live & (dh < i)) if self.full_depth else rows_np[:0]
            if len(rows_np) == 0 and len(exited_np) == 0:
                break  # early exit: no row runs loop i or beyond
            if len(rows_np):
                view = cache.begin_loop(i, rows_np)
                x = h if view.rows is None else h[view.rows]  # (R, 1, d)
                dep = depth if view.rows is None else depth[view.rows]
                attends = [partial(self._decode_attend, i, j, view) for j in range(len(m.layers))]
                x = m.loop(x, i, self.M, self.tables, dep[:, None], attends=attends)  # against loop i's cache
                h = x if view.rows is None else h.index_copy(0, view.rows, x)
            if len(exited_np):
                self._write_exited(i, exited_np, h, depth)
        cache.end_step(np.flatnonzero(live))
        return m.head(h[:, 0])[0], depth

    def _write_exited(self, i, rows_np, h, depth):
        """Ablation (b): rows past their depth project k/v of their frozen state into loop i's cache."""
        view = self.cache.begin_loop(i, rows_np)
        x = h if view.rows is None else h[view.rows]  # (R, 1, d)
        dep = depth if view.rows is None else depth[view.rows]
        mods = self.model.loop_mods(self.tables, i, self.M, dep[:, None])
        for j, layer in enumerate(self.model.layers):
            k, v = layer.kv(x, None if mods is None else mods[j])
            self.cache.write(i, j, view, k, v)
