"""Token-choice router (DESIGN §1): per-token depth from the initial state h0 alone.

pi = softmax(MLP(h0)) over the training maximum L depths; continue probability p(i) = sum_{l>=i} pi_l,
so p(1) = 1. With budget M <= L and threshold theta, token depth m = max{i <= M : p(i) > theta} >= 1, and
the active sets A_i = {tau : m_tau >= i} are nested. The router owns its statistics (`RouterOutput.stats`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RouterOutput:
    logits: torch.Tensor  # (B, T, L) router logits
    cont: torch.Tensor  # (B, T, L) continue probabilities p(i), p(1) == 1 exactly (float32)

    def depth(self, M: int, threshold: float) -> torch.Tensor:
        """(B, T) int64 depth in 1..M: 1 + #{2 <= i <= M : p(i) > theta} (= max{i <= M : p(i) > theta})."""
        return 1 + (self.cont[..., 1:M] > threshold).sum(-1)


def depth_stats(depth: torch.Tensor, M: int) -> dict[str, torch.Tensor]:
    """Statistics of a depth map (B, T) with values 1..M (detached):
    depth_hist (M,) share of tokens at each depth 1..M; mean_depth (); active_tokens () = sum_i |A_i|;
    compute_ratio () = sum_i |A_i| / (M * B * T), the fraction of dense loop work executed.
    """
    d = depth.detach().reshape(-1)
    n = d.numel()
    hist = (d[:, None] == torch.arange(1, M + 1, device=d.device)).sum(0).float() / max(n, 1)  # no bincount: it syncs on GPUs
    active = d.sum().float()
    return {"depth_hist": hist, "mean_depth": active / max(n, 1), "active_tokens": active,
            "compute_ratio": active / max(M * n, 1)}


class Router(nn.Module):
    """2-layer MLP d -> hidden -> L on h0 (B, T, d); returns RouterOutput."""

    def __init__(self, d: int, hidden: int, max_loops: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, max_loops)

    def forward(self, h0: torch.Tensor) -> RouterOutput:
        logits = self.fc2(F.gelu(self.fc1(h0)))  # (B, T, L)
        pi = torch.softmax(logits.float(), dim=-1)
        # p(i) = sum_{l >= i} pi_l: reverse cumulative sum; p(1) is 1 by definition (set exactly).
        cont = pi.flip(-1).cumsum(-1).flip(-1)
        cont = torch.cat([torch.ones_like(cont[..., :1]), cont[..., 1:]], dim=-1)
        return RouterOutput(logits=logits, cont=cont)
