"""torch.compile applied from outside the model (`train.compile`), per execution strategy (`model.execution`):

    compact, sorted, dense   each layer of the shared block compiled once with dynamic shapes, so a loop's computed
                             length (which changes every loop and every step) does not recompile. PyTorch still
                             specialises sizes 0 and 1, so a layer holds a bounded handful of graphs (loop 1
                             uncompacted or a compacted loop; a one-row modulation table, i.e. a shortcut pass of
                             S = 1; a loop with a single active token per row) and compiles nothing new once it
                             has met them.
    bucketed                 the whole loop (the shared block `model.layers`, all J layers) compiled with static
                             shapes: the strategy's computed lengths are one of BUCKETS sizes, so it holds one graph
                             per length met, each specialised to its shape (what CUDA graphs need: `mode=
                             "reduce-overhead"`). The modulation tables' row count (one per (depth, loop) pair of the
                             pass's budget) is left dynamic, so the shortcut pass's budget adds no graphs.

The model's code stays plain eager PyTorch; this module is the only place that knows."""

from __future__ import annotations

import torch


def apply_compile(model, backend: str | object = "inductor", mode: str | None = None) -> None:
    """Compiles `model`'s shared block in place for its `cfg.execution` (module docstring): each layer with
    dynamic shapes (`nn.Module.compile`; a layer is called with x (B, Tm, d), mod, mask, attend), or, under
    bucketed, the whole block with static shapes. mode: torch.compile's mode (e.g. "reduce-overhead": CUDA
    graphs; inductor only; None: its default)."""
    kw = {} if mode is None else {"mode": mode}
    if model.cfg.execution == "bucketed":
        _compile_static_block(model.layers, backend, kw)
        return
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=True, **kw)


def _compile_static_block(block, backend, kw: dict) -> None:
    """`block.forward` (the instance's, activation checkpointing included) compiled with static shapes. Each
    call first builds the loop's one-hots of the modulation rows (`one_hot_once`, keyed by object identity,
    which a compiled region would guard on and recompile for) and marks the tables' row dimension dynamic (it
    follows the pass's budget, not the loop's length). dynamo's recompile limit is raised to hold a graph per
    bucket length of both grad modes."""
    from pipeline.model.layers import one_hot_once
    from pipeline.model.looped import BUCKETS

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * BUCKETS)
    inner = block.forward
    compiled = torch.compile(inner, backend=backend, dynamic=False, **kw)

    def forward(h, mods=None, *args, **kwargs):
        mods = one_hot_once(mods)
        for m in mods or ():
            if getattr(m, "table", None) is not None:  # a RowMod: rows of a (K, 4d) table by index
                torch._dynamo.maybe_mark_dynamic(m.table, 0)
                if m.onehot is not None:  # (B*S, K)
                    torch._dynamo.maybe_mark_dynamic(m.onehot, 1)
        return compiled(h, mods, *args, **kwargs)

    forward.tlf_checkpointed = getattr(inner, "tlf_checkpointed", False)  # pipeline/train/ac.checkpointed_mode
    block.forward = forward


def compile_count() -> int:
    """Graphs compiled so far in this process (dynamo's counter): stays flat once a run is warm."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks dynamo has taken so far in this process (its counter, summed over the reasons)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))
