"""LoopedLM invariants (docs/design.md §1): gather-scatter = dense reference, router semantics, STE, shortcut
schedules, zero-init identity, causality and forward/backward for every preset."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import VARIANTS, load_config, list_presets
from pipeline.model import LoopedLM, RouterOutput
from pipeline.model.schedule import sample_shortcut, table_index, time_table, uniform
from pipeline.train.ac import apply_ac, checkpointed_mode
from pipeline.train.objective import Objective
from pipeline.train.recipes import init_router
from tests.helpers import DEVICES, RECIPE, spread_router

torch.set_num_threads(1)


def make(variant="t-loopformer", *overrides, perturb=True, seed=1):
    """A tiny model as the trainer builds it (the router recipe's init); perturb=True makes modulators non-zero and
    router depths diverse. Its `objective` is the config's."""
    torch.manual_seed(seed)
    cfg = load_config(f"tiny/{variant}", list(overrides))
    model = LoopedLM(cfg.model)
    init_router(model, cfg.objective.router)
    model.objective_cfg = cfg.objective
    if perturb:
        with torch.no_grad():
            for layer in model.layers:
                if layer.modulated:
                    layer.modulator[1].weight.normal_(0, 0.05)
                    layer.modulator[1].bias.normal_(0, 0.05)
        spread_router(model, seed)  # peaky softmax -> tokens spread over all depths
    return model


def batch(B=3, T=40, V=50304, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def objective(model):
    """The training objective around `model`: its config's (`make`), else its variant's tiny preset's."""
    cfg = getattr(model, "objective_cfg", None) or load_config(f"tiny/{model.cfg.variant}").objective
    return Objective(model, cfg)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------- gather-scatter
STRATEGIES = ("compact", "sorted", "bucketed")  # model.execution's strategies besides the dense reference
CASES = [
    ("t-loopformer", []),
    ("t-loopformer", RECIPE["budget"]),
    ("t-loopformer", [*RECIPE["budget"], "model.exited_keys=frozen"]),
    ("t-loopformer", [*RECIPE["budget"], "model.exit_schedule=prefix", "model.exited_keys=frozen"]),
    ("t-loopformer", [*RECIPE["expected"], "model.exited_keys=frozen"]),
    ("loopformer", []),
    ("base-loop-ee-align", []),
    ("base-loop-router", RECIPE["budget"]),
    ("base-loop-router", [*RECIPE["expected"], "model.exited_keys=frozen"]),
    ("base-loop-router", [*RECIPE["kinds"], "model.exited_keys=frozen"]),
]


@pytest.mark.parametrize(
    "variant,overrides,execution",
    [
        (v, o, ex)
        for ex in STRATEGIES
        for v, o in CASES
        if not (ex == "sorted" and "model.exited_keys=frozen" in o)  # sorted needs exited_keys=drop (a ConfigError)
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_gather_scatter_equals_dense_reference(variant, overrides, execution, device):
    """Every execution strategy under every router recipe (paper, budget, expected, kinds): the objective's losses
    and gradients equal the dense reference's (a recipe's state, the kinds' table, is restored between the two).
    fp32 on every device (on CUDA without TF32; there the sorted strategy attends through FlexAttention)."""
    model = make(variant, *overrides, f"model.execution={execution}").to(device)
    idx, tgt = (t.to(device) for t in batch())
    k = torch.tensor([1, 2, 1])  # a fixed shortcut schedule (on the host, as the trainer draws it)
    model.train()
    obj = objective(model).to(device)
    state = obj.state()
    out_gs = obj(idx, tgt, k)
    out_gs.loss.backward()
    g_gs = grads(model)
    if variant == "t-loopformer" and not overrides:  # rows really differ in depth pattern, several depths present
        d = out_gs.depth
        assert len(d.unique()) >= 3 and not torch.equal(d[0], d[1])
        assert not torch.equal((d >= 2).sum(1), (d >= 2).sum(1)[:1].expand(3))  # different |A_2| per row
    model.zero_grad()
    obj.load_state(state, "before")
    out_dense = obj(idx, tgt, k, execution="dense")
    out_dense.loss.backward()
    g_dense = grads(model)
    assert torch.equal(out_gs.depth, out_dense.depth)
    torch.testing.assert_close(out_gs.parts, out_dense.parts, atol=1e-5, rtol=0)  # both passes' losses
    torch.testing.assert_close(out_gs.loss, out_dense.loss, atol=1e-5, rtol=0)
    assert g_gs.keys() == g_dense.keys() and len(g_gs) == len(list(model.parameters()))
    for n in g_gs:
        torch.testing.assert_close(g_gs[n], g_dense[n], atol=1e-5, rtol=0, msg=n)


@pytest.mark.parametrize("exited_keys", ["drop", "frozen"])
def test_what_an_exited_token_shows_later_loops(exited_keys):
    """model.exited_keys: a token p that exited after loop 1 gets its state moved after loop 1; a later token q
    that runs loops 2-4 sees the change only with frozen keys (with dropped ones no loop past p's depth reads
    p), and p itself stays as it is. With frozen keys both paths equal the rule written out layer by layer:
    causal attention over every token, the exited tokens' states held at every layer of the loop."""
    model = make("t-loopformer", f"model.exited_keys={exited_keys}").eval()
    with torch.no_grad():  # gates of order one: a wrong key or a state that moves inside a loop shows
        for layer in model.layers:
            layer.modulator[1].bias.normal_(0, 1.0)
    idx = batch(B=3, T=24)[0]  # rows with different |A_i|: the compaction pads some at the tail
    dm = model(idx, loops=4).depth  # (3, 24); row 0 is watched
    p = int((dm[0] == 1).nonzero()[0])
    q = next(t for t in range(p + 1, 24) if dm[0, t] >= 3)
    tables = model.modulation_tables(uniform(4))
    h0 = model.embed(idx)
    h1 = model.loop(h0, 1, 4, tables, dm)
    h1b = h1.clone()
    h1b[0, p] += 1.0
    outs = []
    for h in (h1, h1b):
        for i in (2, 3, 4):
            h = model._masked_loop(h, i, 4, tables, dm, None)
        outs.append(h)
    assert torch.equal(outs[0][0, p] - outs[1][0, p], h1[0, p] - h1b[0, p])  # p stays as it is
    moved = (outs[0][0, q] - outs[1][0, q]).abs().max().item()
    assert (moved > 1e-4) == (exited_keys == "frozen"), moved
    if exited_keys == "frozen":
        h = h0
        for i in range(1, 5):
            active, mods, hc = (dm >= i)[..., None], model.loop_mods(tables, i, 4, dm, by_index=False), h
            for j, layer in enumerate(model.layers):
                hc = torch.where(active, layer(hc, mods[j]), h)
            h = hc
        for ex in ("compact", "bucketed", "dense"):  # sorted runs exited_keys=drop only
            lg = model(idx, loops=4, execution=ex).logits
            torch.testing.assert_close(lg, model.head(h)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("execution", STRATEGIES)
def test_gather_scatter_elastic_budget_and_threshold(execution):
    model = make().eval()
    idx, _ = batch(B=4, T=33)
    for M, theta in [(2, 0.5), (3, 0.3), (4, 0.7)]:
        a = model(idx, loops=M, threshold=theta, execution=execution)
        b = model(idx, loops=M, threshold=theta, execution="dense")
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
        assert int(a.depth.max()) <= M


def test_sorted_through_flex_attention_equals_dense(monkeypatch):
    """The sorted strategy's FlexAttention block mask (its attention on CUDA), run on the CPU in eager mode: its
    logits equal the dense reference's at several budgets and thresholds. (FlexAttention has no backward on the
    CPU; its gradients are the CUDA cases of test_gather_scatter_equals_dense_reference.)"""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.model import looped

    monkeypatch.setattr(looped, "FLEX_DEVICES", ("cpu",))
    monkeypatch.setattr(looped, "_FLEX", [flex_attention])  # eager: compiling it on the CPU is for the GPU's sake
    model = make().eval()
    idx, _ = batch(B=3, T=40)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is slow
        for M, theta in [(4, 0.5), (3, 0.3)]:
            a = model(idx, loops=M, threshold=theta, execution="sorted")
            b = model(idx, loops=M, threshold=theta, execution="dense")
            assert torch.equal(a.depth, b.depth) and len(a.depth.unique()) >= 2
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)


def test_bucketed_lengths_are_a_handful():
    """The bucketed strategy computes one of BUCKETS lengths per loop (multiples of ceil(T / BUCKETS), at most T),
    never fewer slots than active tokens."""
    from pipeline.model.looped import BUCKETS, bucket_length

    for T in (1, 7, 8, 33, 64, 2048):
        sizes = {bucket_length(n, T) for n in range(1, T + 1)}
        assert len(sizes) <= BUCKETS and max(sizes) == T
        assert all(bucket_length(n, T) >= n for n in range(1, T + 1))


@pytest.mark.parametrize("mode,recipe", [("loop", "paper"), ("layer", "paper"), ("loop", "kinds")])
def test_activation_checkpointing_is_exact(mode, recipe):
    """kinds: every exit's state is kept for the heads and the router reads sg(h0) (its table restored between the
    two steps)."""
    model = make("t-loopformer", *RECIPE[recipe])
    idx, tgt = batch(B=2, T=24)
    k = torch.tensor([2, 2])
    model.train()
    obj = objective(model)
    state = obj.state()
    obj(idx, tgt, k).loss.backward()
    ref = grads(model)
    sd = {k_: v.clone() for k_, v in model.state_dict().items()}
    model.zero_grad()
    apply_ac(model, mode)
    assert checkpointed_mode(model) == mode
    obj.load_state(state, "before")
    obj(idx, tgt, k).loss.backward()
    for n, g in grads(model).items():
        torch.testing.assert_close(g, ref[n], atol=1e-6, rtol=0, msg=n)
    # applied from outside: names and state dict unchanged, so checkpoints load either way
    assert model.state_dict().keys() == sd.keys()
    LoopedLM(model.cfg).load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="already applied"):
        apply_ac(model, mode)


def test_activation_checkpointing_recomputes_only_under_grad():
    """Checkpointed units run once under no_grad (validation) and twice (forward + recompute) with autograd."""
    model = make()
    apply_ac(model, "loop")
    calls = []
    model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    idx, tgt = batch(B=2, T=16)
    with torch.no_grad():
        model(idx, loops=2)
    n_eval = len(calls)
    calls.clear()
    model.train()
    F.cross_entropy(model(idx, loops=2).logits.flatten(0, 1), tgt.flatten()).backward()
    assert n_eval == 2 and len(calls) == 4


# --------------------------------------------------------------------------------------- router
def test_router_off_equals_loopformer_exactly():
    t = make("t-loopformer")
    lf = LoopedLM(load_config("tiny/loopformer").model)
    missing, unexpected = lf.load_state_dict(t.state_dict(), strict=False)
    assert not missing and all(k.startswith("router.") for k in unexpected)
    idx, tgt = batch()
    k = torch.tensor([3, 1])
    for m in (t, lf):
        m.train()
    a, b = objective(t)(idx, tgt, k, router=False), objective(lf)(idx, tgt, k)
    assert torch.equal(a.loss, b.loss) and a.parts.keys() == b.parts.keys()
    assert all(torch.equal(a.parts[n], b.parts[n]) for n in a.parts)
    t.eval(), lf.eval()
    assert torch.equal(t(idx, loops=3, router=False).logits, lf(idx, loops=3).logits)
    assert not torch.equal(t(idx, loops=3).logits, lf(idx, loops=3).logits)  # the call's switch, not model state


def test_depth_semantics():
    torch.manual_seed(0)
    L = 6
    cont = torch.softmax(torch.randn(5, 7, L) * 3, -1).flip(-1).cumsum(-1).flip(-1)
    cont[..., 0] = 1.0
    r = RouterOutput(logits=torch.zeros(5, 7, L), cont=cont)
    for M, theta in itertools.product(range(1, L + 1), (0.2, 0.5, 0.8)):
        d = r.depth(M, theta)
        assert d.min() >= 1 and d.max() <= M
        brute = torch.ones_like(d)  # m = max{i <= M : p(i) > theta}
        for i in range(1, M + 1):
            brute = torch.where(cont[..., i - 1] > theta, torch.full_like(d, i), brute)
        assert torch.equal(d, brute)
        for i in range(1, M):  # nested active sets A_{i+1} subset of A_i
            assert bool(((d >= i + 1) <= (d >= i)).all())
    assert bool((r.depth(L, 0.2) >= r.depth(L, 0.8)).all())  # lower threshold -> deeper


def test_router_probabilities():
    model = make()
    h0 = model.embed(batch()[0])
    r = model.router(h0)
    assert torch.equal(r.cont[..., 0], torch.ones_like(r.cont[..., 0]))
    assert bool((r.cont[..., :-1] >= r.cont[..., 1:]).all())  # non-increasing in i
    pi = torch.softmax(r.logits.float(), -1)
    torch.testing.assert_close(r.cont[..., 1], 1 - pi[..., 0], atol=1e-6, rtol=0)


def test_a_detached_router_trains_itself_and_leaves_the_embeddings_alone():
    """forward(detach=True) (the kinds recipe's): the router reads sg(h0). The forward and the router's own
    gradients are unchanged; the gradient its losses send into the token and position embeddings is gone (without
    it, those losses move them)."""
    m = make("base-loop-router", *RECIPE["kinds"], "model.vocab_size=512")
    rec = objective(m).recipe
    idx, _ = batch(T=24, V=512)
    runs = {}
    for detach in (False, True):
        m.zero_grad()
        out = m(idx, detach=detach)
        loss, _ = rec.prior_loss(out.router)  # the router's own loss alone
        loss.backward()
        runs[detach] = (out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    (a, ga), (b, gb) = runs[False], runs[True]
    assert torch.equal(a.logits, b.logits) and torch.equal(a.router.logits, b.router.logits)  # the same values
    assert set(ga) == {*gb, "wte.weight", "wpe.weight"} and float(ga["wte.weight"].abs().sum()) > 0
    for n in gb:  # the router's own gradients are the same
        torch.testing.assert_close(ga[n], gb[n])


def test_straight_through_estimator():
    """forward(ste=True) (the paper and budget recipes'): the router gets the gradient of the loops' updates; the
    values are unchanged, and without it the discrete routing gives the router no gradient."""
    model = make().train()
    idx, tgt = batch()
    runs = {}
    for ste in (True, False):
        model.zero_grad()
        out = model(idx, ste=ste)
        F.cross_entropy(out.logits.flatten(0, 1), tgt.flatten()).backward()
        runs[ste] = (out, model.router.fc1.weight.grad)
    (with_ste, g), (without, g0) = runs[True], runs[False]
    assert g is not None and float(g.abs().sum()) > 0  # the router receives gradient
    torch.testing.assert_close(with_ste.logits, without.logits, atol=1e-6, rtol=0)  # forward unchanged
    assert torch.equal(with_ste.depth, without.depth) and g0 is None
    assert objective(model).recipe.network_args() == {"ste": True, "exits": False, "detach": False}  # paper's


# ------------------------------------------------------------------------------- budget recipe
@pytest.mark.parametrize("L,mean", [(4, 2.0), (4, 3.0), (8, 2.5), (3, 2.0)])
def test_depth_prior_has_the_target_mean_and_maximum_entropy(L, mean):
    from pipeline.train.recipes import depth_prior

    q = depth_prior(L, mean)
    depths = torch.arange(1, L + 1, dtype=torch.float64)
    assert float(q.sum()) == pytest.approx(1.0) and bool((q > 0).all())
    assert float((q * depths).sum()) == pytest.approx(mean, abs=1e-9)
    ent = float(-(q * q.log()).sum())
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # any other distribution with that mean has less entropy
        r = torch.rand(L, generator=g, dtype=torch.float64)
        r = r / r.sum()
        # move r's mean to `mean` by mixing with the point mass at the needed end
        end = torch.zeros(L, dtype=torch.float64)
        rm = float((r * depths).sum())
        end[0 if rm > mean else L - 1] = 1.0
        lam = (mean - rm) / (float((end * depths).sum()) - rm)
        other = (1 - lam) * r + lam * end
        assert float(-(other * other.clamp_min(1e-300).log()).sum()) <= ent + 1e-9
    with pytest.raises(AssertionError, match="strictly between 1 and 4"):
        depth_prior(4, 4.0)


def test_budget_init_spreads_depth_and_gives_the_router_gradient_at_step_one():
    """Unperturbed init (zero modulators): the paper recipe's logits barely differ across tokens and its router
    gets exactly zero gradient; the budget recipe's batch-mean exit distribution is near its prior, its logits
    differ across tokens, several depths are in use and the router learns from the first step."""
    idx, tgt = batch(B=4, T=64)
    k = torch.tensor([2, 2])
    paper = make("t-loopformer", perturb=False, seed=0).train()
    r = paper.route(paper.embed(idx))
    assert float(r.logits.detach().std(dim=(0, 1)).max()) < 1e-2
    objective(paper)(idx, tgt, k).loss.backward()
    assert float(paper.router.fc1.weight.grad.abs().sum()) == 0.0
    model = make("t-loopformer", *RECIPE["budget"], "objective.router.target_depth=2.5", perturb=False, seed=0).train()
    r = model.route(model.embed(idx))
    pi_mean = torch.softmax(r.logits.detach().float(), -1).mean((0, 1))
    q = objective(model).recipe.prior
    assert float((q * (q / pi_mean).log()).sum()) < 0.1
    assert float(r.logits.detach().std(dim=(0, 1)).min()) > 0.3
    assert len(r.depth(4, 0.5).unique()) >= 2
    out = objective(model)(idx, tgt, k)
    assert set(out.parts) == {"loss_L", "loss_S", "loss_align", "loss_router"}
    assert {"balance_kl", "entropy", "soft_depth"} <= set(out.stats)
    out.loss.backward()
    assert float(model.router.fc1.weight.grad.abs().sum()) > 0
    # validation: the full pass's cross-entropy alone
    ev = objective(model)(idx, tgt, full_only=True)
    assert "loss_router" not in ev.parts and torch.equal(ev.loss, ev.parts["loss_L"])


def test_budget_loss_reaches_depths_no_token_runs():
    """The straight-through estimator cannot raise p(L) for a token that stops before loop L; the budget loss
    does: when no token of the batch reaches depth L, its gradient raises every token's depth-L logit."""
    model = make("t-loopformer", *RECIPE["budget"], "objective.router.target_depth=2.5", perturb=False)
    L = model.cfg.loops
    logits = torch.randn(2, 16, L) * 0.3
    logits[..., L - 1] -= 4.0  # p(L) << theta everywhere
    logits.requires_grad_(True)
    pi = torch.softmax(logits, -1)
    cont = torch.cat([torch.ones_like(pi[..., :1]), pi.flip(-1).cumsum(-1).flip(-1)[..., 1:]], -1)
    r = RouterOutput(logits=logits, cont=cont)
    assert int(r.depth(L, 0.5).max()) < L
    loss, _ = objective(model).recipe.prior_loss(r)
    loss.backward()
    assert bool((logits.grad[..., L - 1] < 0).all())  # descending the loss raises the depth-L logit


# ----------------------------------------------------------------------------- conditioning
def test_zero_initialised_modulator_is_identity():
    model = make("t-loopformer", perturb=False)
    h = torch.randn(2, 10, model.cfg.d_model)
    tables = model.modulation_tables(uniform(4))
    for layer, tb in zip(model.layers, tables):
        assert torch.equal(tb, torch.zeros_like(tb))
        assert torch.equal(layer(h, tb[:1].view(1, 1, -1)), h)
    h0 = model.embed(batch()[0])
    r = model.route(h0)
    assert torch.equal(model.run_loops(h0, uniform(4), r.depth(4, 0.5), r.cont), h0)


def test_time_table_and_shortcut_schedules():
    t, dt = time_table(torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64))
    # (m, i) order: (1,1) (2,1) (2,2) (3,1) (3,2) (3,3); per-token renormalisation
    torch.testing.assert_close(dt, torch.tensor([1, 0.5, 0.5, 0.25, 0.25, 0.5], dtype=torch.float64))
    torch.testing.assert_close(t, torch.tensor([0, 0, 0.5, 0, 0.25, 0.5], dtype=torch.float64))
    assert int(table_index(torch.tensor(3), 2)) == 4
    t, dt = time_table(torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64), prefix=True)
    # model.exit_schedule=prefix: every depth runs the pass's own first m steps
    torch.testing.assert_close(dt, torch.tensor([0.25, 0.25, 0.25, 0.25, 0.25, 0.5], dtype=torch.float64))
    torch.testing.assert_close(t, torch.tensor([0, 0, 0.25, 0, 0.25, 0.5], dtype=torch.float64))
    L = 8
    g = torch.Generator().manual_seed(0)
    seen_S, seen_k = set(), set()
    for _ in range(2000):
        k = sample_shortcut(L, g)
        assert k.dtype == torch.long and bool((k >= 1).all()) and int(k.sum()) == L and 1 <= k.numel() <= L - 1
        seen_S.add(k.numel())
        seen_k.add(tuple(k.tolist()))
    assert seen_S == set(range(1, L))
    assert len(seen_k) == 2 ** (L - 1) - 1  # every composition of L except the full (1,...,1) trajectory


def test_elastic_inference_uses_budget():
    for variant in ("loopformer", "t-loopformer", "base-loop"):
        model = make(variant).eval()
        idx, _ = batch(B=2, T=16)
        outs = [model(idx, loops=M).logits for M in (1, 2, 4)]
        assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[1], outs[2])
    base = make("base").eval()
    with pytest.raises(AssertionError, match="loop budget 2 must lie in 1..1"):
        base(batch()[0], loops=2)


# ------------------------------------------------------------------------------ every preset
@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    model = make(variant).eval()
    idx, _ = batch(B=2, T=24)
    ref = model(idx).logits
    for t in (0, 7, 23):
        idx2 = idx.clone()
        idx2[:, t] = (idx2[:, t] + 1) % 50304
        out = model(idx2).logits
        torch.testing.assert_close(out[:, :t], ref[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(out[:, t], ref[:, t])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_preset_forward_backward(variant):
    model = make(variant, perturb=False).train()
    idx, tgt = batch(B=2, T=32)
    obj = objective(model)
    out = obj(idx, tgt)
    assert out.logits is None and torch.isfinite(out.loss)  # the fused objective materialises no logits
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # the router's too: the paper's estimator
    expect = {"loss_L", "loss_S", "loss_align"} if obj.cfg.shortcut else {"loss_L"}
    assert set(out.parts) == expect
    assert out.stats["full/depth_hist"].shape == (model.cfg.loops,)
    torch.testing.assert_close(out.stats["full/depth_hist"].sum(), torch.tensor(1.0))


def test_small_and_paper_presets_build():
    for name in list_presets():
        if name.startswith("small/"):
            model = LoopedLM(load_config(name).model)
            idx = torch.randint(0, 50304, (1, 16))
            assert model(idx).logits.shape == (1, 16, 50304)
    with torch.device("meta"):  # paper scale without allocating memory
        t = LoopedLM(load_config("paper/t-loopformer").model)
        base = LoopedLM(load_config("paper/base").model)
    d, ff, V, T = 2048, 5120, 50304, 2048
    layer = 4 * d * d + 2 * d * ff
    assert base.num_params(exclude_embeddings=True) == 24 * layer + d * 24 * 2 + d  # + norms
    # looped model: 3 layers + zero-init modulators (d -> 4d) + two Fourier MLPs + router + final norm
    fourier = 2 * (256 * d + d + d * d + d)
    router = d * (d // 4) + d // 4 + (d // 4) * 8 + 8
    assert t.num_params(exclude_embeddings=True) == 3 * (layer + d * 4 * d + 4 * d) + fourier + router + d
    # same executed depth -> same FLOPs per token for the 24x1 base and the 3x8 looped model
    assert base.flops_per_token(1) == pytest.approx(t.flops_per_token(8) - 3 * 2 * router, rel=1e-12)
    assert t.flops_per_token(4) < t.flops_per_token(8)
    assert base.flops_per_token(1, seq_len=T, backward=False) == 2 * (24 * layer + d * V) + 4 * 24 * d * T


def test_param_groups_cover_every_parameter_once():
    model = make()
    groups = model.param_groups(0.2)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    no_decay = {id(p) for p in groups[1]["params"]}
    assert id(model.wte.weight) in no_decay and id(model.layers[0].attn.qkv_proj.weight) not in no_decay


def test_depth_at_a_smaller_budget_is_the_full_depth_clipped():
    """The shortcut pass reuses the full pass's |A_i| (one host read per forward): that needs
    depth(S) == min(depth(L), S) for every S, i.e. continue probabilities non-increasing in i."""
    from pipeline.model.router import Router

    torch.manual_seed(0)
    r = Router(16, 8, 6)
    with torch.no_grad():
        r.fc2.weight.normal_(0, 4.0)
    out = r(torch.randn(3, 50, 16) * 3)
    full = out.depth(6, 0.5)
    assert len(full.unique()) >= 4
    for S in range(1, 7):
        for theta in (0.1, 0.5, 0.9):
            assert torch.equal(out.depth(S, theta), out.depth(6, theta).clamp(max=S))


def test_straight_through_matches_the_formula():
    """_StraightThrough equals autograd on h + (out - h) * (1 + s - sg(s)): value, and the gradients of h, out
    and s (h's is zero, out's the incoming gradient, s's the projection on out - h)."""
    from pipeline.model.looped import _StraightThrough

    g = torch.Generator().manual_seed(0)
    h, out, s, gy = (
        torch.randn(2, 5, 8, generator=g),
        torch.randn(2, 5, 8, generator=g),
        torch.rand(2, 5, 1, generator=g),
        torch.randn(2, 5, 8, generator=g),
    )
    res = []
    for f in (lambda a, b, c: a + (b - a) * (1 + c - c.detach()), _StraightThrough.apply):
        a, b, c = (t.clone().requires_grad_() for t in (h, out, s))
        y = f(a, b, c)
        y.backward(gy)
        res.append((y.detach(), a.grad if a.grad is not None else torch.zeros_like(a), b.grad, c.grad))
    for x, y in zip(*res):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert torch.equal(res[1][0], out) and res[1][2].abs().sum() > 0 and res[1][3].abs().sum() > 0


def test_router_defaults_agree_with_model_config():
    import inspect

    from pipeline.config import ModelConfig
    from pipeline.model.router import Router

    defaults = {k: p.default for k, p in inspect.signature(Router).parameters.items() if p.default is not p.empty}
    mc = ModelConfig()
    for k, v in defaults.items():
        assert getattr(mc, f"router_{k}") == v, k


def test_forward_does_not_depend_on_training_mode():
    """The objective is the same call in train and eval mode (validation asks for its part, never inferred); the
    network takes no targets and the objective needs them."""
    model = make("t-loopformer", *RECIPE["budget"], perturb=False)
    obj = objective(model)
    idx, tgt = batch(B=2, T=32)
    k = torch.tensor([1, 3])
    with torch.no_grad():
        for kw in ({"full_only": True}, {"shortcut": k}):
            a, b = obj.train()(idx, tgt, **kw), obj.eval()(idx, tgt, **kw)
            assert torch.equal(a.loss, b.loss) and a.parts.keys() == b.parts.keys()
    assert set(a.parts) == {"loss_L", "loss_S", "loss_align", "loss_router"}
    with pytest.raises(TypeError, match="targets"):
        obj(idx)
    with pytest.raises(TypeError):
        model(idx, tgt)


@pytest.mark.parametrize("gate", [0.0, 1.0])
def test_gate_init_starts_modulated_layers_as_identity_or_plain(gate):
    """gate_init 0 (adaLN-zero): the loops start as the identity; 1: each modulated layer starts as a plain
    pre-norm layer x + MHSA(norm(x)), then + FFN(norm(.)), for every (depth, loop) pair of a pass."""
    model = make("tmlt", f"model.gate_init={gate}", perturb=False)
    d, L = model.cfg.d_model, model.cfg.loops
    tables = model.modulation_tables(uniform(L))
    for tb in tables:  # (K, 4d): a_msa, a_mlp at the gate, g_msa, g_mlp at 0
        assert torch.equal(tb[:, : 2 * d], torch.full_like(tb[:, : 2 * d], gate))
        assert torch.equal(tb[:, 2 * d :], torch.zeros_like(tb[:, 2 * d :]))
    x = torch.randn(2, 8, d)
    layer, mod = model.layers[0], tables[0][:1].view(1, 1, -1)
    plain = x + layer.attn(layer.norm1(x), None)
    plain = plain + layer.mlp(layer.norm2(plain))
    torch.testing.assert_close(layer(x, mod), plain if gate else x, rtol=0, atol=1e-6)


@pytest.mark.parametrize("schedule", ["own", "prefix"])
def test_exits_are_depths_only_under_the_prefix_schedule(schedule):
    """forward(exits=True), the exit recipes' training pass: every token runs every loop and `exits[d-1]` is
    the final-normed state after loop d. Under model.exit_schedule=prefix that is exactly a depth-d token's
    final state (here every token at depth d, so the keys agree too); under `own` depth d runs its own
    trajectory, another computation for d < L."""
    model = make("t-loopformer", *RECIPE["budget"], f"model.exit_schedule={schedule}").eval()
    with torch.no_grad():  # modulations of order one: the time and step embeddings matter
        for layer in model.layers:
            layer.modulator[1].weight.mul_(10)
    idx, _ = batch()
    B, T = idx.shape
    L = model.cfg.loops
    with torch.no_grad():
        out = model(idx, exits=True)
        assert len(out.exits) == L and out.exits[-1] is out.hidden and bool((out.depth == L).all())
        assert out.router is not None  # the router's output comes back; it set no depth
        torch.testing.assert_close(out.hidden, model(idx, router=False).hidden, atol=1e-6, rtol=0)
        h0 = model.embed(idx)
        errs = []
        for d in range(1, L + 1):
            cont = (torch.arange(1, L + 1) <= d).float().expand(B, T, L)  # p(i) = 1 up to d, then 0
            h, depth = model.final_states(h0, RouterOutput(torch.zeros(B, T, L), cont), uniform(L))
            assert bool((depth == d).all())
            err = float((model.norm_f(h) - out.exits[d - 1]).abs().max())
            errs.append(err)
    same = [e for d, e in enumerate(errs, 1) if schedule == "prefix" or d == L]
    assert max(same) < 1e-6, errs
    if schedule == "own":  # depths 1..L-1 run other trajectories
        assert min(errs[:-1]) > 100 * max(same), errs
