"""Token-choice router: per-token depth from the initial state h0 alone.

pi = softmax(MLP(h0)) over the training maximum L depths; continue probability p(i) = sum_{l>=i} pi_l,
so p(1) = 1. With budget M <= L and threshold theta, token depth m = max{i <= M : p(i) > theta} >= 1, and
the active sets A_i = {tau : m_tau >= i} are nested. The MLP (d -> d/4 -> L, GELU) reads h0 as it is or, with
model.router_norm, RMS-normalised; with model.router_forecast it also has a head on its hidden features that
forecasts whether a token is hard at each exit, which the forward pass, decoding included, never runs (the kinds
recipe trains and reads it). How the router is trained (its init, its losses, the straight-through estimator) is
the training objective's recipe (pipeline/train/recipes). The router also owns the statistics of a depth map
(`depth_stats`).
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
    features: torch.Tensor | None = None  # (B, T, hidden) the router's hidden features (its forecast reads them)

    def depth(self, M: int, threshold: float) -> torch.Tensor:
        """(B, T) int64 depth in 1..M: 1 + #{2 <= i <= M : p(i) > theta} (= max{i <= M : p(i) > theta})."""
        return 1 + (self.cont[..., 1:M] > threshold).sum(-1)


@dataclass
class DepthStats:
    """Statistics of one pass's depth map (detached, on the device; the field names are the logged metrics'
    names, docs/training.md "Logging and MLflow")."""

    depth_hist: torch.Tensor  # (M,) share of tokens at each depth 1..M
    mean_depth: torch.Tensor  # () loops executed per token
    active_tokens: torch.Tensor  # () sum_i |A_i|
    compute_ratio: torch.Tensor  # () sum_i |A_i| / (M * B * T), the fraction of dense loop work executed


def depth_stats(depth: torch.Tensor, M: int) -> DepthStats:
    """The `DepthStats` of a depth map (B, T) with values 1..M."""
    d = depth.detach().reshape(-1)
    n = d.numel()
    hist = (d[:, None] == torch.arange(1, M + 1, device=d.device)).sum(0).float() / max(n, 1)  # bincount syncs on GPUs
    active = d.sum().float()
    return DepthStats(hist, active / max(n, 1), active, active / max(M * n, 1))


class Router(nn.Module):
    """2-layer MLP d -> hidden -> L on h0 (B, T, d), RMS-normalised first with norm; returns RouterOutput. forecast:
    the hard-token forecast head (`hard_forecast`), zero at init (every forecast 1/2)."""

    def __init__(self, d: int, hidden: int, max_loops: int, norm: bool = False, forecast: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, max_loops)
        self.forecast = nn.Linear(hidden, max_loops - 1) if forecast else None  # P(hard at exit d), d < L
        self.norm = norm

    def forward(self, h0: torch.Tensor) -> RouterOutput:
        x = h0
        if self.norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        z = F.gelu(self.fc1(x))  # (B, T, hidden)
        logits = self.fc2(z)  # (B, T, L)
        pi = torch.softmax(logits.float(), dim=-1)
        # p(i) = sum_{l >= i} pi_l: reverse cumulative sum; p(1) is 1 by definition (set exactly). The suffix
        # sums are non-increasing in floating point too (each adds a term >= 0), but p(2) can round above 1
        # when pi_1 is tiny: capped, so p is non-increasing from p(1) on.
        cont = pi.flip(-1).cumsum(-1).flip(-1)
        cont = torch.cat([torch.ones_like(cont[..., :1]), cont[..., 1:].clamp_max(1.0)], dim=-1)
        return RouterOutput(logits=logits, cont=cont, features=z)

    def hard_forecast(self, r: RouterOutput) -> torch.Tensor:
        """(B, T, L-1) logits of the probability that each token is hard at exit d < L (model.router_forecast), from
        r's hidden features without shaping them (the router's hidden layer serves its depths)."""
        return self.forecast(r.features.detach())
