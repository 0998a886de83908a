"""What a router training recipe is: the interface `Objective` (pipeline/train/objective.py) calls, its settings'
base and the registry's dict.

A recipe is one way of training the token-choice router, chosen by `objective.router.recipe`; the other keys of the
`objective.router` section are that recipe's own settings (its `Settings` dataclass, fields made with `f(...)` like
every config field). The objective asks a recipe, and nothing else of it:

- how the network's training forward runs (`network_args`: the straight-through factor `ste`, every token through
  every loop `exits`, the router on sg(h0) `detach`);
- with `exits`, the weights of each exit's cross-entropy (`exit_weights`: their value weighs the network's loss,
  their gradient is the router's);
- the terms it adds to the objective and what it logs (`terms`: losses added in order, loss parts, metrics,
  per-token outputs);
- its own training state (`state` / `load_state`, saved in each rank's training state file).

A recipe also checks its settings against the network's (`validate`, one-line `ConfigError`s) and may define the
router's initial weights (`init_router`, which the trainer applies to a network it builds). This package imports
nothing of pipeline: pipeline/config.py reads the recipes' settings through the registry, and the network is only
what the objective hands over (`Step.net`, a `pipeline.model.interface.LoopedNetwork`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from data_prep.configlib import ConfigError, f

RECIPES: dict[str, type["Recipe"]] = {}  # name -> recipe class, filled by `register` (pipeline/train/recipes)


def register(cls: type["Recipe"]) -> type["Recipe"]:
    """Adds a recipe class to the registry under its `name` (a new recipe: one module and one `register` call)."""
    if cls.name in RECIPES and RECIPES[cls.name] is not cls:
        raise ValueError(f"router recipe {cls.name!r} is registered twice")
    RECIPES[cls.name] = cls
    return cls


@dataclass
class RouterSettings:
    """The `objective.router` section: the recipe's name, then that recipe's own keys (a subclass per recipe).
    Setting `recipe` starts the section over as that recipe's settings, its keys at their defaults."""

    recipe: str = f("paper", "The router's training recipe; the section's other keys are that recipe's own.")

    CHOICE: ClassVar[str] = "recipe"  # data_prep.configlib: the key that chooses the section's class

    @classmethod
    def choices(cls) -> dict[str, type]:
        """{recipe name: its settings class}, in registration order."""
        return {name: r.Settings for name, r in RECIPES.items()}

    def validate(self, model) -> None:
        RECIPES[self.recipe].check(self, model)


@dataclass
class Step:
    """One training forward as a recipe sees it: the network (`LoopedNetwork`), its output (`LoopedLMOutput`), the
    input tokens idx (B, T), the targets (B, T) (-1: not scored) and the router's threshold theta. `notes` carries
    what `exit_weights` found to `terms` within the one forward."""

    net: Any
    out: Any
    idx: torch.Tensor
    targets: torch.Tensor
    theta: float
    notes: dict = field(default_factory=dict)

    @property
    def scored(self) -> torch.Tensor:
        return self.targets != -1  # (B, T) bool

    def routed_depth(self) -> torch.Tensor:
        """(B, T) int64: the depth the router gives each token (what inference runs), whatever the pass ran."""
        if "routed_depth" not in self.notes:
            self.notes["routed_depth"] = self.out.router.depth(self.out.loops, self.theta)
        return self.notes["routed_depth"]


@dataclass
class Terms:
    """What a recipe adds to one training forward: `losses` added to the objective in this order, the loss `parts`
    they log (detached; names in the recipe's `PARTS`), `metrics` (detached; logged as router/<name>) and
    per-token outputs `tokens` (B, T), not logged."""

    losses: list[torch.Tensor] = field(default_factory=list)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)


class Recipe(nn.Module):
    """A router training recipe (module doc). Subclasses set `name`, `Settings` and the class flags below, and
    override what they change. As a module it holds the recipe's buffers (its prior, its tables): they move with
    the objective and are not part of its state dict (`state` carries what must survive a resume)."""

    name: ClassVar[str]
    Settings: ClassVar[type[RouterSettings]]
    ste: ClassVar[bool] = False  # the loops scale each update by the straight-through factor 1 + p(i) - sg(p(i))
    exits: ClassVar[bool] = False  # training runs every token through every loop; `exit_weights` weighs the exits
    detach: ClassVar[bool] = False  # the router reads sg(h0) in training
    forecast: ClassVar[bool] = False  # trains and reads the router's forecast head (model.router_forecast)
    norm: ClassVar[bool] = False  # needs model.router_norm (its init assumes unit-RMS input)
    needs_router: ClassVar[bool] = True  # refused on a network without a router
    PARTS: ClassVar[tuple[str, ...]] = ()  # the loss parts its `terms` (and, with exits, the objective) report

    def __init__(self, settings: RouterSettings, model) -> None:
        super().__init__()
        self.s = settings

    @classmethod
    def check(cls, s: RouterSettings, model) -> None:
        """The cross-checks every recipe shares (a router, its input norm, the forecast head, exits that are
        depths), then the recipe's own `validate`."""
        key = f"objective.router.recipe={cls.name}"
        if cls.needs_router and not model.router:
            raise ConfigError(f"{key} needs a router (model.router=true)")
        if cls.norm and not model.router_norm:
            raise ConfigError(f"{key} needs model.router_norm=true: its router init assumes unit-RMS h0")
        if model.router_forecast != cls.forecast:
            trains = [n for n, r in RECIPES.items() if r.forecast]
            want = "needs model.router_forecast=true" if cls.forecast else "does not train the forecast head"
            raise ConfigError(
                f"{key} {want} (model.router_forecast={str(model.router_forecast).lower()}; recipes that train it: "
                f"{', '.join(trains) or 'none'})"
            )
        if cls.exits and model.conditioning != "none" and model.exit_schedule != "prefix":
            raise ConfigError(
                f"{key} needs model.exit_schedule=prefix: it trains the exit after loop d of the full pass, which is "
                "a depth-d token only when depth d runs the pass's first d steps"
            )
        cls.validate(s, model)

    @classmethod
    def validate(cls, s: RouterSettings, model) -> None:
        """The recipe's own checks of its settings against the network's (model: `ModelConfig`)."""

    @classmethod
    def init_router(cls, router: nn.Module, s: RouterSettings, loops: int) -> None:
        """The router's initial weights under this recipe (default: the network's own init)."""

    def network_args(self) -> dict:
        """The keyword arguments of the network's training forward (`LoopedLM.forward`)."""
        return {"ste": self.ste, "exits": self.exits, "detach": self.detach}

    def exit_weights(self, step: Step) -> torch.Tensor:
        """exits recipes: (B, T, L) per-token weights of each exit's cross-entropy: their value weighs the
        network's loss, their gradient reaches the router."""
        raise NotImplementedError(f"router recipe {self.name!r} trains no exits")

    def terms(self, step: Step, ce: torch.Tensor | None) -> Terms:
        """What the recipe adds to the objective; ce (B, T, L): each exit's per-token cross-entropy (detached,
        0 where not scored), exits recipes only (None otherwise)."""
        return Terms()

    def state(self) -> dict:
        """The recipe's training state (saved in each rank's training state file)."""
        return {}

    def load_state(self, state: dict, where: str) -> None:
        """`state()` of a checkpoint; where names it in a one-line error (ValueError)."""
