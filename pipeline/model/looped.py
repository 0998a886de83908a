"""LoopedLM: one module for every variant of docs/design.md §1 (flags in ModelConfig select the variant).

    h0 = E_tok + E_pos                                  # (B, T, d), positions added once
    depth m = router(h0) clipped at M (or M for all)    # (B, T)
    for loop i = 1..M:  A_i = {tau : m_tau >= i}
        h[A_i] <- Block_J(h[A_i]; c(m, i))              # causal attention among A_i only (model.exited_keys=drop)
                                                        # or over every token, exited ones frozen (=frozen)
    logits = head(RMSNorm(h))

Execution strategies (`model.execution`, docs/model.md 'Execution strategies'): the same loops, depths and outputs,
laid out differently. compact: loop i compacts each row's active tokens in position order into a (B, max|A_i|, d)
tensor (padding at the tail of shorter rows, so plain causal SDPA never lets a real query see a pad key), runs the
shared block on it and scatters the rows back. bucketed: compact with max|A_i| rounded up to one of BUCKETS
lengths. sorted: each row's tokens gathered once per pass, deepest first, so loop i's active tokens are a
contiguous prefix; attention among them by position. dense: every token runs with a mask (query tau may attend
tau' iff tau' <= tau and tau' in A_i) and inactive tokens keep their states: the test oracle and the ablation.
All of them, and the decoder's one-token steps, run each loop through `LoopedLM.loop` (modulation rows, shared
block, straight-through factor, merge); they differ only in which states they hand it.

The network computes passes, not losses: `forward` returns each pass's logits (or, with logits=False, only the
final-normed states the fused head takes), depths and the router's output. The training objective (both passes'
losses, the alignment, the router recipe's terms) is `pipeline.train.objective.Objective`, which wraps this
module; it asks for the shortcut pass by passing its schedule (`shortcut=`), so both passes share h0, the router
output and one host read of the active counts, and for the recipe's way of training the router by the call's
arguments (`ste`, `detach`, `exits`).
"""

from __future__ import annotations

import math
from functools import partial
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.config import ModelConfig
from pipeline.model.head_loss import LMHead
from pipeline.model.layers import FourierEmbedding, Layer, RMSNorm, RowMod, SharedBlock
from pipeline.model.router import Router, RouterOutput
from pipeline.model.schedule import table_index, time_table, uniform

INIT_STD = 0.02  # std of the normal init (residual projections scaled by 1/sqrt(2*J*L)); the router's recipe may
# give the router its own (pipeline/train/recipes)


def active_counts(depth: torch.Tensor, M: int) -> np.ndarray:
    """(B, M) int64 numpy: |A_i| = #{tau : depth_tau >= i} of each row for i = 1..M, from one host read (the
    shapes of every loop's compaction are known before the first loop runs)."""
    i = torch.arange(1, M + 1, device=depth.device)
    return (depth[..., None] >= i).sum(1).cpu().numpy()  # the pass's one device -> host sync


class _GatherRows(torch.autograd.Function):
    """h.gather(1, gidx) for h (B, T, d) and gidx (B, Tm, d) with distinct positions per row (a compaction).
    Autograd's own gather keeps the whole (B, T, d) input for backward; this keeps only the index: the
    gradient is scattered (not accumulated: positions are distinct, so it is deterministic on GPUs too)."""

    @staticmethod
    def forward(ctx, h, gidx):
        ctx.save_for_backward(gidx)
        ctx.shape = h.shape
        return h.gather(1, gidx)

    @staticmethod
    def backward(ctx, g):
        (gidx,) = ctx.saved_tensors
        return g.new_zeros(ctx.shape).scatter_(1, gidx, g), None  # (B, T, d), filled in place


