"""The looped network's engine interface: what code outside pipeline/model may use of a model.

`LoopedLM` (looped.py) implements `LoopedNetwork`. The training objective (pipeline/train/objective.py), the
decoder with its recursion-wise KV cache (pipeline/inference/decode.py), the scorer's forward
(evaluation/forward.py) and the Hugging Face wrapper (pipeline/hf/remote.py) use these members and nothing else of
it; tests/test_interface.py checks both, so a change to the model that one of them depends on shows up as a change
to this file.

One pass of budget M over h0 = embed(idx):
    r = route(h0)                              # RouterOutput or None; r.depth(M, theta) gives each token's depth
    tables = modulation_tables(delta)          # per layer (K, 4d) or None, delta = the pass's step schedule
    h = run_loops(h0, delta, depth, cont, tables=tables, hooks=hooks)
    logits, hf = head(h)                       # final norm + LM head
Each of those loops is `loop`, the one place where a loop's arithmetic is written (modulation rows, the shared
block with its attention rule, the router's straight-through factor, the merge of tokens that ran with those that
did not). `run_loops` only chooses which states loop i sees (each row's active tokens compacted, or every token
under a mask); a caller that chooses them itself (the decoder: the rows whose new token runs loop i, attending to
that loop's cache) calls it directly:
    h = loop(h, i, M, tables, depth, attends=attends)

Hooks (`LoopHooks`): `run_loops(hooks=...)` lets a caller see and replace attention while the loops run on
the gather-scatter path: before loop i runs, `attend(i, j, order, n)` is asked for layer j's attention
function `(q, k, v) -> out` (q, k, v of shape (B, heads, Tm, d_head) over loop i's compacted active tokens,
`order` (B, Tm) their positions or None when every token is active, `n` (B,) numpy int64 the active count of
each row); `loop_done(i, n)` is called after loop i. The KV cache's prefill stores each loop's keys and values
this way; `hidden_states(mask=...)` applies a tree mask this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch
    import torch.nn as nn

    from pipeline.config import ModelConfig
    from pipeline.model.router import RouterOutput


class LoopHooks(Protocol):
    def attend(self, i: int, j: int, order: torch.Tensor | None, n: np.ndarray) -> Callable: ...

    def loop_done(self, i: int, n: np.ndarray) -> None: ...


@runtime_checkable
class LoopedNetwork(Protocol):
    cfg: ModelConfig  # the network's settings (loops L, block_size, conditioning, ...)
    wte: nn.Embedding  # (V, d) token embedding; its weight's dtype and device are the model's
    lm_head: nn.Module  # (V, d) output projection, tied to wte by default; lm_head(hf, targets, ...): fused losses
    router: nn.Module | None  # the token-choice router (None without one): fc1, fc2, hard_forecast (the recipes')
    layers: nn.Module  # the shared block (J layers, run once per loop by `loop`); its layers' attn shapes, kv()

    def embed(self, idx: torch.Tensor, pos_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """h0 (B, T, d) for tokens idx (B, T) starting at position pos_offset (an int or one per row)."""
        ...

    def route(self, h0: torch.Tensor, router: bool = True, detach: bool = False) -> RouterOutput | None:
        """The router's output for h0, or None (no router, or router=False: every token runs the budget); detach:
        the router reads sg(h0)."""
        ...

    def modulation_tables(self, delta: torch.Tensor) -> list[torch.Tensor] | None:
        """Per layer (K, 4d) modulation of every (depth, loop) pair of a pass with schedule delta (None: plain)."""
        ...

    def loop_mods(self, tables, i: int, M: int, depth: torch.Tensor | None = None, by_index: bool = True):
        """Loop i's per-layer modulation for tokens of the given depth, from `modulation_tables`."""
        ...

    def loop(
        self,
        h: torch.Tensor,
        i: int,
        M: int,
        tables: list[torch.Tensor] | None,
        depth: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        attends: list[Callable] | None = None,
        cont: torch.Tensor | None = None,
        active: torch.Tensor | None = None,
        by_index: bool = True,
    ) -> torch.Tensor:
        """Loop i of a pass of budget M on states h (N, S, d) of the given depths (N, S): causal among them, or
        under `mask` (N, 1, S, S), or through per-layer `attends`; cont (N, S) p(i) for the straight-through
        estimator; only `active` (N, S) states take the output. The states after the loop (N, S, d)."""
        ...

    def run_loops(
        self,
        h0: torch.Tensor,
        delta: torch.Tensor,
        depth: torch.Tensor | None,
        cont: torch.Tensor | None,
        tables: list[torch.Tensor] | None = None,
        hooks: LoopHooks | None = None,
        counts: np.ndarray | None = None,
        execution: str | None = None,
    ) -> torch.Tensor:
        """M = len(delta) loops from h0 (B, T, d), each token for its depth; the final states (B, T, d)."""
        ...

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, T, V), final-normed states (B, T, d)) of states h."""
        ...

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
        """One pass of budget `loops` without the head: final states (B, T, d) and depth (B, T)."""
        ...

    def __call__(self, idx: torch.Tensor, *, loops: int | None = None, **kw):
        """forward: LoopedLMOutput (logits, final-normed states, depth, the router's output; the pass with a
        `shortcut=` schedule beside it). The network's outputs only: losses are the objective's."""
        ...
