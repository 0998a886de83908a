"""Router training recipes (`objective.router.recipe`; docs/router.md): the registry, the one place that
lists them. A new recipe is one module (a `Recipe` subclass with its `Settings`, base.py) and one `register` line
here; `Objective` (pipeline/train/objective.py) calls it through `Recipe`'s interface and never names one.

- paper: the paper's (straight-through estimator only, default init): a faithful reproduction;
- budget: defined init, a depth prior with the KL balance and entropy terms, the straight-through estimator: depth
  that follows a budget on text;
- expected: the expected loss over exits (every token runs every loop in training);
- kinds: expected plus the hard-token target gated by the router's forecast and opened by the kinds' table, the
  network's loss withheld by that table at the router's depth, the router on sg(h0): what composed on the fold task.
"""

from __future__ import annotations

from pipeline.train.recipes.base import RECIPES, Recipe, RouterSettings, Step, Terms, register
from pipeline.train.recipes.budget import Budget
from pipeline.train.recipes.expected import Expected
from pipeline.train.recipes.kinds import Kinds
from pipeline.train.recipes.paper import Paper
from pipeline.train.recipes.prior import depth_prior, target_depth

for _recipe in (Paper, Budget, Expected, Kinds):
    register(_recipe)

DEFAULT = Paper.name  # objective.router's recipe when none is set


def default_settings() -> RouterSettings:
    """The `objective.router` section of a config that sets none (the default recipe's settings)."""
    return RECIPES[DEFAULT].Settings()


def recipe_for(settings: RouterSettings, model) -> Recipe:
    """The recipe object of an `objective.router` section for a network of settings model (`ModelConfig`)."""
    return RECIPES[settings.recipe](settings, model)


def init_router(net, settings: RouterSettings) -> None:
    """Gives a freshly built network's router the recipe's initial weights (a no-op without a router)."""
    if net.router is not None:
        RECIPES[settings.recipe].init_router(net.router, settings, net.cfg.loops)


__all__ = [
    "DEFAULT",
    "RECIPES",
    "Recipe",
    "RouterSettings",
    "Step",
    "Terms",
    "default_settings",
    "depth_prior",
    "init_router",
    "recipe_for",
    "register",
    "target_depth",
]
