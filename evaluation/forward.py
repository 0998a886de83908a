"""The evaluation forward: final states at budget M, then the LM head only where logits are needed.

`hidden_states` is `LoopedLM.forward(idx, loops=M)` without the head (`LoopedLM.hidden_states`: the uniform
schedule 1/M, router depth clipped at M; with explicit positions and an attention mask for packed rows);
`logits_at` applies the head to chosen positions. Scoring a continuation needs logits at a few positions only,
and the head (d x 50304) is most of a small model's cost. `nll_at` is each position's cross-entropy, the head
applied a chunk of rows at a time (the training head's `rows_per_chunk`): perplexity never holds the (P, V) logits
of every scored position, whose fresh allocation of hundreds of MB per batch (page faults) cost more than the
head's arithmetic on CPU. Tests check them against `model(idx, loops=M)`.
"""

from __future__ import annotations

import torch

from pipeline.model.head_loss import rows_per_chunk
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


@torch.no_grad()
def nll_at(model: LoopedNetwork, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (P,) fp32 of states h (P, d) against targets (P,) int64, `logits_at` a chunk of rows at a
    time."""
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    chunk = rows_per_chunk(model.cfg.vocab_size, h.device.type)
    for a in range(0, h.shape[0], chunk):
        lg = logits_at(model, h[a : a + chunk])  # (c, V)
        out[a : a + chunk] = torch.logsumexp(lg, -1) - lg.gather(-1, targets[a : a + chunk, None])[:, 0]
    return out
