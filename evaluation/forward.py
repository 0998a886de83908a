"""The evaluation forward: final states at budget M, then the LM head only where logits are needed.

`hidden_states` is `LoopedLM.forward(idx, loops=M)` without the head (`LoopedLM.final_states` with the
uniform schedule 1/M, router depth clipped at M); `logits_at` applies the head to chosen
positions. Scoring a continuation needs logits at a few positions only, and the head (d x 50304) is most of a
small model's cost. A test checks both against `model(idx, loops=M).logits` and `.depth`.
"""
from __future__ import annotations

import torch

from pipeline.model.schedule import uniform


@torch.no_grad()
def hidden_states(model, idx: torch.Tensor, loops: int, router: bool = True,
                  threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h (B, T, d) before the final norm, depth (B, T) int64 in 1..M); router and threshold as
    `LoopedLM.forward` takes them (the ablations' switches)."""
    M = int(loops)
    if not 1 <= M <= model.cfg.loops:
        raise ValueError(f"loop budget {M} must lie in 1..{model.cfg.loops}")
    h0 = model.embed(idx)
    return model.final_states(h0, model.route(h0, router), uniform(M), threshold=threshold)


@torch.no_grad()
def logits_at(model, h: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) in fp32 for states h (..., d)."""
    return model.head(h)[0].float()
