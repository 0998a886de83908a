"""Token-choice router: per-token depth from the initial state h0 alone.

pi = softmax(MLP(h0)) over the training maximum L depths; continue probability p(i) = sum_{l>=i} pi_l,
so p(1) = 1. With budget M <= L and threshold theta, token depth m = max{i <= M : p(i) > theta} >= 1, and
the active sets A_i = {tau : m_tau >= i} are nested. The router owns the statistics of a depth map
(`depth_stats`) and the terms of its auxiliary loss (`Router.aux_loss`); the training objective weighs them.

Two training recipes (`model.router_recipe`):

- `paper`: the MLP on raw h0 with the model's default init, trained only through the straight-through
  estimator in the loops (no loss of its own). At init h0 is tiny, so the logits barely differ across tokens
  and every p(i) sits near its uniform value; the STE reaches p(i) only for loops a token runs, so nothing
  ever raises p(L) on its own and nothing weighs depth against compute.
- `budget`: the router (a) reads RMS-normalised h0 and starts from a defined init: fc1 with unit-gain
  weights, fc2 with weights of std `model.router_init_std / sqrt(hidden)` (so logits differ across tokens by about
  that much) and bias log q, where q is the depth prior below; (b) adds to the training objective
  `objective.router_balance_weight * KL(q || mean_tau pi_tau)`, a batch-level prior over depths: the batch's mean exit
  distribution is pulled to q, which gives every pi_l (including depths no token runs) a gradient and fixes
  the expected compute, while single tokens stay free to be confident (depth stays token-dependent); and
  (c) `objective.router_entropy_weight * mean_tau H(pi_tau)`, which makes each token's exit distribution peaky so that
  its thresholded depth (the median of pi) agrees with its expected depth (the mean): the budget, set on
  the distribution, then holds for the executed depth. q is the maximum-entropy distribution over 1..L with
  mean `model.router_target_depth` (q_l proportional to exp(beta * l)): every depth gets mass, none more than the
  target forces.
- `expected`: the budget recipe's router (normalised h0, defined init, prior q), trained on the expected loss over
  exits instead of through the straight-through estimator. In training every token runs every loop and a head
  reads each loop's state; the objective weighs each token's cross-entropy at exit d by its pi_d, sum_d pi_d CE_d,
  so the router's gradient is exact and the network learns every exit in proportion to pi. To that the router
  adds the balance term above and `objective.router_prior_weight * mean_tau KL(pi_tau || q)`, which keeps each
  token's pi from collapsing onto one exit before its answer counts (in place of the entropy term, which would
  cancel it). Exit d is a depth-d token only if depth d runs the pass's first d steps
  (`model.exit_schedule=prefix`, or no conditioning): the config requires it. With
  `objective.router_hard_weight` > 0 the router also learns a target of its own (`Router.hard_loss`): each scored
  token's first exit where its loss is at most `objective.router_hard_ratio` times the batch's mean loss there
  (exit L if none). The expected loss's gradient compares exits, so it is blind while two exits are equally
  wrong; this target sends a token that a shallow exit answers far worse than the batch's average deeper before
  the deeper exit answers it better. With `model.router_forecast` and `objective.router_hard_gate` = tau > 0 the
  router also forecasts, from its hidden features, whether a token is hard at each exit (trained on those labels),
  and the target acts only where that forecast exceeds tau: a kind of token that is nearly always hard, not the
  not-yet-learnt part of a kind the network is learning. With `objective.router_exit_weights=depth_label` the
  same target (ungated) also withholds the network's loss on a token whose target lies deeper than the depth the
  router gives it (`Router.hard_target`), so the network never learns, at a shallower exit, an answer the router
  has not yet sent deeper.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RouterOutput:
    logits: torch.Tensor  # (B, T, L) router logits
    cont: torch.Tensor  # (B, T, L) continue probabilities p(i), p(1) == 1 exactly (float32)
    drawn: torch.Tensor | None = None  # (B, T) int64 exploration depths in 0..L (0: the router's own), or None
    deeper: torch.Tensor | None = None  # (B, T) bool: explored one loop past the router's own depth, or None
    features: torch.Tensor | None = None  # (B, T, hidden) the router's hidden features (its forecast reads them)

    def depth(self, M: int, threshold: float) -> torch.Tensor:
        """(B, T) int64 depth in 1..M: 1 + #{2 <= i <= M : p(i) > theta} (= max{i <= M : p(i) > theta}); a token
        with an exploration depth (`Router.explore`) runs that depth instead, clipped at M, and a token explored
        deeper runs one loop more than its own, clipped at M."""
        d = 1 + (self.cont[..., 1:M] > threshold).sum(-1)
        if self.drawn is not None:
            d = torch.where(self.drawn > 0, self.drawn.clamp(max=M), d)
        if self.deeper is not None:
            d = torch.where(self.deeper, (d + 1).clamp(max=M), d)
        return d

    @functools.cached_property
    def log_cont(self) -> torch.Tensor:
        """(B, T, L) log p(i), from the logits in log space (finite where p(i) underflows to 0; log p(1) = 0).
        Computed once per router output: both passes of a forward share it."""
        lc = torch.log_softmax(self.logits.float(), -1).flip(-1).logcumsumexp(-1).flip(-1)
        return torch.cat([torch.zeros_like(lc[..., :1]), lc[..., 1:].clamp_max(0.0)], dim=-1)


@dataclass
class DepthStats:
    """Statistics of one pass's depth map (detached, on the device; the field names are the logged metrics'
    names, README "Logging")."""

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


@dataclass
class RouterLossStats:
    """The budget and expected recipes' loss terms (detached; logged under their field names)."""

    balance_kl: torch.Tensor  # () KL(q || batch-mean exit distribution)
    entropy: torch.Tensor  # () mean per-token entropy of the exit distribution
    prior_kl: torch.Tensor  # () mean per-token KL(exit distribution || q)
    soft_depth: torch.Tensor  # () the batch's expected depth sum_i p(i)


