"""The training objective: `Objective` wraps the network (`LoopedLM`, pipeline/model) and is what DeepSpeed trains.

    loss = L_L + lambda_short * L_S + lambda_align * L_align (+ the router's own loss, budget recipe)

L_L: the cross-entropy of the full pass (M = L, uniform schedule). For shortcut variants the network also runs a
shortcut pass (S ~ U{1..L-1}, integer schedule k/L, `sample_shortcut`) from the same h0 and router output: L_S is
its cross-entropy and L_align the mean squared difference of its logits (or, align_target=hidden, its final-normed
states) to the stop-gradient full pass's, over every position or (align_positions=scored) those with a target.
By default (`fused_loss=True`) both heads, both cross-entropies and the logits alignment run fused by chunks of
tokens in the network's head (`LMHead`, pipeline/model/head_loss.py): no (B, T, V) logits are materialised or kept
for backward; `fused_loss=False` is the plain reference the tests compare with. The budget router recipe adds
`Router.aux_loss` with this objective's weights; `router_explore` runs a share of the tokens at a depth drawn from
the router's prior (`Router.explore`), training passes only.

The expected router recipe (`model.router_recipe=expected`) replaces L_L in training by the expected loss over
exits: every token runs every loop (`forward(exits=True)`), a head reads the state after each loop d, and

    L_exits = sum_tau sum_d pi_{tau,d} CE_{tau,d} / N        (pi: the router's exit distribution, N scored tokens)

each exit through the fused head with the per-token weights pi_d (no (B, T, V) logits either). With
`router_exit_uniform` = a > 0 the weights' value is (1 - a) pi_d + a / L and their gradient pi_d's: the network
learns every exit in proportion to that mix, the router from every exit's CE as before. With
`router_exit_weights=depth` their value is instead 1 at the exit of the depth the router gives the token (the
routed pass's depth) and 0 elsewhere, their gradient again pi_d's: the network learns each answer only at the exit
the routed model answers it from, and `loss_exits` is the routed model's loss; `depth_label` withholds that 1 as
well (weight 0 at every exit) from a token whose hard-token target (below, without the forecast's gate, which
decides where the router sends a token, not what the network learns) lies deeper than its routed depth, so an
answer the network cannot give at its routed exit is not learnt there while the router catches up (its labels are
read from each exit's per-token loss in a head pass without gradients before the weighted heads); with
`router_withhold_gate` = g only where the router's forecast that the token is hard at its routed exit exceeds g,
and with `router_withhold_learnt` = e only where the batch's scored tokens that are not hard at that exit have a mean
loss there below e nats (the rest of the batch is learnt), and with `router_withhold_kind` = g only where the
token's kind has a running hard rate at that exit above g (`KindRates`: a table the objective keeps, not the
network, presumed 1 for a kind never scored, so a new kind waits from its first step; with `router_withhold_kind_only`
the kind alone decides, whatever the token's label; with `router_kind_gate` the router's hard-token target also acts
where the kind's rate exceeds g, the forecast's gate shut or not, so what waits is sent deeper). `learnt_exit` says which exit each token was learnt at
(0: withheld) and `withheld` (logged `router/withheld`) the share. The router's own loss is its balance term and
the per-token KL to its prior (`Router.aux_loss`). Validation (`full_only`) runs the routed pass inference runs.
`loss_L` stays the last exit's plain cross-entropy, and `routed` the statistics of the depths the router would give
(the pass itself runs every token L loops, which is what `full` and the FLOP count see).

The result is typed (`ObjectiveOutput`): its field names are the names of the training metrics (README
"Logging"): `loss`, the parts `loss_L`, `loss_S`, `loss_align`, `loss_router`, `loss_exits`, and per pass the
`DepthStats` fields, logged as `router/<pass>/<field>` (`router/short/loops` too; `router/routed/<field>` under
the expected recipe) next to `router/<RouterLossStats field>`. With `router_hard_weight` > 0 the expected recipe adds
that weight times the router's hard-token target (`Router.hard_loss`, from each exit's per-token cross-entropy the
fused heads return), logged as `loss_hard`; with `router_hard_gate` the router's forecast of hard tokens gates it
and learns the labels (`loss_forecast`). The labels compare a token's loss at an exit with the batch's mean there,
or with `router_hard_reference=routed` with the mean of the tokens the router runs at that depth.

The wrapper holds the network as `net`, so DeepSpeed's files name its parameters `net.<name>`; checkpoints
written before the wrapper existed hold the bare names and load through `_add_prefix`. Exports store the
network alone, under its own names. The objective's own state (the kind table) is not in the module's state dict:
`state()` / `load_state()` carry it in each rank's training state file, so a resume on another world size keeps it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.model.router import DepthStats, RouterLossStats, depth_stats
from pipeline.model.schedule import sample_shortcut

if TYPE_CHECKING:
    from pipeline.model.looped import LoopedLMOutput

PREFIX = "net."  # the network's parameter names inside the wrapper


@dataclass
class ShortcutStats(DepthStats):
    loops: torch.Tensor  # () the shortcut pass's number of loops S


@dataclass
class ObjectiveOutput:
    """One micro-batch's objective. Every tensor but `loss` is detached; the parts absent from this objective are
    None. Logged under the field names (`parts`, `stats`)."""

    loss: torch.Tensor  # () the differentiable total
    depth: torch.Tensor  # (B, T) int64 per-token depth of the full pass
    logits: torch.Tensor | None  # (B, T, V) of the full pass; None on the fused path
    full: DepthStats
    short: ShortcutStats | None = None
    router: RouterLossStats | None = None  # the budget and expected recipes' loss terms
    routed: DepthStats | None = None  # expected recipe: the depths the router gives (the pass runs every loop)
    loss_L: torch.Tensor | None = None  # () cross-entropy of the full pass
    loss_S: torch.Tensor | None = None  # () cross-entropy of the shortcut pass
    loss_align: torch.Tensor | None = None  # () alignment of the shortcut pass to the full pass
    loss_router: torch.Tensor | None = None  # () the router's own loss (budget and expected recipes)
    loss_exits: torch.Tensor | None = None  # () the expected loss over exits (expected recipe)
    loss_hard: torch.Tensor | None = None  # () the router's hard-token target (objective.router_hard_weight)
    loss_forecast: torch.Tensor | None = None  # () the router's forecast of hard tokens (objective.router_hard_gate)
    full_heads: int = 1  # LM-head applications per token of the full pass (L under the expected recipe)
    # router_exit_weights=depth, depth_label: (B, T) int64 the exit whose loss the network learns each token from
    # (its routed depth), 0 where not scored or withheld; depth_label: () the share of scored tokens withheld
    learnt_exit: torch.Tensor | None = None
    withheld: torch.Tensor | None = None

    PARTS: ClassVar[tuple[str, ...]] = (
        "loss_L",
        "loss_S",
        "loss_align",
        "loss_router",
        "loss_exits",
        "loss_hard",
        "loss_forecast",
    )

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        """{part name: value} of the parts this objective has."""
        return {p: getattr(self, p) for p in self.PARTS if getattr(self, p) is not None}

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """{'full/mean_depth': ..., 'short/loops': ..., 'balance_kl': ...}: the statistics by name (the trainer
        logs them under `router/`)."""
        out = {}
        for name in ("full", "short", "routed"):
            if getattr(self, name) is not None:
                out.update({f"{name}/{k}": v for k, v in _fields(getattr(self, name)).items()})
        if self.router is not None:
            out.update(_fields(self.router))
        if self.withheld is not None:
            out["withheld"] = self.withheld
        return out

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


class KindRates(nn.Module):
    """objective.router_withhold_kind: each kind's running hard rate at exits 1..L-1, rate (K, L-1) (a
    non-persistent buffer: it moves with the module, it is saved in the training state, not the weights), 1 where
    a kind was never scored. A kind is the (input token, position) pair at the position that predicts a target,
    bucket (position x vocab + token) mod K: one bucket per kind when K >= block_size x vocab_size. After each
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
        """One batch: kinds (B, T), hard (B, T, L) bool (`Router.hard_labels`), scored (B, T) bool."""
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


