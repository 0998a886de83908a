"""Router training recipes (pipeline/train/recipes): the registry and its interface (a new recipe is a module and
its registration, nothing in the objective), and the kinds recipe's parts recomputed by hand: the hard-token
target and its labels, the exit weights, the kinds' table that withholds answers and opens the router's gate."""

import json
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from data_prep.configlib import f
from helpers import RECIPE, loose_kinds
from pipeline.config import load_config
from pipeline.model import LoopedLM
from pipeline.train.objective import ObjectiveOutput, Objective
from pipeline.train.recipes import RECIPES, Recipe, RouterSettings, Step, Terms, kinds, register
from test_head_loss import V, _batch, _exit_ce, _model, _run

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------ a new recipe
@dataclass
class ToySettings(RouterSettings):
    weight: float = f(0.5, "Weight of the mean square of the router's logits.")


class Toy(Recipe):
    """A recipe the objective has never heard of: the paper's estimator plus weight x mean(logits^2)."""

    name = "toy"
    Settings = ToySettings
    ste = True
    PARTS = ("loss_router",)

    def terms(self, step, ce):
        term = self.s.weight * step.out.router.logits.float().square().mean()
        return Terms([term], {"loss_router": term.detach()}, {"toy_norm": step.out.router.logits.detach().norm()})


@pytest.fixture
def toy():
    register(Toy)
    yield Toy
    del RECIPES["toy"]


def test_a_new_recipe_is_one_module_and_its_registration(toy, tmp_path):
    """Registered, the toy recipe is a config choice with its own key (and only that one), the objective adds its
    term and logs its metric, and `tlf train` trains with it: nothing else knows it."""
    from pipeline.cli import main
    from test_train import TINY, make_shards

    over = ["objective.router.recipe=toy", "objective.router.weight=0.25"]
    cfg = load_config("tiny/t-loopformer", over)
    assert cfg.objective.router == ToySettings(recipe="toy", weight=0.25)
    r = CliRunner().invoke(main, ["config", "show", "tiny/t-loopformer", *over, "--doc"])
    assert "objective.router.weight = 0.25" in r.output and "objective.router.entropy_weight" not in r.output
    torch.manual_seed(0)
    net = LoopedLM(cfg.model)
    x, y = _batch()
    k = torch.tensor([2, 2])
    paper = Objective(net, load_config("tiny/t-loopformer").objective)(x, y, k)
    out = Objective(net, cfg.objective)(x, y, k)
    logits = net.route(net.embed(x)).logits.float()
    assert torch.equal(out.loss, paper.loss + 0.25 * logits.square().mean())
    assert "toy_norm" in out.stats and "loss_router" in out.parts
    data = make_shards(tmp_path / "d", windows=8)
    run_cfg = load_config("tiny/t-loopformer", TINY + over + [f"data.dir={data}", f"checkpoint.dir={tmp_path / 'c'}"])
    run_cfg.schedule.max_steps, run_cfg.train.eval_interval = 2, 0
    from pipeline.train.trainer import run

    run(run_cfg)
    logged = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert sum("router/toy_norm" in row for row in logged) == 2 and all(row.get("loss_router", 1) > 0 for row in logged)


def test_the_objective_names_no_recipe():
    """Objective calls recipes only through `Recipe`'s interface: pipeline/train/objective.py names none of them,
    and every recipe's parts are logged (`ObjectiveOutput.PARTS`)."""
    from pathlib import Path

    src = (Path(__file__).resolve().parent.parent / "pipeline" / "train" / "objective.py").read_text()
    for name in RECIPES:
        assert f'"{name}"' not in src and f"'{name}'" not in src, name
    assert {p for r in RECIPES.values() for p in r.PARTS} <= set(ObjectiveOutput.PARTS)