def depth_prior(L: int, mean: float) -> torch.Tensor:
    """The maximum-entropy distribution over depths 1..L with the given mean (1 < mean < L):
    q_l = exp(beta * l) / Z, beta found by bisection (the mean is increasing in beta). (L,) float64."""
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
    return torch.softmax(0.5 * (lo + hi) * torch.arange(1, L + 1, dtype=torch.float64), 0)


class Router(nn.Module):
    """2-layer MLP d -> hidden -> L on h0 (B, T, d); returns RouterOutput. recipe: 'paper', 'budget' or
    'expected' (module doc); the budget and expected recipes normalise h0 and own a prior over depths (`prior`,
    a buffer) whose mean is `target_depth`."""

    def __init__(
        self,
        d: int,
        hidden: int,
        max_loops: int,
        recipe: str = "paper",
        target_depth: float = 0.0,
        init_std: float = 2.0,
        forecast: bool = False,
    ):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, max_loops)
        # model.router_forecast: P(hard at exit d), d < L, from the router's hidden features (`hard_forecast`)
        self.forecast = nn.Linear(hidden, max_loops - 1) if forecast else None
        self.recipe = recipe
        self.init_std = init_std
        self.has_prior = recipe in ("budget", "expected")  # the budget router: normalised h0, defined init, prior
        if self.has_prior:
            self.target_depth = target_depth or (max_loops + 1) / 2  # 0: the middle of 1..L
            self.register_buffer("prior", depth_prior(max_loops, self.target_depth).float(), persistent=False)

    def reset_parameters(self) -> None:
        """The budget router's defined init (module doc); the paper recipe keeps the model's default init."""
        if not self.has_prior:
            return
        with torch.no_grad():
            nn.init.normal_(self.fc1.weight, 0.0, 1.0 / math.sqrt(self.fc1.in_features))
            nn.init.zeros_(self.fc1.bias)
            nn.init.normal_(self.fc2.weight, 0.0, self.init_std / math.sqrt(self.fc2.in_features))
            self.fc2.bias.copy_(self.prior.log())
            if self.forecast is not None:  # every forecast 1/2 at init: below any gate
                nn.init.zeros_(self.forecast.weight)
                nn.init.zeros_(self.forecast.bias)

    def forward(self, h0: torch.Tensor) -> RouterOutput:
        x = h0
        if self.has_prior:
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

    def explore(self, r: RouterOutput, share: float, span: int = 1, draw: str = "prior") -> RouterOutput:
        """r with exploration depths (`objective.router_explore`): each token, with probability `share`, runs a
        depth drawn from the prior q (budget recipe; the paper recipe, which has none, from the uniform
        distribution over 1..L) instead of its thresholded one. A token drawn past its exit runs loops it
        would skip, so the straight-through estimator tells its p(i) whether those loops lower the loss:
        without it a token that exits early never learns that it should go deeper. One uniform draw per
        token from torch's global RNG (checkpointed: resume stays exact): u < share picks the token, and
        u / share, uniform in [0, 1) then, picks its depth by q's cumulative sums. span > 1
        (`objective.router_explore_span`): one draw per window of `span` consecutive positions (windows start at
        each row's position 0), so the tokens of a window explore together, at one depth: a token and the
        context it reads run the extra loops side by side. span = 1 draws exactly what it always drew.
        draw = "next" (`objective.router_explore_draw`): an explored token runs one loop past its own depth
        instead (clipped at the budget), never fewer loops than the router gives it."""
        assert draw in ("prior", "next"), f"unknown exploration draw {draw!r}"
        B, T, L = r.cont.shape
        u = torch.rand((B, -(-T // span)), device=r.cont.device)  # (B, windows)
        u = u if span == 1 else u.repeat_interleave(span, dim=1)[:, :T]  # (B, T)
        if draw == "next":
            return dataclasses.replace(r, deeper=u < share)
        q = self.prior if self.has_prior else torch.full((L,), 1.0 / L, device=r.cont.device)
        cdf = q.to(u.dtype).cumsum(0)[:-1]  # (L-1,) the last is 1
        drawn = 1 + (u[..., None] / share >= cdf).sum(-1)  # (B, T) in 1..L
        return dataclasses.replace(r, drawn=torch.where(u < share, drawn, torch.zeros_like(drawn)))

    def aux_loss(
        self, r: RouterOutput, balance_weight: float, entropy_weight: float, prior_weight: float = 0.0
    ) -> tuple[torch.Tensor | None, RouterLossStats | None]:
        """The router's own training loss and its terms: (None, None) for the paper recipe; for the budget and
        expected recipes balance_weight * KL(q || mean pi) + entropy_weight * mean H(pi) + prior_weight *
        mean KL(pi || q) (the weights are the objective's: objective.router_balance_weight,
        objective.router_entropy_weight, objective.router_prior_weight)."""
        if not self.has_prior:
            return None, None
        logp = torch.log_softmax(r.logits.float(), dim=-1).flatten(0, -2)  # (N, L)
        pi = logp.exp()
        q = self.prior.to(pi.dtype)
        kl = (q * (q.log() - pi.mean(0).clamp_min(1e-12).log())).sum()
        ent = -(pi * logp).sum(-1).mean()
        prior_kl = (pi * (logp - q.log())).sum(-1).mean()  # = -H(pi) - mean sum pi log q
        loss = balance_weight * kl + entropy_weight * ent + prior_weight * prior_kl
        return loss, RouterLossStats(kl.detach(), ent.detach(), prior_kl.detach(), r.cont.detach().sum(-1).mean())

    def hard_forecast(self, r: RouterOutput) -> torch.Tensor:
        """(B, T, L-1) logits of the probability that each token is hard at exit d < L (model.router_forecast), from
        r's hidden features without shaping them (the router's hidden layer serves its depths). Only the training
        objective reads it (objective.router_hard_gate), so the forward pass, decoding included, does not run it."""
        return self.forecast(r.features.detach())

    @staticmethod
    def hard_labels(
        ce: torch.Tensor, scored: torch.Tensor, ratio: float, answers: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, T, L) bool: whether each scored token is hard at exit d, its loss there above `ratio`
        (objective.router_hard_ratio) times the mean loss of the batch's scored tokens at exit d. ce (B, T, L) each
        token's cross-entropy at every exit (detached, 0 where not scored), scored (B, T) bool. answers (B, T, L) bool
        or None (objective.router_hard_reference=routed): the mean at exit d is over the tokens marked there (those
        the router runs at depth d), the batch's at an exit that marks none. The mean is the rank's batch: no host
        read, no collective."""
        mean = ce.sum((0, 1)) / scored.sum().clamp_min(1)  # (L,) the batch's mean loss at each exit
        if answers is not None:  # ... or the mean of the answers each exit gives
            n = answers.sum((0, 1))  # (L,)
            mean = torch.where(n > 0, (ce * answers).sum((0, 1)) / n.clamp_min(1), mean)
        return (ce > ratio * mean) & scored[..., None]

    @staticmethod
    def hard_loss(
        r: RouterOutput, hard: torch.Tensor, scored: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The expected recipe's hard-token target (`objective.router_hard_weight`, module doc): a scored token's
        target is its first exit where it is not hard (hard (B, T, L) bool, `hard_labels`; exit L if it is hard at
        every exit). gate (B, T, L-1) bool or None (objective.router_hard_gate): a token whose target lies past an
        exit where the gate is shut has none (it is left to the expected loss and the prior). Returns () the mean
        over the scored tokens (scored (B, T) bool) that have a target of -log pi there."""
        target, keep = Router.hard_target(hard, scored, gate)
        keep = keep.float()
        nll = -torch.log_softmax(r.logits.float(), dim=-1).gather(-1, target[..., None])[..., 0]  # (B, T)
        return (nll * keep).sum() / keep.sum().clamp_min(1.0)

    @staticmethod
    def hard_target(
        hard: torch.Tensor, scored: torch.Tensor, gate: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hard-token target of `hard_loss`: (target (B, T) int64, the exit index 0..L-1 of each token's first
        exit where it is not hard, L-1 if none; keep (B, T) bool, the scored tokens that have a target, the gate
        permitting)."""
        easy = ~hard
        easy[..., -1] = True  # exit L if no exit is easy
        target = easy.to(torch.uint8).argmax(-1)  # (B, T) the first easy exit (argmax: the first)
        keep = scored
        if gate is not None:  # the first exit that is hard with its gate shut must not lie before the target
            shut = F.pad(hard[..., :-1] & ~gate, (0, 1), value=True)  # (B, T, L); exit L stands for "none"
            keep = keep & (shut.to(torch.uint8).argmax(-1) >= target)
        return target, keep
