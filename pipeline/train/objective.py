"""The training objective: `Objective` wraps the network (`LoopedLM`, pipeline/model) and is what DeepSpeed trains.

    loss = L_L + lambda_short * L_S + lambda_align * L_align (+ the router recipe's terms)

L_L: the cross-entropy of the full pass (M = L, uniform schedule). For shortcut variants the network also runs a
shortcut pass (S ~ U{1..L-1}, integer schedule k/L, `sample_shortcut`) from the same h0 and router output: L_S is
its cross-entropy and L_align the mean squared difference of its logits to the stop-gradient full pass's, over every
position or (align_positions=scored) those with a target. By default (`fused_loss=True`) both heads, both
cross-entropies and the alignment run fused by chunks of tokens in the network's head (`LMHead`,
pipeline/model/head_loss.py): no (B, T, V) logits are materialised or kept for backward; `fused_loss=False` is the
plain reference the tests compare with.

The router is trained by the recipe `objective.router.recipe` names (pipeline/train/recipes;
docs/router.md), which the objective calls through the `Recipe` interface and never names: the recipe says how the
network's training forward runs (the straight-through factor, the router on sg(h0), every token through every loop)
and adds its own terms. A recipe that trains exits (`Recipe.exits`) replaces L_L in training by the loss over exits:
every token runs every loop (`forward(exits=True)`), a head reads the state after each loop d, and

    L_exits = sum_tau sum_d w_{tau,d} CE_{tau,d} / N        (N scored tokens)

each exit through the fused head with the recipe's per-token weights w (`Recipe.exit_weights`: their value weighs
the network's loss, their gradient is the router's), logged `loss_exits`; `loss_L` stays the last exit's plain
cross-entropy, `routed` the statistics of the depths the router gives (the pass itself runs every token L loops,
which is what `full` and the FLOP count see). Validation (`full_only`) runs the routed pass inference runs, without
the recipe.

The result is typed (`ObjectiveOutput`): its parts' names are the training metrics' names (docs/training.md "Logging and MLflow"):
`loss`, the parts `loss_L`, `loss_S`, `loss_align` and the recipes' (`PARTS`), and per pass the `DepthStats` fields,
logged as `router/<pass>/<field>` (`router/short/loops` too; `router/routed/<field>` for exit recipes) next to the
recipe's metrics, `router/<name>`.

The wrapper holds the network as `net`, so DeepSpeed's files name its parameters `net.<name>`; checkpoints
written before the wrapper existed hold the bare names and load through `_add_prefix`. Exports store the
network alone, under its own names. The recipe's own state (the kinds table) is not in the module's state dict:
`state()` / `load_state()` carry it in each rank's training state file, so a resume on another world size keeps it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.router import DepthStats, depth_stats
from pipeline.model.schedule import sample_shortcut
from pipeline.train.recipes import RECIPES, Step, Terms, recipe_for

if TYPE_CHECKING:
    from pipeline.model.looped import LoopedLMOutput

PREFIX = "net."  # the network's parameter names inside the wrapper


@dataclass
class ShortcutStats(DepthStats):
    loops: torch.Tensor  # () the shortcut pass's number of loops S


@dataclass
class ObjectiveOutput:
    """One micro-batch's objective. Every tensor but `loss` is detached. Logged under the names of `parts` and
    `stats`."""

    loss: torch.Tensor  # () the differentiable total
    depth: torch.Tensor  # (B, T) int64 per-token depth of the full pass
    logits: torch.Tensor | None  # (B, T, V) of the full pass; None on the fused path
    full: DepthStats
    short: ShortcutStats | None = None
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss parts this objective has (PARTS names)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's, with routed/<field> (exit recipes)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's per-token outputs (B, T), not logged
    full_heads: int = 1  # LM-head applications per token of the full pass (L for exit recipes)

    # every part an objective may have, in the order they are logged: the passes', then the recipes' (registry order)
    PARTS: ClassVar[tuple[str, ...]] = tuple(
        dict.fromkeys(("loss_L", "loss_S", "loss_align", *(p for r in RECIPES.values() for p in r.PARTS)))
    )

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """{'full/mean_depth': ..., 'short/loops': ..., 'balance_kl': ...}: the statistics by name (the trainer
        logs them under `router/`)."""
        out = {f"full/{k}": v for k, v in _fields(self.full).items()}
        if self.short is not None:
            out.update({f"short/{k}": v for k, v in _fields(self.short).items()})
        return {**out, **self.metrics}

    @property
    def lm_heads(self) -> int:
        """LM-head applications per token (one more with the shortcut pass): `LoopedLM.flops_per_token`'s
        `lm_heads`."""
        return self.full_heads + (self.short is not None)

    @property
    def loops_executed(self) -> torch.Tensor:
        """() loops executed per token, both passes: `LoopedLM.flops_per_token`'s `loops_executed`."""
        return self.full.mean_depth if self.short is None else self.full.mean_depth + self.short.mean_depth


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _align_mse(a: torch.Tensor, b: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """Mean squared difference of a and b (B, T, D): over every position, or (targets given) only over those
    with a target (targets != -1)."""
    if targets is None:
        return F.mse_loss(a, b)
    keep = (targets != -1)[..., None].to(a.dtype)  # (B, T, 1)
    return ((a - b).square() * keep).sum() / (keep.sum().clamp_min(1.0) * a.shape[-1])


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)


