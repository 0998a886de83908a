"""`budget`: the router trained to a depth budget on text. It reads RMS-normalised h0 (model.router_norm) from the
defined init (pipeline/train/recipes/prior.py), learns through the straight-through estimator as the paper's does,
and adds its own loss: `balance_weight * KL(q || mean_tau pi_tau)`, which pulls the batch's mean exit distribution
to the prior q of mean `target_depth` (the expected compute), and `entropy_weight * mean_tau H(pi_tau)`, which makes
each token's exit distribution peaky, so that its thresholded depth (the median of pi) agrees with its expected
depth (the mean): the budget, set on the distribution, then holds for the executed depth."""

from __future__ import annotations

from dataclasses import dataclass

from data_prep.configlib import f
from pipeline.train.recipes.base import Terms
from pipeline.train.recipes.prior import PriorRecipe, PriorSettings


@dataclass
class BudgetSettings(PriorSettings):
    entropy_weight: float = f(0.1, "Weight of the mean per-token entropy of the exit distribution.", ge=0)


class Budget(PriorRecipe):
    name = "budget"
    Settings = BudgetSettings
    ste = True
    PER_TOKEN = ("entropy_weight", "entropy")
    PARTS = ("loss_router",)

    def terms(self, step, ce) -> Terms:
        loss, stats = self.prior_loss(step.out.router)
        return Terms([loss], {"loss_router": loss.detach()}, stats)
