"""`paper`: the paper's router training (faithful reproduction). The router is the MLP on raw h0 with the network's
default init, trained only through the straight-through estimator in the loops (each active token's loop update
scaled by 1 + p(i) - sg(p(i)): values unchanged, p(i) gets a gradient); no loss of its own and no keys. At init h0 is
tiny, so the logits barely differ across tokens and every p(i) sits near its uniform value; the estimator reaches
p(i) only for loops a token runs, so nothing raises p(L) on its own and nothing weighs depth against compute."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.train.recipes.base import Recipe, RouterSettings


@dataclass
class PaperSettings(RouterSettings):
    """The paper's recipe has no keys of its own."""


class Paper(Recipe):
    name = "paper"
    Settings = PaperSettings
    ste = True
    needs_router = False  # the default recipe: a network without a router simply has nothing to train
