"""What the budget, expected and kinds recipes share: a prior q over depths, the router's defined init and the
router's own loss against q.

q is the maximum-entropy distribution over depths 1..L with mean `objective.router.target_depth` (q_l proportional
to exp(beta * l)): every depth gets mass, none more than the target forces. The defined init (the router reads
RMS-normalised h0: model.router_norm) gives fc1 unit-gain weights and fc2 weights of std INIT_STD / sqrt(hidden), so
the logits differ across tokens by about INIT_STD, and fc2's bias log q, so the batch's mean exit distribution starts
at q. The router's loss is balance_weight * KL(q || mean_tau pi_tau), a batch-level prior that gives every pi_l
(including depths no token runs) a gradient and fixes the expected compute while single tokens stay free to be
confident, plus a per-token term each recipe chooses (the budget recipe's entropy, the expected recipes' KL(pi || q)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from data_prep.configlib import ConfigError, f
from pipeline.train.recipes.base import Recipe, RouterSettings

INIT_STD = 2.0  # the spread of the router's logits across tokens at init (its fc2 weights' std x sqrt(hidden))


def depth_prior(L: int, mean: float) -> torch.Tensor:
    """The maximum-entropy distribution over depths 1..L with the given mean (1 < mean < L):
    q_l = exp(beta * l) / Z, beta found by bisection (the mean is increasing in beta). (L,) float64, on the CPU."""
    assert 1.0 < mean < L, f"target depth {mean} must lie strictly between 1 and {L}"
    depths = range(1, L + 1)

    def mean_of(beta: float) -> float:  # in Python floats: a constant of the config, no tensor is read
        w = [math.exp(beta * (k - L)) for k in depths]  # shifted by L: no overflow at beta = 50
        return sum(k * x for k, x in zip(depths, w)) / sum(w)

    lo, hi = -50.0, 50.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mean_of(mid) < mean:
            lo = mid
        else:
            hi = mid
    return torch.softmax(0.5 * (lo + hi) * torch.arange(1, L + 1, dtype=torch.float64, device="cpu"), 0)


@dataclass
class PriorSettings(RouterSettings):
    """The keys every recipe with a prior has; each adds the weight of its per-token term."""

    target_depth: float = f(
        0.0,
        "Mean depth of the prior q in (1, model.loops) (loop work = it / loops); 0 means (loops + 1) / 2. Sets the router's init and the prior its loss pulls to.",
        ge=0,
    )
    balance_weight: float = f(1.0, "Weight of KL(q || the batch's mean exit distribution).", ge=0)


def target_depth(s: RouterSettings, loops: int) -> float:
    """The prior's mean: objective.router.target_depth, or (loops + 1) / 2 when it is 0."""
    return s.target_depth or (loops + 1) / 2


class PriorRecipe(Recipe):
    """A recipe with a prior over depths (module doc): `prior` (L,) a non-persistent buffer, the defined init, and
    `prior_loss`, the router's own loss. Subclasses say which per-token term they add (`PER_TOKEN`: the name of the
    weight's key and of the logged term, `entropy` or `prior_kl`)."""

    norm = True
    PER_TOKEN: ClassVar[tuple[str, str]]  # (the settings key of its weight, the term's metric name)

    def __init__(self, settings: RouterSettings, model) -> None:
        super().__init__(settings, model)
        self.register_buffer("prior", depth_prior(model.loops, target_depth(settings, model.loops)).float(), False)

    @classmethod
    def validate(cls, s: RouterSettings, model) -> None:
        if s.target_depth != 0.0 and not 1.0 < s.target_depth < model.loops:
            raise ConfigError(
                f"objective.router.target_depth must be 0 (default) or lie strictly between 1 and model.loops "
                f"({model.loops}), got {s.target_depth}"
            )

    @classmethod
    def init_router(cls, router: nn.Module, s: RouterSettings, loops: int) -> None:
        """fc1 unit-gain, fc2 of std INIT_STD / sqrt(hidden) with bias log q (the forecast head keeps its zeros)."""
        q = depth_prior(loops, target_depth(s, loops)).float()
        with torch.no_grad():
            nn.init.normal_(router.fc1.weight, 0.0, 1.0 / math.sqrt(router.fc1.in_features))
            nn.init.zeros_(router.fc1.bias)
            nn.init.normal_(router.fc2.weight, 0.0, INIT_STD / math.sqrt(router.fc2.in_features))
            router.fc2.bias.copy_(q.log().to(router.fc2.bias))

    def prior_loss(self, r) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(balance_weight * KL(q || mean pi) + w * the per-token term, its terms by name, detached) for the router
        output r: balance_kl, entropy (mean H(pi)), prior_kl (mean KL(pi || q)), soft_depth (sum_i p(i))."""
        logp = torch.log_softmax(r.logits.float(), dim=-1).flatten(0, -2)  # (N, L)
        pi = logp.exp()
        q = self.prior.to(pi.dtype)
        terms = {
            "balance_kl": (q * (q.log() - pi.mean(0).clamp_min(1e-12).log())).sum(),
            "entropy": -(pi * logp).sum(-1).mean(),
            "prior_kl": (pi * (logp - q.log())).sum(-1).mean(),  # = -H(pi) - mean sum pi log q
        }
        key, term = self.PER_TOKEN
        loss = self.s.balance_weight * terms["balance_kl"] + getattr(self.s, key) * terms[term]
        stats = {k: v.detach() for k, v in terms.items()}
        return loss, {**stats, "soft_depth": r.cont.detach().sum(-1).mean()}