# ------------------------------------------------------------------------ the hard-token target
def test_the_hard_token_target_is_each_tokens_first_exit_within_the_margin_of_its_answers_mean():
    """kinds.hard_loss: a scored token is hard at exit d when its loss there exceeds HARD_RATIO x the mean of the
    answers exit d gives (the batch's scored tokens where it gives none); its target is its first exit where it is
    not (the last if none); the term is the mean of -log pi there, and only the router's logits get its gradient. A
    batch of alike tokens has no hard token. A token whose target lies past an exit where it is hard and the gate is
    shut has no target."""
    ce = torch.tensor(
        [[[0.1, 0.1, 0.1], [5.0, 0.2, 0.1], [5.0, 5.0, 5.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]]]
    )  # (1, 5, 3); exit means over the four scored tokens: 2.55, 1.35, 1.33
    scored = torch.tensor([[True, True, True, True, False]])
    none = torch.zeros(1, 5, 3, dtype=torch.bool)  # no answers routed anywhere: the batch's means
    logits = torch.randn(1, 5, 3, requires_grad=True)
    logp = torch.log_softmax(logits.detach(), -1)[0]
    want = -(logp[0, 0] + logp[1, 1] + logp[2, 2] + logp[3, 0]) / 4  # exit 1, exit 2, none easy -> exit 3, exit 1
    hard = kinds.hard_labels(ce, scored, none)
    is_open = torch.ones(1, 5, 2, dtype=torch.bool)
    loss = kinds.hard_loss(logits, hard, scored, is_open)
    torch.testing.assert_close(loss.detach(), want)
    loss.backward()
    assert float(logits.grad[0, 4].abs().sum()) == 0.0  # the unscored token has no target
    assert float(logits.grad[0, 2, 2]) < 0 < float(logits.grad[0, 1, 0])  # towards each target, from the rest
    # against the answers each exit gives: token 1 alone at exit 1 is its own mean there, so not hard at exit 1
    answers = torch.zeros(1, 5, 3, dtype=torch.bool)
    answers[0, 1, 0] = True
    assert not bool(kinds.hard_labels(ce, scored, answers)[0, 1, 0]) and bool(hard[0, 1, 0])
    # the gate: token 1 (target exit 2) keeps its target only if the gate is open at exit 1; token 2 (target exit 3)
    # only if it is open at exits 1 and 2; a token not hard before its target (0 and 3) keeps it whatever the gate
    gate = is_open.clone()
    gate[0, 2, 1] = False  # shut at exit 2 for token 2
    gate[0, 0, 0] = gate[0, 3, 0] = False  # shut where the tokens are easy: no effect
    got = kinds.hard_loss(logits.detach(), hard, scored, gate)
    torch.testing.assert_close(got, -(logp[0, 0] + logp[1, 1] + logp[3, 0]) / 3)
    gate[0, 1, 0] = False  # shut at exit 1 for token 1 too
    got = kinds.hard_loss(logits.detach(), hard, scored, gate)
    torch.testing.assert_close(got, -(logp[0, 0] + logp[3, 0]) / 2)
    alike = (3.4 + 0.1 * torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(0))).abs()  # all at chance
    ones = torch.ones(64, dtype=torch.bool)[None]
    assert not bool(kinds.hard_labels(alike, ones, torch.zeros(1, 64, 2, dtype=torch.bool)).any())


# ----------------------------------------------------------------------------- the kinds recipe
def _kinds(*extra):
    m = _model("base-loop-router", *RECIPE["kinds"], "model.exited_keys=frozen", *extra)
    return m, m.recipe


def _by_hand(m, x, y):
    """(routed depth (B, T), the hard labels (B, T, L) as the recipe reads them: each exit's loss bounded at ln V,
    against the mean of the answers it gives, the kinds (B, T))."""
    with torch.no_grad():
        r = m.net(x, exits=True)
        ce = _exit_ce(m, r.exits, y).clamp_max(math.log(V))
    L, scored = m.net.cfg.loops, y != -1
    routed = r.router.depth(L, m.net.cfg.router_threshold)
    answers = F.one_hot(routed - 1, L).bool() & scored[..., None]
    n = answers.sum((0, 1))
    mean = torch.where(n > 0, (ce * answers).sum((0, 1)) / n.clamp_min(1), ce.sum((0, 1)) / scored.sum())
    hard = (ce > kinds.HARD_RATIO * mean) & scored[..., None]
    return routed, hard, (torch.arange(x.shape[1]) * V + x) % kinds.KIND_BUCKETS