class Objective(nn.Module):
    """The training objective around the network `net` (module doc); cfg: the objective's settings."""

    def __init__(self, net: nn.Module, cfg) -> None:
        super().__init__()
        self.net, self.cfg = net, cfg
        self.register_load_state_dict_pre_hook(_add_prefix)
        self.kind_rates = None  # objective.router_withhold_kind: the kinds' running hard rates (`KindRates`)
        if cfg.router_withhold_kind:
            self.kind_rates = KindRates(
                cfg.router_kind_buckets, net.cfg.loops, net.cfg.vocab_size, cfg.router_kind_decay
            )

    def state(self) -> dict:
        """The objective's own training state (saved in each rank's training state file): the kind table."""
        return {} if self.kind_rates is None else {"kind_rate": self.kind_rates.rate.detach().cpu().clone()}

    def load_state(self, state: dict, where: str) -> None:
        """`state()` of a checkpoint; where names it in the one-line error."""
        if self.kind_rates is None:
            return
        if "kind_rate" not in state or state["kind_rate"].shape != self.kind_rates.rate.shape:
            got = tuple(state["kind_rate"].shape) if "kind_rate" in state else "none"
            raise ValueError(
                f"{where}: its kind table is {got}, this run's objective.router_withhold_kind needs "
                f"{tuple(self.kind_rates.rate.shape)} (router_kind_buckets x (loops - 1))"
            )
        self.kind_rates.rate.copy_(state["kind_rate"])

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        shortcut: torch.Tensor | None = None,
        *,
        full_only: bool = False,
        router: bool = True,
        threshold: float | None = None,
        gather_scatter: bool | None = None,
        fused_loss: bool = True,
    ) -> ObjectiveOutput:
        """idx, targets (B, T) (targets -1: ignored). shortcut: (S,) positive ints summing to L (default: drawn
        from torch's global RNG). full_only: the full pass's cross-entropy alone (validation: no shortcut pass,
        alignment, router loss or exploration). router, threshold, gather_scatter: as `LoopedLM.forward` takes them;
        fused_loss=False: the losses from materialised logits (the reference of the fused heads)."""
        c = self.cfg
        expected = router and not full_only and self._expected  # every exit's loss, weighted by the router's pi
        out = self.net(
            idx,
            shortcut=self._schedule(shortcut) if (c.shortcut and not full_only) else None,
            logits=not fused_loss,
            router=router,
            threshold=threshold,
            gather_scatter=gather_scatter,
            ste=c.router_ste,
            ste_log=c.router_ste_log,
            ste_keys=c.router_ste_keys,
            explore=0.0 if full_only else c.router_explore,
            explore_span=c.router_explore_span,
            explore_draw=c.router_explore_draw,
            exits=expected,
        )
        routed_depth = None  # (B, T) the depth the router gives each token (the expected recipe's pass runs all L)
        learnt = {}  # router_exit_weights=depth*: learnt_exit (and withheld)
        if expected:
            theta = self.net.cfg.router_threshold if threshold is None else float(threshold)
            routed_depth = out.router.depth(out.loops, theta)
            pi = torch.softmax(out.router.logits.float(), -1)  # (B, T, L)
            scored, labels = targets != -1, None
            if c.router_exit_weights == "depth_label":  # the hard labels first: they set the network's weights
                rows = torch.stack([self.net.lm_head(h, targets, rows=True) for h in out.exits], -1)  # (B, T, L)
                labels = self._hard_labels(out.router, rows, scored, routed_depth)
            if c.router_exit_uniform:  # the network's weights mix in 1/L; the router's gradient stays CE_d
                a = c.router_exit_uniform
                pi = ((1 - a) * pi + a / out.loops).detach() + pi - pi.detach()
            elif c.router_exit_weights != "pi":  # the network's weight: 1 at the routed depth's exit
                at = F.one_hot(routed_depth - 1, out.loops).to(pi.dtype)  # (B, T, L)
                wait = torch.zeros_like(scored)
                if labels is not None:  # ... 0 where the (ungated) hard target lies deeper than the routed depth
                    hot = self._kind_hot(idx) if c.router_kind_gate else None  # (the table before _wait moves it)
                    wait = self._wait(out.loops, routed_depth, labels, rows, idx)
                    if hot is not None:  # the router's gate opens where the kind is hard: what waits goes deeper
                        labels = (*labels[:2], labels[2] | hot, *labels[3:])
                    at = at * ~wait[..., None]
                    learnt["withheld"] = wait.sum() / scored.sum().clamp_min(1)
                learnt["learnt_exit"] = torch.where(scored & ~wait, routed_depth, 0)
                pi = at + pi - pi.detach()
            loss, parts, ce = (self._fused_exits if fused_loss else self._exit_losses)(out, targets, pi)
            if c.router_hard_weight:  # the router's hard-token target (Router.hard_loss)
                labels = labels or self._hard_labels(out.router, ce, scored, routed_depth)
                loss = loss + self._hard_target(out.router, labels, parts)
        else:
            loss, parts = self._fused_losses(out, targets) if fused_loss else self._losses(out, targets)
        if out.short is not None and not (fused_loss and c.align_target == "logits"):  # (the fused call aligns logits)
            align = self._alignment(out, targets)
            loss = loss + c.lambda_align * align
            parts["loss_align"] = align.detach()
        router_stats = None
        if not full_only and out.router is not None:  # the router's own loss (budget and expected recipes)
            prior_weight = c.router_prior_weight if expected else 0.0
            aux, router_stats = self.net.router.aux_loss(
                out.router, c.router_balance_weight, c.router_entropy_weight, prior_weight
            )
            if aux is not None:
                loss = loss + aux
                parts["loss_router"] = aux.detach()
        L = out.loops
        routed = None if routed_depth is None else depth_stats(routed_depth, L)  # the router's, not the pass's
        full = depth_stats(out.depth, L)
        return ObjectiveOutput(
            loss,
            out.depth,
            out.logits,
            full,
            self._short_stats(out),
            router_stats,
            routed,
            **parts,
            **learnt,
            full_heads=L if expected else 1,
        )

    def _wait(self, loops: int, routed_depth, labels: tuple, rows, idx) -> torch.Tensor:
        """router_exit_weights=depth_label: (B, T) bool, the scored tokens whose loss is withheld: their ungated
        hard target (`Router.hard_target` of the labels from `_hard_labels`) lies deeper than their routed depth
        (B, T); with router_withhold_gate only where the forecast says hard at the routed exit, with
        router_withhold_learnt only where the batch's tokens not hard there have a mean loss (rows (B, T, L)) below
        it; with router_withhold_kind only where the kind of the token (idx (B, T) the input tokens) has a running
        hard rate at the routed exit above it (the rate before this batch, which then updates it), and with
        router_withhold_kind_only wherever that rate is above it, whatever the token's own label."""
        c = self.cfg
        hard, scored, _, _, prob = labels
        d = (routed_depth - 1).clamp(max=loops - 2)[..., None]  # (B, T, 1) the routed exit of 1..L-1 (L never waits)
        if c.router_withhold_kind_only:  # the kind alone decides (below): every scored answer short of the last loop
            wait = scored & (routed_depth < loops)
        else:
            wait = scored & (self.net.router.hard_target(hard, scored)[0] >= routed_depth)  # target: 0-based
        if c.router_withhold_gate:  # ... and the forecast (the gate's, prob (B, T, L-1)) says hard at the routed exit
            wait = wait & (prob.gather(-1, d)[..., 0] > c.router_withhold_gate)
        if c.router_withhold_learnt:  # ... and the batch's other answers at the routed exit are learnt
            easy = (scored[..., None] & ~hard).float()  # (B, T, L) the scored tokens not hard
            rest = (rows * easy).sum((0, 1)) / easy.sum((0, 1)).clamp_min(1)  # (L,) their mean loss
            wait = wait & (rest[routed_depth - 1] < c.router_withhold_learnt)
        if self.kind_rates is not None:  # ... and the token's kind is nearly always hard at the routed exit
            kinds = self.kind_rates.kinds(idx)  # (B, T)
            wait = wait & (self.kind_rates.rate[kinds].gather(-1, d)[..., 0] > c.router_withhold_kind)
            self.kind_rates.update(kinds, hard, scored)
        return wait

    def _kind_hot(self, idx: torch.Tensor) -> torch.Tensor:
        """objective.router_kind_gate: (B, T, L-1) bool, where the kind of each token (idx (B, T) the input tokens)
        has a running hard rate above router_withhold_kind at exits 1..L-1 (the gate `_hard_labels` built opens
        there too)."""
        return self.kind_rates.rate[self.kind_rates.kinds(idx)] > self.cfg.router_withhold_kind

    def _hard_labels(self, r, ce: torch.Tensor, scored: torch.Tensor, routed_depth: torch.Tensor) -> tuple:
        """(hard (B, T, L) bool, scored (B, T) bool, gate (B, T, L-1) bool or None, fit () or None, prob (B, T, L-1)
        or None): the hard-token labels (`Router.hard_labels`) from each exit's per-token loss ce (B, T, L), bounded
        at chance with router_hard_bound, against the mean of the answers each exit gives (routed_depth (B, T))
        with router_hard_reference=routed; with the gate (router_hard_gate = tau) the router's forecast of them
        (prob, detached), where it is above tau, and the forecast's own loss (binary cross-entropy to the labels
        over the scored tokens, exits 1..L-1)."""
        c = self.cfg
        if c.router_hard_bound:  # losses past chance count as chance (objective.router_hard_bound)
            ce = ce.clamp_max(math.log(self.net.cfg.vocab_size))
        answers = None  # router_hard_reference=routed: (B, T, L) the scored tokens the router runs at each depth
        if c.router_hard_reference == "routed":
            answers = F.one_hot(routed_depth - 1, ce.shape[-1]).bool() & scored[..., None]
        hard = self.net.router.hard_labels(ce, scored, c.router_hard_ratio, answers)  # (B, T, L)
        gate = fit = prob = None
        if c.router_hard_gate:
            f = self.net.router.hard_forecast(r).float()  # (B, T, L-1) logits
            bce = F.binary_cross_entropy_with_logits(f, hard[..., :-1].float(), reduction="none").mean(-1)
            fit = (bce * scored).sum() / scored.sum().clamp_min(1)
            prob = torch.sigmoid(f.detach())  # (B, T, L-1)
            gate = prob > c.router_hard_gate
        return hard, scored, gate, fit, prob

    def _hard_target(self, r, labels: tuple, parts: dict) -> torch.Tensor:
        """The router's hard-token target, weighted (`Router.hard_loss`), from `_hard_labels`: for tokens whose
        forecast says hard with probability > tau at every exit before their target when gated, plus the
        forecast's loss. Its terms go into parts as loss_hard and loss_forecast."""
        hard, scored, gate, fit, _ = labels
        total = torch.zeros((), dtype=torch.float32, device=hard.device)
        if fit is not None:  # (summed in this order since the gate was built: the same bits)
            total = total + fit
            parts["loss_forecast"] = fit.detach()
        term = self.net.router.hard_loss(r, hard, scored, gate)
        parts["loss_hard"] = term.detach()
        return total + self.cfg.router_hard_weight * term

    @property
    def _expected(self) -> bool:
        return self.net.router is not None and self.net.cfg.router_recipe == "expected"

    def _fused_exits(self, out: LoopedLMOutput, targets: torch.Tensor, pi: torch.Tensor) -> tuple:
        """(loss, parts, ce): every exit's cross-entropy weighted by pi through the fused head; the last exit's call
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
        """(loss, parts) of both passes' cross-entropies and, when aligning logits, the alignment: one chunked
        call through the network's head, from the final-normed states (B, T, d); no (B, T, V) logits. weight
        (B, T): per-token weights of the full pass's cross-entropy (the expected recipe's last exit); rows (with
        weight): (loss, parts, the full pass's per-token cross-entropy (B, T), detached)."""
        c = self.cfg
        on_logits = c.align_target == "logits"
        hs = None if out.short is None else out.short.hidden  # (B, T, d)
        lam_a = c.lambda_align if on_logits else None
        scored = c.align_positions == "scored"
        loss, p, *ce = self.net.lm_head(out.hidden, targets, hs, c.lambda_short, lam_a, scored, weight, rows)
        parts = {"loss_L": p[0]}
        if out.short is not None:
            parts["loss_S"] = p[1]
            if on_logits:
                parts["loss_align"] = p[2]
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
        """() the shortcut pass's mean squared difference to the stop-gradient full pass: logits, or (align_target
        hidden) final-normed states; over every position or (align_positions scored) those with a target."""
        c = self.cfg
        a, b = (out.short.logits, out.logits) if c.align_target == "logits" else (out.short.hidden, out.hidden)
        return _align_mse(a.float(), b.detach().float(), targets if c.align_positions == "scored" else None)

    @staticmethod
    def _short_stats(out: LoopedLMOutput) -> ShortcutStats | None:
        if out.short is None:
            return None
        S = out.short.loops
        return ShortcutStats(**_fields(depth_stats(out.short.depth, S)), loops=torch.tensor(float(S)))
