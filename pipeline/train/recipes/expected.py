"""`expected`: the router trained on the expected loss over exits instead of through the straight-through estimator.
In training every token runs every loop and a head reads each loop's state (`LoopedLM.forward(exits=True)`); the
objective weighs each token's cross-entropy at exit d by its pi_d,

    L_exits = sum_tau sum_d pi_{tau,d} CE_{tau,d} / N        (N scored tokens)

so the router's gradient is exact and the network learns every exit in proportion to pi. The router reads
RMS-normalised h0 from the defined init and adds `balance_weight * KL(q || mean_tau pi_tau)` and
`prior_weight * mean_tau KL(pi_tau || q)`, which keeps each token's pi from collapsing onto one exit before its
answer counts (pipeline/train/recipes/prior.py). Exit d is a depth-d token only if depth d runs the pass's first d
steps (model.exit_schedule=prefix, or no conditioning): a recipe check. Validation runs the routed pass inference
runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_prep.configlib import f
from pipeline.train.recipes.base import Step, Terms
from pipeline.train.recipes.prior import PriorRecipe, PriorSettings


@dataclass
class ExpectedSettings(PriorSettings):
    prior_weight: float = f(
        0.1,
        "Weight of the mean per-token KL(exit distribution || q), which keeps each token's exit distribution from collapsing onto one exit before its answer counts.",
        ge=0,
    )


class Expected(PriorRecipe):
    name = "expected"
    Settings = ExpectedSettings
    exits = True
    PER_TOKEN = ("prior_weight", "prior_kl")
    PARTS = ("loss_router", "loss_exits")

    def exit_weights(self, step: Step) -> torch.Tensor:
        return torch.softmax(step.out.router.logits.float(), -1)  # (B, T, L) pi

    def terms(self, step: Step, ce) -> Terms:
        loss, stats = self.prior_loss(step.out.router)
        return Terms([loss], {"loss_router": loss.detach()}, stats)