def test_the_kinds_exit_weights_are_one_at_the_routed_exit_with_pis_gradient():
    """1 at the exit of the routed depth, 0 elsewhere and 0 at every exit for an answer that waits (routed short of
    the last loop, its kind's rate at the routed exit above `withhold`: a table set by hand); their gradient is
    pi's."""
    m, rec = _kinds()
    x, y = _batch()
    L, scored = m.net.cfg.loops, y != -1
    rate = torch.rand(kinds.KIND_BUCKETS, L - 1, generator=torch.Generator().manual_seed(1))
    rec.table.rate.copy_(rate)
    out = m.net(x, exits=True, detach=True)
    w = rec.exit_weights(Step(m.net, out, x, y, m.net.cfg.router_threshold))
    routed = out.router.depth(L, m.net.cfg.router_threshold)
    kind = (torch.arange(x.shape[1]) * V + x) % kinds.KIND_BUCKETS
    wait = scored & (routed < L) & (rate[kind].gather(-1, (routed - 1).clamp(max=L - 2)[..., None])[..., 0] > 0.8)
    assert 0 < int(wait.sum()) < int(scored.sum())
    torch.testing.assert_close(w.detach(), F.one_hot(routed - 1, L).float() * ~wait[..., None], rtol=0, atol=1e-6)
    c = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    (gw,) = torch.autograd.grad((w * c).sum(), out.router.logits, retain_graph=True)
    (gp,) = torch.autograd.grad((torch.softmax(out.router.logits.float(), -1) * c).sum(), out.router.logits)
    torch.testing.assert_close(gw, gp)


def test_the_kinds_table_withholds_answers_and_learns_each_kinds_hard_rate(monkeypatch):
    """A new kind waits from its first step (the table starts at 1); each batch moves its kinds' rates toward their
    tokens' mean hard label (the labels recomputed here token by token); the next batch waits where its kind's rate
    at the routed exit exceeds `withhold`, whatever its own label. The objective reports the exit each answer was
    learnt at and the share withheld. The table goes out and back in whole; another shape is a one-line error."""
    loose_kinds(monkeypatch, ratio=1.0, buckets=61, decay=0.25)
    m, rec = _kinds("objective.router.withhold=0.5")
    x, y = _batch()
    scored, L = y != -1, m.net.cfg.loops
    routed, hard, kind = _by_hand(m, x, y)
    first = _run(m, x, y, True)[0]
    wait = scored & (routed < L)
    assert torch.equal(first.tokens["learnt_exit"], torch.where(scored & ~wait, routed, 0))
    assert float(first.metrics["withheld"]) == pytest.approx(float(wait.sum() / scored.sum()))
    want, by_kind = torch.ones(61, L - 1), {}
    for b, t in scored.nonzero().tolist():
        by_kind.setdefault(int(kind[b, t]), []).append(hard[b, t, :-1].float())
    for k, rows in by_kind.items():
        want[k] = 0.25 + 0.75 * torch.stack(rows).mean(0)
    assert torch.allclose(rec.table.rate, want, atol=1e-6) and len(by_kind) < 61  # unseen kinds stay at 1
    assert 0 < int(hard[..., :-1].sum()) < int(scored.sum()) * (L - 1)  # labels of both kinds
    rate = torch.rand(61, L - 1, generator=torch.Generator().manual_seed(2))  # the next batch reads this table
    m.start = {"kind_rate": rate}
    second = _run(m, x, y, True)[0]
    at = rate[kind].gather(-1, (routed - 1).clamp(max=L - 2)[..., None])[..., 0]  # (B, T)
    kept = wait & (at > 0.5)
    assert 0 < int(kept.sum()) < int(wait.sum())
    assert torch.equal(second.tokens["learnt_exit"], torch.where(scored & ~kept, routed, 0))
    other = Objective(m.net, m.cfg)
    other.load_state(m.state(), "ck")
    assert torch.equal(other.recipe.table.rate, rec.table.rate)
    with pytest.raises(ValueError, match=rf"^ck: its kind table is \(7, {L - 1}\), the kinds recipe needs \(61, "):
        other.load_state({"kind_rate": torch.ones(7, L - 1)}, "ck")
    with pytest.raises(ValueError, match=r"^ck: its kind table is none"):
        other.load_state({}, "ck")