class _StraightThrough(torch.autograd.Function):
    """The router's straight-through estimator on a loop's update, h + (out - h) * (1 + s - sg(s)) for the loop's
    input h (B, Tm, d), its block output out (B, Tm, d) and the tokens' continue probabilities s (B, Tm, 1):
    the value is out itself, out gets the incoming gradient unchanged, h none through this term, and s the
    projection sum_d g * (out - h). One subtraction forward and one dot product backward, where autograd on
    the formula runs about eight passes over (B, Tm, d); it keeps the same (B, Tm, d) difference."""

    @staticmethod
    def forward(ctx, h, out, s):
        ctx.save_for_backward(out - h)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        (delta,) = ctx.saved_tensors
        gs = torch.linalg.vecdot(g, delta)[..., None] if ctx.needs_input_grad[2] else None  # (B, Tm, 1)
        return None, g, gs


BUCKETS = 8  # the bucketed strategy's lengths: multiples of ceil(T / BUCKETS), at most T
FLEX_DEVICES = ("cuda",)  # where the sorted strategy attends through FlexAttention block masks (else SDPA masks)


def bucket_length(n: int, T: int) -> int:
    """The bucketed strategy's computed length for n active tokens of a row of T: n rounded up to a multiple of
    ceil(T / BUCKETS), at most T."""
    step = -(-T // BUCKETS)
    return min(T, -(-n // step) * step)


def _first_slots(n: np.ndarray, S: int, device) -> torch.Tensor:
    """(B, S) bool: slot s of row b is among its first n[b] (n (B,) numpy, sent to the device without a sync)."""
    return torch.arange(S, device=device)[None] < torch.from_numpy(n).to(device)[:, None]


def _sorted_attends(pos: torch.Tensor, real: torch.Tensor, J: int) -> list:
    """The sorted strategy's attention of one loop for its J layers: slots s, s' of a row (pos (B, Tm) their
    positions, real (B, Tm) the slots active in the loop): query s attends key s' iff s' is active and
    pos[s'] <= pos[s], or s' = s (an inactive slot's query sees itself: no empty row; its output is dropped).
    FlexAttention with a block mask on FLEX_DEVICES (skips the blocks no query needs), else a (B, 1, Tm, Tm) mask."""
    B, Tm = pos.shape
    if pos.device.type in FLEX_DEVICES:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q, k):
            return ((pos[b, k] <= pos[b, q]) & real[b, k]) | (q == k)

        block = create_block_mask(mask_mod, B, None, Tm, Tm, device=pos.device)
        attend = partial(_flex_attention(), block_mask=block)
    else:
        eye = torch.eye(Tm, dtype=torch.bool, device=pos.device)
        mask = (((pos[:, None, :] <= pos[:, :, None]) & real[:, None, :]) | eye)[:, None]  # (B, 1, Tm, Tm)
        attend = partial(F.scaled_dot_product_attention, attn_mask=mask)
    return [attend] * J


_FLEX = []


def _flex_attention():
    """torch's flex_attention, compiled once per process (its fast kernels exist only compiled)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=True))
    return _FLEX[0]


class _MaskHooks:
    """run_loops hooks for `LoopedLM.hidden_states` with an explicit (B, T, T) attention mask: each loop's mask
    among its compacted tokens is gathered once by `order` (the tril keeps the tail of pad slots hidden from
    real queries) and every layer of the loop attends with it."""

    def __init__(self, mask: torch.Tensor):
        self.mask, self.loop, self.cur = mask, 0, None

    def attend(self, i: int, j: int, order, n):
        if i != self.loop:
            m, T = self.mask, self.mask.shape[-1]
            if order is not None:  # (B, Tm, Tm) among loop i's compacted tokens
                m = m.gather(1, order[..., None].expand(-1, -1, T)).gather(
                    2, order[:, None, :].expand(-1, order.shape[1], -1)
                )
            self.loop, self.cur = i, (m & torch.ones(m.shape[-2:], dtype=torch.bool, device=m.device).tril())[:, None]
        cur = self.cur
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=cur)

    def loop_done(self, i: int, n) -> None:
        pass


@dataclass
class PassOutput:
    """One pass of the network (budget `loops`)."""

    logits: torch.Tensor | None  # (B, T, V); None when asked for logits=False (the objective's fused head)
    hidden: torch.Tensor  # (B, T, d) final-normed states: the head's input
    depth: torch.Tensor  # (B, T) int64 per-token depth, 1..loops
    loops: int  # the pass's budget (its schedule's length)


@dataclass
class LoopedLMOutput(PassOutput):
    """`LoopedLM.forward`: the pass of budget M, the router's output (shared by both passes; None without a router
    or with router=False) and, when a shortcut schedule was given, the pass with that schedule."""

    router: RouterOutput | None = None
    short: PassOutput | None = None
    exits: list[torch.Tensor] | None = None  # forward(exits=True): the final-normed state after each loop (B, T, d)


class LoopedLM(nn.Module):
    """The looped network. What code outside pipeline/model may use of it is `LoopedNetwork`
    (pipeline/model/interface.py, checked by tests/test_interface.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        self.wte = nn.Embedding(cfg.vocab_size, d)
        self.wpe = nn.Embedding(cfg.block_size, d)
        modulated = cfg.conditioning != "none"
        self.layers = SharedBlock(Layer(cfg, modulated) for _ in range(cfg.n_layers))  # Phi_J, one loop
        if modulated:
            self.phi_t = FourierEmbedding(d, cfg.fourier_dim)
        if cfg.conditioning == "time_step":
            self.phi_dt = FourierEmbedding(d, cfg.fourier_dim)
        self.router = (
            Router(d, max(d // 4, 1), cfg.loops, norm=cfg.router_norm, forecast=cfg.router_forecast)
            if cfg.router
            else None
        )
        self.norm_f = RMSNorm(d, affine=True)
        self.lm_head = LMHead(d, cfg.vocab_size)  # (V, d); also computes the fused objective (head_loss.py)
        self.lm_head.weight = self.wte.weight  # tied to the token embedding
        self._init_weights()

    # ------------------------------------------------------------------------------------------ init
    def _init_weights(self) -> None:
        std, cfg = INIT_STD, self.cfg
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.zeros_(p) if name.endswith("bias") else None
                continue
            if ".modulator." in name:
                continue
            s = (
                std / math.sqrt(2 * cfg.n_layers * cfg.loops)
                if name.endswith(("out_proj.weight", "mlp.proj.weight"))
                else std
            )
            nn.init.normal_(p, 0.0, s)
        for layer in self.layers:  # zero-initialised modulator: every modulated layer starts as the identity,
            if layer.modulated:  # or, with gate_init 1, as a plain pre-norm layer (its output gates a_msa, a_mlp)
                nn.init.zeros_(layer.modulator[1].weight)
                nn.init.zeros_(layer.modulator[1].bias)
                with torch.no_grad():
                    layer.modulator[1].bias[: 2 * cfg.d_model].fill_(cfg.gate_init)
        if self.router is not None and self.router.forecast is not None:  # every forecast 1/2 at init
            nn.init.zeros_(self.router.forecast.weight)

    # -------------------------------------------------------------------------------- conditioning
    def modulation_tables(self, delta: torch.Tensor) -> list[torch.Tensor] | None:
        """Per layer (K, 4d): the modulation of every (depth m, loop i) pair of a pass with schedule delta
        (K = M(M+1)/2). Computed once per pass, indexed per token: never a per-token Linear(d, 4d)."""
        if self.cfg.conditioning == "none":
            return None
        t, dt = time_table(delta, prefix=self.cfg.exit_schedule == "prefix")
        dev = self.wte.weight.device
        c = self.phi_t(t.to(dev))  # (K, d)
        if self.cfg.conditioning == "time_step":
            c = c + self.phi_dt(dt.to(dev))
        return [layer.modulator(c) for layer in self.layers]

    # ------------------------------------------------------------------------------------ the loops
    def loop_mods(
        self,
        tables: list[torch.Tensor] | None,
        i: int,
        M: int,
        depth: torch.Tensor | None = None,
        by_index: bool = True,
    ) -> list | None:
        """Per layer modulation of loop i in a pass of budget M from its `modulation_tables`: None for plain
        layers; with depth None (every token at depth M) the one table row, broadcast (1, 1, 4d); else each
        token's row for its (depth, i) pair: by index (RowMod, nothing per token kept for backward) or, with
        by_index=False, gathered (B, T, 4d) as the dense reference does."""
        if tables is None:
            return None
        if depth is None:
            ti = table_index(M, i)
            return [tb[ti].view(1, 1, -1) for tb in tables]
        ti = table_index(depth, i)  # (B, T)
        return [RowMod(tb, ti) if by_index else tb[ti] for tb in tables]

    def loop(
        self,
        h: torch.Tensor,
        i: int,
        M: int,
        tables: list[torch.Tensor] | None,
        depth: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        attends: list | None = None,
        cont: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        by_index: bool = True,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loop i of a pass of budget M on the states h (N, S, d) that a caller chose for it (a row's compacted
        active tokens, the decoder's gathered rows, or every token under a mask): the one place where a loop's
        arithmetic is written. depth (N, S): each state's depth, which picks its modulation row for (depth, i)
        from `tables` (None: every state at depth M). Attention: causal among the S states, or `mask` (N, 1, S, S)
        bool, or per layer an override `attends[j](q, k, v)` (the KV cache). cont (N, S): the continue
        probability p(i) of each state, for the router's straight-through estimator (None: none; loop 1's is the
        identity). active (N, S) bool: the states that take the loop's output; the others (exited tokens, tail
        padding of a compaction) leave it unchanged (None: all take it). by_index=False gathers the modulation
        rows per token (the dense reference). keep (N, S) bool: states that stay keys and values through their
        frozen state at every layer (exited tokens under model.exited_keys=frozen, on the dense path and the
        decoder's prefill). Returns the states after the loop (N, S, d)."""
        mods = self.loop_mods(tables, i, M, depth, by_index)
        out = self.layers(h, mods, mask, attends, keep)  # (N, S, d)
        if cont is not None and i > 1:  # p(1) is the constant 1
            out = _StraightThrough.apply(h, out, cont.to(out.dtype)[..., None])
        return out if active is None else torch.where(active[..., None], out, h)

    def run_loops(
        self,
        h0: torch.Tensor,
        delta: torch.Tensor,
        depth: torch.Tensor | None,
        cont: torch.Tensor | None,
        tables: list[torch.Tensor] | None = None,
        hooks=None,
        counts: np.ndarray | None = None,
        execution: str | None = None,
        collect: list | None = None,
    ) -> torch.Tensor:
        """Runs M = len(delta) loops from h0 (B, T, d). depth (B, T) in 0..M (0: a token that runs no loop,
        e.g. padding) or None (every token depth M); cont (B, T, L) continue probabilities for the
        straight-through estimator (None: no STE). tables: precomputed `modulation_tables(delta)` (decoding
        reuses them). hooks: the KV cache's prefill, an object with `attend(i, j, order, n)` -> attention
        override of layer j in loop i and `loop_done(i, n)`, where order (B, Tm) holds the positions of the
        compacted active tokens (None: no compaction) and n (B,) numpy int64 the |A_i| of each row; hooks run
        the compact strategy whatever `execution` says (their callers index by position). counts: (B, >= M)
        numpy int64 |A_i| of each row and loop (`active_counts`), or None to read them here: the pass's only host
        sync. execution: the strategy (default `cfg.execution`; docs/model.md 'Execution strategies'): compact,
        sorted, bucketed or dense (the masked reference). collect: a list that gets the states after each loop
        (B, T, d) appended (the exits of `forward(exits=True)`, every token at depth M). Returns the final states
        (B, T, d); exited tokens keep their last state. Each loop is `loop`; the strategies only choose which
        states it sees."""
        M = delta.numel()
        tables = self.modulation_tables(delta) if tables is None else tables
        B, T, _ = h0.shape
        ex = "compact" if hooks is not None else (execution or self.cfg.execution)
        if depth is not None and ex != "dense" and counts is None:
            counts = active_counts(depth, M)
        if depth is not None and ex == "sorted":
            assert collect is None, "exits are collected with every token at the whole budget"
            return self._sorted_loops(h0, M, tables, depth, cont, counts)
        h = h0
        for i in range(1, M + 1):
            p = None if cont is None else cont[..., i - 1]  # (B, T) each token's p(i)
            if depth is None:  # every token active: no compaction, one table row broadcast
                n = np.full(B, T, dtype=np.int64)
                h = self.loop(h, i, M, tables, attends=self._attends(hooks, i, None, n))
            elif ex == "dense":  # the reference (never with hooks)
                h = self._masked_loop(h, i, M, tables, depth, p)
            else:
                n = counts[:, i - 1]  # (B,) |A_i| per row, on the host
                if int(n.max()) == 0:
                    break
                h = self._compacted_loop(h, i, M, tables, depth, p, n, hooks, bucketed=ex == "bucketed")
            if hooks is not None:
                hooks.loop_done(i, n)
            if collect is not None:
                collect.append(h)
        return h

    def _sorted_loops(self, h0, M, tables, depth, cont, counts: np.ndarray) -> torch.Tensor:
        """The sorted strategy: one depth-sorted layout for the whole pass. Each row's tokens are gathered once,
        deepest first (position order within a depth), so loop i's active tokens fill the row's first |A_i|
        slots; loop i runs on the first Tm_i = max |A_i| slots (a view, no gather) with attention among the
        row's active slots by position (`_sorted_attends`), slots past a row's |A_i| taking no output. Slots
        past Tm_i never run again and are set aside; one gather at the end puts every token back in place."""
        B, T, d = h0.shape
        order = torch.sort(depth, dim=1, descending=True, stable=True).indices  # (B, T) position of each slot
        h = _GatherRows.apply(h0, order[..., None].expand(B, T, d))  # (B, T, d) in slot order
        ds = depth.gather(1, order)  # (B, T) each slot's depth, non-increasing
        cs = None if cont is None else cont.gather(1, order[..., None].expand(-1, -1, cont.shape[-1]))
        done, width = [], T  # finished slot ranges (later loops never touch them), right to left
        for i in range(1, M + 1):
            n = counts[:, i - 1]
            Tm = int(n.max())
            if Tm < width:
                done.append(h[:, Tm:width])  # (B, width - Tm, d)
                h, width = h[:, :Tm], Tm
            if Tm == 0:
                break
            real = _first_slots(n, Tm, h.device)  # (B, Tm) slots active in loop i
            attends = _sorted_attends(order[:, :Tm], real, len(self.layers))  # slots are not in position order
            p = None if cs is None else cs[:, :Tm, i - 1]
            active = None if int(n.min()) == Tm else real
            h = self.loop(h, i, M, tables, ds[:, :Tm], attends=attends, cont=p, active=active)
        out = torch.cat([h, *reversed(done)], dim=1) if done else h  # (B, T, d) in slot order
        inv = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=order.device).expand(B, T))
        return _GatherRows.apply(out, inv[..., None].expand(B, T, d))  # (B, T, d) back in position order

    def _compacted_loop(self, h, i, M, tables, depth, cont, n: np.ndarray, hooks, bucketed=False) -> torch.Tensor:
        """Loop i on each row's active tokens (depth >= i) of h (B, T, d), compacted in position order to the
        front of a (B, Tm, d) tensor (Tm = max n, n (B,) the rows' |A_i| on the host; shorter rows padded at the
        tail, so plain causal attention never lets a real query see a pad), then scattered back. bucketed: Tm
        rounded up to a multiple of ceil(T / BUCKETS) (the pad slots hold inactive tokens that take no output)."""
        B, T, d = h.shape
        if int(n.min()) == T:  # every token active (always so in loop 1): nothing to compact
            attends = self._attends(hooks, i, None, n)
            return self.loop(h, i, M, tables, depth, attends=attends, cont=cont)
        Tm = bucket_length(int(n.max()), T) if bucketed else int(n.max())
        order = torch.sort((~(depth >= i)).to(torch.uint8), dim=1, stable=True).indices[:, :Tm]  # (B, Tm)
        gidx = order[..., None].expand(B, Tm, d)
        real = _first_slots(n, Tm, h.device)  # (B, Tm) active tokens, not tail padding
        if self.cfg.exited_keys == "frozen":
            assert hooks is None, "the decoder runs frozen exited keys on its full-depth path"
            attends = self._frozen_attends(h, i, M, tables, depth, order, real)
        else:
            attends = self._attends(hooks, i, order, n)  # None: causal among A_i
        out = self.loop(
            _GatherRows.apply(h, gidx),  # (B, Tm, d)
            i,
            M,
            tables,
            depth.gather(1, order),  # (B, Tm): rows by index, no per-token (Tm, 4d) kept for backward
            attends=attends,
            cont=None if cont is None else cont.gather(1, order),
            active=real,
        )
        return h.scatter(1, gidx, out)

    def _frozen_attends(self, h, i, M, tables, depth, order, real) -> list:
        """Per layer the attention of loop i's compacted states (B, Tm) when exited tokens stay keys
        (model.exited_keys=frozen): queries from the compacted states; keys and values at every position of the
        row, those of the real compacted states scattered into the ones each layer projects from h (B, T, d),
        the states entering the loop (an exited token's frozen one, under its (i, i) modulation row); query at
        position p attends positions <= p."""
        mods = self.loop_mods(tables, i, M, depth)  # per token of the whole row, by index
        pos = torch.arange(h.shape[1], device=h.device)
        mask = (pos[None, None, :] <= order[:, :, None])[:, None]  # (B, 1, Tm, T)
        r = real[:, None, :, None]  # (B, 1, Tm, 1): tail padding keeps the frozen projection at its position

        def attend(layer, mod, q, k, v):  # q, k, v (B, H, Tm, hd) of the compacted states
            idx = order[:, None, :, None].expand_as(k)
            K, V = layer.kv(h, mod)  # (B, H, T, hd)
            K = K.scatter(2, idx, torch.where(r, k, K.gather(2, idx)))
            V = V.scatter(2, idx, torch.where(r, v, V.gather(2, idx)))
            return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)

        return [partial(attend, layer, None if mods is None else mods[j]) for j, layer in enumerate(self.layers)]

    def _masked_loop(self, h, i, M, tables, depth, cont) -> torch.Tensor:
        """The dense reference of loop i: every token of h (B, T, d) computed; query tau attends key tau' iff
        tau' <= tau and tau' in A_i (or tau' = tau), or, with model.exited_keys=frozen, every tau' <= tau, the
        exited ones through their frozen state; only active tokens take the output."""
        T = h.shape[1]
        active = depth >= i  # (B, T)
        if self.cfg.exited_keys == "frozen":  # causal over every token; exited states held at every layer
            return self.loop(h, i, M, tables, depth, cont=cont, active=active, by_index=False, keep=~active)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=h.device)
        mask = ((causal[None] & active[:, None, :]) | eye[None])[:, None]  # (B, 1, T, T)
        return self.loop(h, i, M, tables, depth, mask=mask, cont=cont, active=active, by_index=False)

    def _attends(self, hooks, i: int, order, n) -> list | None:
        return None if hooks is None else [hooks.attend(i, j, order, n) for j in range(len(self.layers))]

    # ------------------------------------------------------------------------------------- forward
    def embed(self, idx: torch.Tensor, pos_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """h0 (B, T, d) = E_tok + E_pos for tokens idx (B, T) at positions pos_offset.. ; pos_offset is an int
        or a (B,) tensor giving each row its own start (decoding rows of different lengths)."""
        T = idx.shape[1]
        if isinstance(pos_offset, torch.Tensor):
            pos = pos_offset[:, None] + torch.arange(T, device=idx.device)[None]  # (B, T); caller checks block_size
            return self.wte(idx) + self.wpe(pos)
        assert pos_offset + T <= self.cfg.block_size, f"sequence of {pos_offset + T} > block_size {self.cfg.block_size}"
        pos = torch.arange(pos_offset, pos_offset + T, device=idx.device)
        return self.wte(idx) + self.wpe(pos)[None]

    def route(self, h0: torch.Tensor, router: bool = True, detach: bool = False) -> RouterOutput | None:
        """The router's output for h0 (B, T, d), or None without a router or with router=False (every token
        then runs the whole budget: with the same weights, t-loopformer becomes loopformer). detach: the router
        reads sg(h0), so its gradients stop at the router (values unchanged)."""
        if self.router is None or not router:
            return None
        return self.router(h0.detach() if detach else h0)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hf = self.norm_f(h)
        return self.lm_head(hf), hf

    def final_states(
        self,
        h0: torch.Tensor,
        r: RouterOutput | None,
        delta: torch.Tensor,
        counts: np.ndarray | None = None,
        threshold: float | None = None,
        execution: str | None = None,
        hooks=None,
        ste: bool = False,
        collect: list | None = None,
    ):
        """One pass with schedule delta (budget M = len(delta)) from h0 (B, T, d): returns the final states
        before the norm (B, T, d) and the per-token depth (B, T) int64 in 1..M (all M without a router).
        counts: `active_counts` of a depth map of budget >= M from the same router output (None: read here).
        threshold: the router's exit threshold (default `cfg.router_threshold`); execution and hooks as
        run_loops; ste: the router's straight-through estimator on each loop's update (gradients only); collect as
        run_loops takes it."""
        M = delta.numel()
        depth = None if r is None else r.depth(M, self._theta(threshold))
        cont = None if (r is None or not ste) else r.cont
        h = self.run_loops(
            h0,
            delta,
            depth,
            cont,
            counts=counts,
            execution=execution,
            hooks=hooks,
            collect=collect,
        )
        if depth is None:
            depth = torch.full(h0.shape[:2], M, dtype=torch.long, device=h0.device)
        return h, depth

    def _theta(self, threshold: float | None) -> float:
        return self.cfg.router_threshold if threshold is None else float(threshold)

    def hidden_states(
        self,
        idx: torch.Tensor,
        loops: int,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        router: bool = True,
        threshold: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(idx, loops=M)` without the head: final states before the norm (B, T, d) and depth (B, T) in
        1..M (schedule 1/M). positions (B, T): each token's position (default 0..T-1). mask (B, T, T) bool, True
        on the diagonal and only where key <= query in row order: query tau may attend key tau' iff
        mask[tau, tau'] (replaces the causal rule; in loop i also tau' in A_i). With both, one row can hold a
        prefix followed by several branches that each continue it (the scorer's tree packing). Masked loops run
        compacted through attention hooks: the compact strategy whatever model.execution says (equal to
        the dense reference, docs/design.md §1); the mask of each loop is gathered once by `order`.
        router, threshold: as `forward` takes them."""
        M = int(loops)
        h0 = self.embed(idx) if positions is None else self.wte(idx) + self.wpe(positions)  # (B, T, d)
        hooks = None if mask is None else _MaskHooks(mask)
        return self.final_states(h0, self.route(h0, router), uniform(M), threshold=threshold, hooks=hooks)

    def _pass(self, h0, r: RouterOutput | None, delta, counts, threshold, ex, logits, **kw) -> PassOutput:
        h, depth = self.final_states(h0, r, delta, counts, threshold, ex, **kw)
        hf = self.norm_f(h)  # (B, T, d)
        return PassOutput(self.lm_head(hf) if logits else None, hf, depth, delta.numel())

    def forward(
        self,
        idx: torch.Tensor,
        *,
        loops: int | None = None,
        shortcut: torch.Tensor | None = None,
        logits: bool = True,
        router: bool = True,
        threshold: float | None = None,
        execution: str | None = None,
        ste: bool = False,
        detach: bool = False,
        exits: bool = False,
    ) -> LoopedLMOutput:
        """idx (B, T) tokens; loops = budget M <= L (default L; elastic inference uses the uniform schedule 1/M and
        clips router depth at M). shortcut: (S,) positive ints summing to L (M must be L): also run the pass with
        schedule k/L from the same h0 and router output (`out.short`); its depth at budget S is this pass's
        clipped at S (p(i) is non-increasing), so both passes' active counts come from one host read.
        logits=False: no head (`hidden` only, which the objective's fused head takes). The ablations' switches
        are arguments of the call, never model state: router=False runs every token through the whole budget
        (the router is not consulted); threshold overrides `cfg.router_threshold`; execution overrides
        `cfg.execution` (the strategy; "dense": the masked reference); ste: scale each active token's loop update by
        1 + p(i) - sg(p(i)) so the router gets a gradient (the values are unchanged); detach: the router reads
        sg(h0) (gradients only); exits: every token runs every loop of both passes (the router's output is
        returned but sets no depth: the training pass of a recipe that trains every exit), and
        `out.exits` holds the full pass's final-normed state after each loop 1..M, the last being `hidden`; with
        model.exit_schedule=prefix exit d is what a depth-d token would hold if every other token ran on too.
        Nothing here depends on `self.training`."""
        L = self.cfg.loops
        M = loops or L
        assert 1 <= M <= L, f"loop budget {M} must lie in 1..{L}"
        assert shortcut is None or M == L, "a shortcut pass is run beside the full budget M = L only"
        h0 = self.embed(idx)  # (B, T, d)
        r = self.route(h0, router, detach)
        if exits:
            return self._exits(h0, r, M, shortcut, logits)
        ex = execution or self.cfg.execution
        # |A_i| of every loop of both passes from one host read (the shortcut pass's are this pass's first S)
        counts = active_counts(r.depth(M, self._theta(threshold)), M) if (r is not None and ex != "dense") else None
        full = self._pass(h0, r, uniform(M), counts, threshold, ex, logits, ste=ste)
        short = None
        if shortcut is not None:
            short = self._pass(h0, r, shortcut.double() / L, counts, threshold, ex, logits, ste=ste)
        return LoopedLMOutput(full.logits, full.hidden, full.depth, full.loops, router=r, short=short)

    def _exits(self, h0, r: RouterOutput | None, M: int, shortcut, logits: bool) -> LoopedLMOutput:
        """`forward(exits=True)`: both passes with every token at the whole budget; the full pass's state after
        each loop, final-normed (M of (B, T, d))."""
        states = []  # the state after each loop (B, T, d), the last normed by the pass itself
        full = self._pass(h0, None, uniform(M), None, None, None, logits, collect=states)
        short = None
        if shortcut is not None:
            short = self._pass(h0, None, shortcut.double() / M, None, None, None, logits)
        exits = [*(self.norm_f(h) for h in states[:-1]), full.hidden]
        return LoopedLMOutput(full.logits, full.hidden, full.depth, M, router=r, short=short, exits=exits)

    # ------------------------------------------------------------------------------- accounting
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (tied weights once). exclude_embeddings drops token and position tables."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def flops_per_token(
        self, loops_executed: float | None = None, seq_len: int | None = None, lm_heads: int = 1, backward: bool = True
    ) -> float:
        """Matmul FLOPs per token, counting only executed loops:

            F = c * [ 2 * (P_layer * J * m + d * V * heads + P_router) + 4 * J * m * d * T ]

        P_layer = 4d^2 + 2 d d_ff (attention and MLP weights of one layer), m = loops executed per token
        (mean depth; summed over passes for the shortcut objective), T = context length (the nanoGPT/PaLM
        convention for attention), heads = LM-head applications per token (2 with the shortcut pass),
        c = 3 with backward (forward + 2x backward), else 1. The conditioning tables cost O(M^2 d^2) per
        pass, not per token, and are left out."""
        c = self.cfg
        m = float(c.loops if loops_executed is None else loops_executed)
        T = c.block_size if seq_len is None else seq_len
        p_layer = 4 * c.d_model**2 + 2 * c.d_model * c.d_ff
        p_router = sum(p.numel() for p in self.router.parameters()) if self.router is not None else 0
        fwd = (
            2 * (p_layer * c.n_layers * m + c.d_model * c.vocab_size * lm_heads + p_router)
            + 4 * c.n_layers * m * c.d_model * T
        )
        return (3 if backward else 1) * fwd

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: weight decay on matrices of the blocks, modulators, Fourier MLPs and router;
        none on embeddings (tied with the LM head), norms and biases."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and not name.startswith(("wte.", "wpe.")) else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