def _add_prefix(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: a state dict written before the wrapper (DeepSpeed files of older checkpoints)
    names the network's parameters without `net.`."""
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + PREFIX)]:
        state_dict[prefix + PREFIX + k[len(prefix) :]] = state_dict.pop(k)


class Objective(nn.Module):
    """The training objective around the network `net` (module doc); cfg: the objective's settings, whose `router`
    section makes the recipe (`recipe`, a submodule: its buffers move with the objective)."""

    def __init__(self, net: nn.Module, cfg) -> None:
        super().__init__()
        self.net, self.cfg = net, cfg
        self.register_load_state_dict_pre_hook(_add_prefix)
        self.recipe = recipe_for(cfg.router, net.cfg)

    def state(self) -> dict:
        """The objective's own training state (saved in each rank's training state file): the recipe's."""
        return self.recipe.state()

    def load_state(self, state: dict, where: str) -> None:
        """`state()` of a checkpoint; where names it in the one-line error."""
        self.recipe.load_state(state, where)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        shortcut: torch.Tensor | None = None,
        *,
        full_only: bool = False,
        loops: int | None = None,
        router: bool = True,
        threshold: float | None = None,
        execution: str | None = None,
        fused_loss: bool = True,
    ) -> ObjectiveOutput:
        """idx, targets (B, T) (targets -1: ignored). shortcut: (S,) positive ints summing to L (default: drawn
        from torch's global RNG). full_only: the full pass's cross-entropy alone (validation: no shortcut pass or
        recipe; loops: its budget M, default L). router, threshold, execution: as `LoopedLM.forward` takes
        them; fused_loss=False: the losses from materialised logits (the reference of the fused heads)."""
        rec = self.recipe if (router and not full_only and self.net.router is not None) else None
        out = self.net(
            idx,
            loops=loops,
            shortcut=self._schedule(shortcut) if (self.cfg.shortcut and not full_only) else None,
            logits=not fused_loss,
            router=router,
            threshold=threshold,
            execution=execution,
            **(rec.network_args() if rec is not None else {}),
        )
        step = Step(self.net, out, idx, targets, self.net.cfg.router_threshold if threshold is None else threshold)
        exits = rec is not None and rec.exits  # the pass ran every token every loop; the loss reads every exit
        loss, parts, ce = self._pass_losses(step, rec if exits else None, fused_loss)
        terms = rec.terms(step, ce) if rec is not None else Terms()
        for term in terms.losses:
            loss = loss + term
        metrics = {**_routed(step), **terms.metrics} if exits else terms.metrics
        full, short = depth_stats(out.depth, out.loops), self._short_stats(out)
        heads = out.loops if exits else 1
        return ObjectiveOutput(
            loss, out.depth, out.logits, full, short, {**parts, **terms.parts}, metrics, terms.tokens, heads
        )

    def _pass_losses(self, step: Step, rec, fused: bool) -> tuple:
        """(loss, parts, ce): the passes' cross-entropies and alignment; with an exit recipe rec, every exit's
        cross-entropy weighted by its `exit_weights` in place of the full pass's, ce (B, T, L) each token's loss at
        every exit (detached; else None)."""
        out, targets = step.out, step.targets
        if rec is not None:
            loss, parts, ce = (self._fused_exits if fused else self._exit_losses)(out, targets, rec.exit_weights(step))
        else:
            (loss, parts), ce = (self._fused_losses(out, targets) if fused else self._losses(out, targets)), None
        if out.short is not None and not fused:  # (the fused call aligns the logits itself)
            align = self._alignment(out, targets)
            loss = loss + self.cfg.lambda_align * align
            parts["loss_align"] = align.detach()
        return loss, parts, ce

    def _fused_exits(self, out: LoopedLMOutput, targets: torch.Tensor, pi: torch.Tensor) -> tuple:
        """(loss, parts, ce): every exit's cross-entropy weighted by pi (B, T, L) through the fused head; the last exit's call
        also runs the shortcut pass's terms (`_fused_losses`). ce (B, T, L): each token's cross-entropy at every
        exit (detached, 0 where not scored)."""
        c = self.cfg
        exits = torch.zeros((), dtype=torch.float32, device=pi.device)
        rows = []
        for d, hd in enumerate(out.exits[:-1]):
            ld, _, ce = self.net.lm_head(hd, targets, None, 0.0, None, False, pi[..., d], True)
            exits = exits + ld
            rows.append(ce)
        loss, parts, ce = self._fused_losses(out, targets, pi[..., -1], rows=True)
        last = loss.detach()  # the last exit's weighted CE, less the shortcut pass's terms
        if out.short is not None:
            last = last - c.lambda_short * parts["loss_S"] - c.lambda_align * parts.get("loss_align", 0.0)
        parts["loss_exits"] = exits.detach() + last
        return exits + loss, parts, torch.stack([*rows, ce], -1)

    def _exit_losses(self, out: LoopedLMOutput, targets: torch.Tensor, pi: torch.Tensor) -> tuple:
        """(loss, parts, ce) from materialised logits (the reference of `_fused_exits`)."""
        scored = targets != -1
        ce = torch.stack(
            [
                F.cross_entropy(
                    self.net.lm_head(hd).float().flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none"
                ).view_as(targets)
                for hd in out.exits
            ],
            -1,
        )  # (B, T, L): 0 where not scored
        exits = (pi * ce).sum() / scored.sum().clamp_min(1)
        parts = {"loss_L": ce[..., -1][scored].mean().detach(), "loss_exits": exits.detach()}
        return self._add_short_ce(out, targets, exits, parts), parts, ce.detach()

    def _schedule(self, shortcut: torch.Tensor | None) -> torch.Tensor:
        """The shortcut pass's schedule (S,) of positive ints summing to L: the one given (checked) or a drawn
        one (`sample_shortcut`, torch's global RNG)."""
        L = self.net.cfg.loops
        if shortcut is None:
            return sample_shortcut(L)
        k = shortcut.numpy()  # checked on the host: no device read (a schedule is a CPU tensor; the trainer's is)
        assert k.sum() == L and (k > 0).all(), f"shortcut schedule {k.tolist()} must be positive, sum {L}"
        return shortcut

    def _fused_losses(
        self, out: LoopedLMOutput, targets: torch.Tensor, weight: torch.Tensor | None = None, rows: bool = False
    ) -> tuple:
        """(loss, parts) of both passes' cross-entropies and the alignment: one chunked call through the network's
        head, from the final-normed states (B, T, d); no (B, T, V) logits. weight (B, T): per-token weights of the
        full pass's cross-entropy (an exit recipe's last exit); rows (with weight): (loss, parts, the full pass's
        per-token cross-entropy (B, T), detached)."""
        c = self.cfg
        hs = None if out.short is None else out.short.hidden  # (B, T, d)
        scored = c.align_positions == "scored"
        loss, p, *ce = self.net.lm_head(out.hidden, targets, hs, c.lambda_short, c.lambda_align, scored, weight, rows)
        parts = {"loss_L": p[0]}
        if out.short is not None:
            parts["loss_S"], parts["loss_align"] = p[1], p[2]
        return (loss, parts, *ce)

    def _losses(self, out: LoopedLMOutput, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, parts) of both passes' cross-entropies from their materialised logits (B, T, V)."""
        loss = _ce(out.logits, targets)
        parts = {"loss_L": loss.detach()}
        return self._add_short_ce(out, targets, loss, parts), parts

    def _add_short_ce(self, out: LoopedLMOutput, targets: torch.Tensor, loss: torch.Tensor, parts: dict):
        """loss + lambda_short * the shortcut pass's cross-entropy from its materialised logits (loss as it is
        without a shortcut pass); the term goes into parts as loss_S."""
        if out.short is None:
            return loss
        loss_S = _ce(out.short.logits, targets)
        parts["loss_S"] = loss_S.detach()
        return loss + self.cfg.lambda_short * loss_S

    def _alignment(self, out: LoopedLMOutput, targets: torch.Tensor) -> torch.Tensor:
        """() the shortcut pass's mean squared difference of logits to the stop-gradient full pass's, over every
        position or (align_positions scored) those with a target."""
        scored = targets if self.cfg.align_positions == "scored" else None
        return _align_mse(out.short.logits.float(), out.logits.detach().float(), scored)

    @staticmethod
    def _short_stats(out: LoopedLMOutput) -> ShortcutStats | None:
        if out.short is None:
            return None
        S = out.short.loops
        return ShortcutStats(**_fields(depth_stats(out.short.depth, S)), loops=torch.tensor(float(S)))


def _routed(step: Step) -> dict[str, torch.Tensor]:
    """routed/<field>: the `DepthStats` of the depths the router gives, when the pass ran every token every loop."""
    return {f"routed/{k}": v for k, v in _fields(depth_stats(step.routed_depth(), step.out.loops)).items()}
