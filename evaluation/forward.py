"""The evaluation forward: final states at budget M, then the LM head only where logits are needed.

`hidden_states` is `LoopedLM.forward(idx, loops=M)` without the head (`LoopedLM.hidden_states`: the uniform
schedule 1/M, router depth clipped at M; with explicit positions and an attention mask for packed rows);
`logits_at` applies the head to chosen positions. Scoring a continuation needs logits at a few positions only,
and the head (d x 50304) is most of a small model's cost. Tests check both against `model(idx, loops=M)`.
"""

from __future__ import annotations

import torch

from pipeline.model.interface import LoopedNetwork


@torch.no_grad()
def hidden_states(
    model: LoopedNetwork,
    idx: torch.Tensor,
    loops: int,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    router: bool = True,
    threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h (B, T, d) before the final norm, depth (B, T) int64 in 1..M); positions (B, T) and mask (B, T, T) as
    in `LoopedLM.hidden_states` (None: positions 0..T-1, causal); router and threshold as `LoopedLM.forward`
    takes them (the ablations' switches)."""
    M = int(loops)
    if not 1 <= M <= model.cfg.loops:
        raise ValueError(f"loop budget {M} must lie in 1..{model.cfg.loops}")
    return model.hidden_states(idx, M, positions, mask, router=router, threshold=threshold)


@torch.no_grad()
def logits_at(model: LoopedNetwork, h: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) in fp32 for states h (..., d)."""
    return model.head(h)[0].float()