def test_the_kinds_table_opens_the_routers_gate(monkeypatch):
    """The router's hard-token target acts where the forecast's gate is open (tau 0.9; an untrained forecast says
    ~0.5, so it is shut everywhere) or the token's kind has a running hard rate above `withhold` at that exit (a
    table set by hand), recomputed here through `kinds.hard_loss`; the forecast learns the labels (`loss_forecast`,
    its binary cross-entropy recomputed here)."""
    loose_kinds(monkeypatch, ratio=1.0, buckets=61, decay=0.25)
    m, rec = _kinds("objective.router.withhold=0.5")
    x, y = _batch()
    scored, L = y != -1, m.net.cfg.loops
    routed, hard, kind = _by_hand(m, x, y)
    rate = torch.rand(61, L - 1, generator=torch.Generator().manual_seed(4))
    m.start = {"kind_rate": rate}
    out = _run(m, x, y, True)[0]
    with torch.no_grad():
        r = m.net(x, exits=True).router
        fc = m.net.router.hard_forecast(r).float()  # (B, T, L-1)
    gate, hot = torch.sigmoid(fc) > 0.9, rate[kind] > 0.5
    assert not bool(gate.any())
    want = kinds.hard_loss(r.logits, hard, scored, gate | hot)
    kept = [int(kinds.hard_target(hard, scored, g)[1].sum()) for g in (gate | hot, gate)]
    assert kept[0] > kept[1]  # the table opens the gate for some
    assert math.isclose(float(out.parts["loss_hard"]), float(want), rel_tol=1e-5)
    bce = F.binary_cross_entropy_with_logits(fc, hard[..., :-1].float(), reduction="none").mean(-1)
    assert math.isclose(float(out.parts["loss_forecast"]), float((bce * scored).sum() / scored.sum()), rel_tol=1e-5)
    total = out.parts["loss_exits"] + out.parts["loss_forecast"] + 1.0 * out.parts["loss_hard"]
    torch.testing.assert_close(out.loss.detach(), total + out.parts["loss_router"], rtol=1e-6, atol=0)


def test_the_kinds_labels_read_losses_bounded_at_chance(monkeypatch):
    """The labels are read from each exit's per-token loss bounded at ln V, so losses above chance (a confidently
    wrong net has many) enter the means and the comparison as chance; the loss itself is not bounded."""
    seen = []
    real = kinds.hard_labels
    monkeypatch.setattr(kinds, "hard_labels", lambda ce, *a: seen.append(ce.clone()) or real(ce, *a))
    m, _ = _kinds()
    with torch.no_grad():
        m.net.lm_head.weight.mul_(30.0)  # confident wrong answers: many losses far above chance
    x, y = _batch()
    out = _run(m, x, y, True)[0]
    with torch.no_grad():
        free = _exit_ce(m, m.net(x, exits=True).exits, y)
    assert float(free.max()) > math.log(V) + 1  # the case the bound is for
    torch.testing.assert_close(seen[0], free.clamp_max(math.log(V)), rtol=1e-5, atol=1e-5)
    assert float(out.parts["loss_L"]) > math.log(V)  # the loss is not bounded


def test_every_recipe_says_how_the_network_trains():
    """The network's training forward under each recipe: the straight-through estimator for the paper's and the
    budget recipes, every exit for the expected and kinds recipes, the router on sg(h0) for the kinds recipe."""
    args = {}
    for name in RECIPES:
        cfg = load_config("fold/base-loop-router", RECIPE[name])
        args[name] = Objective(LoopedLM(cfg.model), cfg.objective).recipe.network_args()
    assert args == {
        "paper": {"ste": True, "exits": False, "detach": False},
        "budget": {"ste": True, "exits": False, "detach": False},
        "expected": {"ste": False, "exits": True, "detach": False},
        "kinds": {"ste": False, "exits": True, "detach": True},
    }
