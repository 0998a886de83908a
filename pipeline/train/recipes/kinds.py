"""`kinds`: the recipe that composed on the fold task (5 of 6 seeds; docs/research/router.md R14, bench/README
`## depth_need`): the expected recipe (every exit trained, the router on the expected loss over exits with its
prior) plus

- a hard-token target for the router: a scored token is hard at exit d when its loss there exceeds HARD_RATIO
  times the mean loss of the answers exit d gives (the scored tokens the router runs at depth d; the batch's where
  it runs none), losses bounded at chance, ln V, first (an exit never trained on some answers can score them far
  above chance); the router learns, with weight `hard_weight`, each token's first exit where it is not hard (the
  last if none). The expected loss's gradient compares exits, so it is blind while two exits are equally wrong;
  this target sends a token that a shallow exit answers far worse than the average deeper first;
- the router's forecast of those labels (model.router_forecast: a head on the router's hidden features, trained on
  them, `loss_forecast`), which gates the target: it acts on a token only where the forecast that it is hard at
  every exit before its target exceeds `hard_gate`, so only kinds of token that are nearly always hard go deeper,
  not the not-yet-learnt part of a kind being learnt;
- a table of kinds: a kind is the (input token, position) pair at the position that predicts a target, in bucket
  (position x vocab + token) mod KIND_BUCKETS; the table keeps each kind's running hard rate at exits 1..L-1
  (KIND_DECAY per batch that holds it), 1 for a kind never scored. The network learns each answer only at the exit
  of the depth the router gives it (exit weight 1 there, 0 elsewhere; the router's gradient stays the expected
  loss's), and not at all while the answer's kind has a hard rate above `withhold` at that exit and the router runs
  it short of the last loop (logged router/withheld): a new kind that is always hard waits from its first step,
  while the router catches up, instead of being learnt at a shallow exit. Where a kind's rate exceeds `withhold`
  the forecast's gate opens too, so what waits is also sent deeper;
- the router reads sg(h0): its losses and the gradient of the depths it gives train the router alone, not the
  embeddings the network shares.

The sub-choices that composed are fixed here, not settings: the constants below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from data_prep.configlib import f
from pipeline.train.recipes.base import Step, Terms
from pipeline.train.recipes.expected import Expected, ExpectedSettings

HARD_RATIO = 1.5  # a token is hard at an exit when its loss there exceeds this multiple of its answers' mean there
KIND_BUCKETS = 4093  # buckets of the (token, position) kinds (a prime: spread evenly)
KIND_DECAY = 0.9  # a kind's rate moves to decay x rate + (1 - decay) x the batch's mean hard label of that kind


@dataclass
class KindsSettings(ExpectedSettings):
    hard_weight: float = f(1.0, "Weight of the router's hard-token target.", gt=0)
    hard_gate: float = f(
        0.9,
        "tau in (0, 1): the hard-token target acts on a token only where the router's forecast that it is hard exceeds tau (or its kind's rate exceeds `withhold`).",
        gt=0,
        lt=1,
    )
    withhold: float = f(
        0.8,
        "g in (0, 1): an answer the router runs short of the last loop is withheld from the network while its kind's running hard rate at its routed exit exceeds g.",
        gt=0,
        lt=1,
    )


def hard_labels(ce: torch.Tensor, scored: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """(B, T, L) bool: whether each scored token is hard at exit d, its loss there above HARD_RATIO times the mean
    loss of the answers exit d gives. ce (B, T, L) each token's loss at every exit (detached, 0 where not scored),
    scored (B, T) bool, answers (B, T, L) bool the scored tokens the router runs at each depth (an exit that runs
    none compares with the batch's scored tokens). The mean is the rank's batch: no host read, no collective."""
    mean = ce.sum((0, 1)) / scored.sum().clamp_min(1)  # (L,) the batch's mean loss at each exit
    n = answers.sum((0, 1))  # (L,)
    mean = torch.where(n > 0, (ce * answers).sum((0, 1)) / n.clamp_min(1), mean)
    return (ce > HARD_RATIO * mean) & scored[..., None]


def hard_target(hard: torch.Tensor, scored: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target (B, T) int64, the exit index 0..L-1 of each token's first exit where it is not hard, L-1 if none;
    keep (B, T) bool, the scored tokens that have a target: none where an exit before it is hard with its gate
    (B, T, L-1) shut)."""
    easy = ~hard
    easy[..., -1] = True  # exit L if no exit is easy
    target = easy.to(torch.uint8).argmax(-1)  # (B, T) the first easy exit (argmax: the first)
    shut = F.pad(hard[..., :-1] & ~gate, (0, 1), value=True)  # (B, T, L); exit L stands for "none"
    return target, scored & (shut.to(torch.uint8).argmax(-1) >= target)


def hard_loss(logits: torch.Tensor, hard: torch.Tensor, scored: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """() the mean over the scored tokens that have a target (`hard_target`) of -log pi there; logits (B, T, L)
    the router's."""
    target, keep = hard_target(hard, scored, gate)
    keep = keep.float()
    nll = -torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None])[..., 0]  # (B, T)
    return (nll * keep).sum() / keep.sum().clamp_min(1.0)


class KindRates(nn.Module):
    """Each kind's running hard rate at exits 1..L-1, rate (K, L-1) (a non-persistent buffer: it moves with the
    module and is saved in the training state, not the weights), 1 where a kind was never scored. After each
    training micro-batch every kind it scores moves to decay x rate + (1 - decay) x the mean of its tokens' hard
    labels (sums over every rank's micro-batch: each rank keeps the same table)."""

    def __init__(self, buckets: int, loops: int, vocab: int, decay: float) -> None:
        super().__init__()
        self.vocab, self.decay = vocab, decay
        self.register_buffer("rate", torch.ones(buckets, loops - 1), persistent=False)

    def kinds(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) int64: the bucket of each position's (token, position) kind; idx (B, T) the input tokens."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        return (pos * self.vocab + idx.long()) % self.rate.shape[0]

    @torch.no_grad()
    def update(self, kinds: torch.Tensor, hard: torch.Tensor, scored: torch.Tensor) -> None:
        """One batch: kinds (B, T), hard (B, T, L) bool (`hard_labels`), scored (B, T) bool."""
        k, w = kinds.flatten(), scored.flatten().to(self.rate.dtype)  # (B T,): 1 where scored (no boolean index:
        # no host sync, and the plan traces it on meta tensors)
        hits = hard[..., :-1].flatten(0, 1).to(self.rate.dtype) * w[:, None]  # (B T, L-1)
        sums = torch.zeros_like(self.rate).index_add_(0, k, hits)  # (K, L-1) counts of 0/1: exact
        count = torch.zeros_like(self.rate[:, 0]).index_add_(0, k, w)  # (K,)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            both = torch.cat([sums, count[:, None]], 1)
            torch.distributed.all_reduce(both)  # integer-valued floats: the same sum in any order
            sums, count = both[:, :-1], both[:, -1]
        seen = (count > 0)[:, None]
        mean = sums / count.clamp_min(1)[:, None]
        self.rate.copy_(torch.where(seen, self.decay * self.rate + (1 - self.decay) * mean, self.rate))


class Kinds(Expected):
    name = "kinds"
    Settings = KindsSettings
    detach = True
    forecast = True
    PARTS = ("loss_router", "loss_exits", "loss_hard", "loss_forecast")

    def __init__(self, settings: KindsSettings, model) -> None:
        super().__init__(settings, model)
        self.table = KindRates(KIND_BUCKETS, model.loops, model.vocab_size, KIND_DECAY)

    def exit_weights(self, step: Step) -> torch.Tensor:
        """1 at the exit of the routed depth, 0 elsewhere and for an answer that waits; gradient pi's. Reads the
        hard labels from each exit's per-token loss in a head pass without gradients, and moves the table."""
        out, routed, scored = step.out, step.routed_depth(), step.scored
        pi = torch.softmax(out.router.logits.float(), -1)  # (B, T, L)
        rows = torch.stack([step.net.lm_head(h, step.targets, rows=True) for h in out.exits], -1)  # (B, T, L)
        hard, gate, fit = self._labels(step, rows)
        kinds = self.table.kinds(step.idx)  # (B, T)
        rate = self.table.rate[kinds]  # (B, T, L-1) the rates before this batch
        d = (routed - 1).clamp(max=out.loops - 2)[..., None]  # (B, T, 1) the routed exit of 1..L-1 (L never waits)
        wait = scored & (routed < out.loops) & (rate.gather(-1, d)[..., 0] > self.s.withhold)
        self.table.update(kinds, hard, scored)
        step.notes.update(hard=hard, gate=gate | (rate > self.s.withhold), fit=fit, wait=wait)
        at = F.one_hot(routed - 1, out.loops).to(pi.dtype) * ~wait[..., None]  # (B, T, L)
        return at + pi - pi.detach()

    def _labels(self, step: Step, ce: torch.Tensor) -> tuple:
        """(hard (B, T, L) bool, gate (B, T, L-1) bool, fit ()): the hard labels from each exit's per-token loss ce
        (B, T, L), bounded at chance, against the answers each exit gives; where the router's forecast (detached)
        exceeds hard_gate; the forecast's loss (binary cross-entropy to the labels over the scored tokens, exits
        1..L-1)."""
        scored, L = step.scored, ce.shape[-1]
        ce = ce.clamp_max(math.log(step.net.cfg.vocab_size))  # losses past chance count as chance
        answers = F.one_hot(step.routed_depth() - 1, L).bool() & scored[..., None]
        hard = hard_labels(ce, scored, answers)  # (B, T, L)
        fc = step.net.router.hard_forecast(step.out.router).float()  # (B, T, L-1) logits
        bce = F.binary_cross_entropy_with_logits(fc, hard[..., :-1].float(), reduction="none").mean(-1)
        fit = (bce * scored).sum() / scored.sum().clamp_min(1)
        return hard, torch.sigmoid(fc.detach()) > self.s.hard_gate, fit

    def terms(self, step: Step, ce) -> Terms:
        """The forecast's loss and the weighted hard-token target (added first), then the prior's loss."""
        n, scored = step.notes, step.scored
        term = hard_loss(step.out.router.logits, n["hard"], scored, n["gate"])
        target = torch.zeros((), dtype=torch.float32, device=term.device) + n["fit"] + self.s.hard_weight * term
        prior, stats = self.prior_loss(step.out.router)
        parts = {"loss_router": prior.detach(), "loss_hard": term.detach(), "loss_forecast": n["fit"].detach()}
        stats["withheld"] = n["wait"].sum() / scored.sum().clamp_min(1)
        learnt = torch.where(scored & ~n["wait"], step.routed_depth(), 0)  # the exit each answer was learnt at
        return Terms([target, prior], parts, stats, {"learnt_exit": learnt})

    def state(self) -> dict:
        return {"kind_rate": self.table.rate.detach().cpu().clone()}

    def load_state(self, state: dict, where: str) -> None:
        want = tuple(self.table.rate.shape)
        got = tuple(state["kind_rate"].shape) if "kind_rate" in state else "none"
        if got != want:
            raise ValueError(
                f"{where}: its kind table is {got}, the kinds recipe needs {want} ({KIND_BUCKETS} buckets x (loops - 1))"
            )
        self.table.rate.copy_(state["kind_rate"])
