"""The fused, chunked LM-head objective (pipeline/model/head_loss.py, docs/design.md §7) equals the plain path of
materialised logits + F.cross_entropy + F.mse_loss: loss, parts and every parameter's gradient, over several
chunks, with ignored targets, under bf16, and keeps no (B, T, V) tensor for backward nor reads the host."""

from pathlib import Path

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import spread_router
from pipeline.config import load_config
from pipeline.demo import EXPECTED_RECIPE
from bench.testkit import count_host_reads
from pipeline.memory import SavedTensors
from pipeline.model import LoopedLM, head_loss
from pipeline.model.head_loss import head_objective, rows_per_chunk
from pipeline.train.objective import Objective

torch.set_num_threads(1)
V = 50304  # the tiny presets' vocabulary
# the logits alignment is the mean square of a small gap between two matmuls' outputs: the matmul's blocking
# (a chunk's rows or all rows) moves it more, relatively, than the losses
RTOL = {"loss_L": 1e-5, "loss_S": 1e-5, "loss_align": 1e-4}
CASES = [
    ("t-loopformer", ()),
    ("loopformer", ()),
    ("base", ()),
    ("t-loopformer", ("objective.align_target=hidden",)),
    ("loopformer", ("objective.align_positions=scored",)),
    ("t-loopformer", ("objective.align_target=hidden", "objective.align_positions=scored")),
]


def _model(variant, *extra, dtype=torch.float32):
    """The training objective (the network is its `.net`) of a tiny preset with perturbed weights."""
    torch.manual_seed(0)
    cfg = load_config(f"tiny/{variant}", list(extra))
    m = LoopedLM(cfg.model)
    with torch.no_grad():  # non-zero modulators: loops differ
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # a spread router (depths 1..3 here) that is not saturated: a saturated softmax's gradient is all rounding
    return Objective(spread_router(m, 0, scale=1.0).to(dtype).train(), cfg.objective)


def _batch(B=2, T=20, ignored=5):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y[0, :ignored] = -1
    return x, y


def _run(m, x, y, fused, autocast=False):
    m.zero_grad()
    k = torch.tensor([1, 3]) if m.cfg.shortcut else None
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = m(x, y, k, fused_loss=fused)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in m.net.named_parameters() if p.grad is not None}


def _exit_ce(m, exits, y):
    """(B, T, L) each token's cross-entropy at every exit (hidden states `exits`), 0 where not scored: the
    materialised reference the labels and tables are recomputed from."""
    ce = [
        F.cross_entropy(m.net.lm_head(h).flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none") for h in exits
    ]
    return torch.stack(ce, -1).view(*y.shape, -1)


def _close(a, b, rtol, msg=""):
    """Elementwise within rtol of the reference's scale (gradients near 0 have no relative precision)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=rtol * float(b.float().abs().max()), msg=msg)


@pytest.mark.parametrize("variant,extra", CASES)
def test_fused_objective_equals_the_plain_path_over_several_chunks(variant, extra, monkeypatch):
    m = _model(variant, *extra)
    x, y = _batch()
    calls = []
    monkeypatch.setattr(head_loss, "rows_per_chunk", lambda V_, dev: calls.append((V_, dev)) or 7)  # 6 chunks
    fused, g_f = _run(m, x, y, True)
    ref, g_r = _run(m, x, y, False)
    assert calls == [(V, "cpu")] and fused.logits is None and ref.logits.shape == (2, 20, V)
    assert (
        fused.parts.keys() == ref.parts.keys() == ({"loss_L", "loss_S", "loss_align"} if m.cfg.shortcut else {"loss_L"})
    )
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=0)
    for n in ref.parts:
        torch.testing.assert_close(fused.parts[n], ref.parts[n], rtol=RTOL[n], atol=0, msg=n)
        assert not fused.parts[n].requires_grad
    assert g_f.keys() == g_r.keys() and "wte.weight" in g_r  # the tied head's gradient lands on wte.weight
    for n in g_r:
        _close(g_f[n], g_r[n], 1e-5, n)
    assert torch.equal(fused.depth, ref.depth) and fused.stats.keys() == ref.stats.keys()
    if m.net.router is not None:
        assert len(fused.depth.unique()) >= 3


@pytest.mark.parametrize(
    "short,align,scored", [(False, None, False), (True, None, False), (True, 0.3, False), (True, 0.3, True)]
)
@pytest.mark.parametrize("chunk", [1, 5, 64, None])
@pytest.mark.parametrize("weighted", [False, True])
def test_head_objective_equals_autograd_of_the_plain_losses(short, align, scored, chunk, weighted):
    g = torch.Generator().manual_seed(2)
    B, T, d, Vs = 2, 9, 8, 97
    hf, hs = (torch.randn(B, T, d, generator=g, requires_grad=True) for _ in range(2))
    W = torch.randn(Vs, d, generator=g, requires_grad=True)
    y = torch.randint(0, Vs, (B, T), generator=g)
    y[1, 3:7] = -1
    w = torch.rand(B, T, generator=g, requires_grad=True) if weighted else None  # per-token weights of CE_f
    lf, ls = hf @ W.t(), hs @ W.t()
    want = F.cross_entropy(lf.flatten(0, 1), y.flatten(), ignore_index=-1)
    parts = [want.detach(), torch.tensor(0.0), torch.tensor(0.0)]  # loss_L unweighted either way
    if weighted:  # sum_tau w_tau CE_tau / N
        ce = F.cross_entropy(lf.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
        want = (ce * w.flatten()).sum() / (y != -1).sum()
    if short:
        ce_s = F.cross_entropy(ls.flatten(0, 1), y.flatten(), ignore_index=-1)
        want, parts[1] = want + 0.2 * ce_s, ce_s.detach()
        if align is not None:
            keep = (y != -1) if scored else torch.ones_like(y, dtype=torch.bool)  # scored: rows with a target
            mse = F.mse_loss(ls[keep], lf.detach()[keep])
            want, parts[2] = want + align * mse, mse.detach()
    ins = ((hf, W, hs) if short else (hf, W)) + ((w,) if weighted else ())
    grads = torch.autograd.grad(want, ins)
    loss, got_parts = head_objective(hf, W, y, hs if short else None, 0.2, align, chunk, align_scored=scored, weight=w)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_parts, torch.stack(parts), rtol=1e-5, atol=1e-7)
    for a, b in zip(torch.autograd.grad(loss, ins), grads):
        _close(a, b, 1e-5)


@pytest.mark.parametrize("chunk", [1, 5, None])
def test_head_rows_are_the_fused_heads_per_token_losses(chunk):
    """`head_rows` (the per-token losses objective.router_exit_weights=depth_label reads before the weighted heads
    run) gives the fused head's returned rows bit for bit, the plain cross-entropy within fp32, 0 where ignored,
    and no gradient; the module entry `LMHead(h, y, rows=True)` is the same call."""
    g = torch.Generator().manual_seed(3)
    B, T, d, Vs = 2, 9, 8, 97
    hf = torch.randn(B, T, d, generator=g, requires_grad=True)
    W = torch.randn(Vs, d, generator=g)
    y = torch.randint(0, Vs, (B, T), generator=g)
    y[1, 3:7] = -1
    got = head_loss.head_rows(hf, W, y, chunk)
    _, _, rows = head_objective(hf, W, y, weight=torch.ones(B, T), rows=True, chunk=chunk)
    assert not got.requires_grad and got.dtype == torch.float32 and got.shape == (B, T)
    assert torch.equal(got, rows)
    want = F.cross_entropy((hf @ W.t()).flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none").view(B, T)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert float(got[1, 3:7].abs().max()) == 0.0
    head = head_loss.LMHead(d, Vs)
    with torch.no_grad():
        head.weight.copy_(W)
    assert torch.equal(head(hf, y, rows=True), head_loss.head_rows(hf, W, y))


def test_chunk_rows_follow_the_byte_budget():
    assert rows_per_chunk(8192) == head_loss.CHUNK_BYTES // (4 * 8192) == 256  # the d=512 bench: 4 chunks of 1024
    assert rows_per_chunk(V) * V * 4 <= head_loss.CHUNK_BYTES < (rows_per_chunk(V) + 1) * V * 4
    assert rows_per_chunk(10**7) == head_loss.MIN_ROWS
    # on a GPU (and the meta device a plan traces) chunks are 32 x larger: the paper's vocabulary, 1334 rows, not 41
    for dev in ("cuda", "meta"):
        assert rows_per_chunk(50304, dev) == head_loss.GPU_CHUNK_BYTES // (4 * 50304) == 1334
    assert rows_per_chunk(50304) == 41


def test_all_targets_ignored_gives_nan_like_the_plain_path():
    m = _model("t-loopformer")
    x, y = _batch(ignored=0)
    y[:] = -1
    fused, g_f = _run(m, x, y, True)
    ref, g_r = _run(m, x, y, False)
    for out in (fused, ref):
        assert out.loss.isnan() and out.parts["loss_L"].isnan() and out.parts["loss_S"].isnan()
    torch.testing.assert_close(fused.parts["loss_align"], ref.parts["loss_align"], rtol=RTOL["loss_align"], atol=0)
    for n in g_r:  # the alignment still trains the shortcut pass; the CE terms give nothing
        assert torch.isfinite(g_f[n]).all(), n
        _close(g_f[n], g_r[n], 1e-5, n)


def test_bf16_autocast_and_bf16_model_are_close_to_the_plain_path():
    m = _model("t-loopformer")
    x, y = _batch()
    fp32, _ = _run(m, x, y, False)
    fused, g_f = _run(m, x, y, True, autocast=True)
    ref, g_r = _run(m, x, y, False, autocast=True)
    # the head's matmuls ran in bf16: the fused loss is far closer to the bf16 reference than to fp32's
    assert (fused.loss - ref.loss).abs() < 0.1 * (ref.loss - fp32.loss).abs()
    for n in g_r:
        assert g_f[n].dtype == torch.float32, n  # fp32 master weights
        _close(g_f[n], g_r[n], 2e-2, n)
    mb = _model("t-loopformer", dtype=torch.bfloat16)  # DeepSpeed's all-bf16 model
    fused, g_f = _run(mb, x, y, True)
    ref, g_r = _run(mb, x, y, False)
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-3, atol=0)
    for n in g_r:
        assert g_f[n].dtype == torch.bfloat16, n
        _close(g_f[n], g_r[n], 5e-2, n)


class _Shapes(SavedTensors):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def _pack(self, t):
        self.shapes.append(tuple(t.shape))
        return super()._pack(t)


def test_nothing_of_size_tokens_x_vocab_is_kept_for_backward():
    m = _model("t-loopformer")
    B, T = 2, 20
    x, y = _batch(B, T)
    d = m.net.cfg.d_model
    kept = {}
    for fused in (True, False):
        acc = _Shapes()
        with acc:
            m(x, y, torch.tensor([1, 3]), fused_loss=fused)
        kept[fused] = acc
    with_v = [s for s in kept[True].shapes if V in s]
    assert with_v == [(V, d)], with_v  # the weight's gradient, computed in forward; no (B, T, V) tensor
    assert sum(1 for s in kept[False].shapes if len(s) > 1 and s[-1] == V and s[0] != V) >= 4  # the plain path's
    # the plain path keeps 4 fp32 (B, T, V): both logits (the MSE's inputs) and both log-softmax outputs; the fused
    # one keeps instead grad_hf, grad_hs (B, T, d) and grad_W (V, d)
    assert kept[False].total - kept[True].total >= 4 * (B * T * V * 4) - (2 * B * T * d + V * d) * 4


def test_no_extra_host_read():
    model_files = tuple(
        str(Path(head_loss.__file__).parent / f)
        for f in ("looped.py", "layers.py", "router.py", "schedule.py", "head_loss.py")
    ) + (str(Path(head_loss.__file__).parent.parent / "train" / "objective.py"),)
    for variant, expected in (("t-loopformer", 1), ("loopformer", 0)):
        m = _model(variant)
        x, y = _batch()
        for fused in (True, False):
            with count_host_reads(model_files) as reads:
                m(x, y, fused_loss=fused).loss.backward()
            assert len(reads) == expected, (variant, fused, reads)


def test_calls_without_the_objective_keep_their_logits():
    m = _model("t-loopformer")
    x, y = _batch()
    for out in (m(x, y, full_only=True, fused_loss=False), m.eval()(x, y, full_only=True, fused_loss=False)):
        assert out.logits.shape == (2, 20, V) and set(out.parts) == {"loss_L"}
        torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-1))
    net = m.net
    assert (
        list(net.state_dict()).count("lm_head.weight") == 1 and net.lm_head.weight is net.wte.weight
    )  # tied, same name


def test_scored_alignment_equals_all_when_every_position_has_a_target():
    m = _model("loopformer")
    x, y = _batch(ignored=0)
    a, ga = _run(m, x, y, True)
    m.cfg.align_positions = "scored"
    b, gb = _run(m, x, y, True)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=0)
    for n in ga:
        _close(gb[n], ga[n], 1e-5, n)
    y[0, :5] = -1  # with ignored targets the two differ
    assert not torch.allclose(_run(m, x, y, True)[0].parts["loss_align"], a.parts["loss_align"])


@torch.no_grad()
def test_logged_alignment_is_within_1e_6_of_the_materialised_path():
    """loss_align sums ~V * rows squared gaps per chunk (millions at V=50304): summed in fp32 it drifted ~3e-6
    relative from F.mse_loss of the materialised logits (and ~2.5e-5 at the bench's sizes); summed in fp64 it
    stays within 1e-6."""
    g = torch.Generator().manual_seed(0)
    d, B, T = 64, 2, 128  # 256 rows: 6 chunks of rows_per_chunk(V) = 41, 2.1M logits each
    W = torch.randn(V, d, generator=g) * 0.05
    hf = torch.randn(B, T, d, generator=g)
    hs = hf + 0.1 * torch.randn(B, T, d, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    _, parts = head_objective(hf, W, y, hs, 0.2, 0.3)
    want = F.mse_loss(hs @ W.t(), hf @ W.t())
    assert float((parts[2] - want).abs() / want) <= 1e-6


@pytest.mark.parametrize(
    "variant,extra",
    [
        ("t-loopformer", ()),
        ("t-loopformer", ("objective.align_target=hidden",)),
        ("t-loopformer", ("model.exited_keys=frozen",)),
        ("base-loop-router", ("model.exited_keys=frozen",)),  # no shortcut pass, no modulation
        ("base-loop-router", ("model.exited_keys=frozen", "objective.router_hard_weight=0.5")),
        ("t-loopformer", ("objective.router_hard_weight=0.5",)),
        ("t-loopformer", ("objective.router_exit_weights=depth",)),
        ("t-loopformer", ("objective.router_hard_weight=0.5", "objective.router_exit_weights=depth_label")),
        (
            "base-loop-router",
            (
                "model.exited_keys=frozen",
                "objective.router_hard_weight=0.5",
                "model.router_forecast=true",
                "objective.router_hard_gate=0.5",
            ),
        ),
    ],
)
def test_expected_exit_objective_fused_equals_the_plain_path(variant, extra, monkeypatch):
    """The expected recipe's objective (pipeline/train/objective.py): every exit's cross-entropy weighted by the
    router's pi through the fused head, over several chunks, equals the materialised sum_d pi_d CE_d: the loss,
    its parts and every gradient, the router's included (its only task gradient is through pi). With the hard
    target on, the per-token losses the fused heads return give the plain path's target and term."""
    m = _model(variant, *EXPECTED_RECIPE, *extra)
    with torch.no_grad():  # modulators away from zero: each exit's state and loss differ
        for layer in m.net.layers:
            if hasattr(layer, "modulator"):
                layer.modulator[1].weight.normal_(0, 0.05)
    x, y = _batch()
    monkeypatch.setattr(head_loss, "rows_per_chunk", lambda V_, dev: 7)
    fused, g_f = _run(m, x, y, True)
    ref, g_r = _run(m, x, y, False)
    short = {"loss_S", "loss_align"} if m.cfg.shortcut else set()  # base-loop-router: no shortcut pass
    hard = {"loss_hard"} if m.cfg.router_hard_weight else set()
    hard |= {"loss_forecast"} if m.cfg.router_hard_gate else set()
    assert fused.parts.keys() == ref.parts.keys() == {"loss_L", "loss_router", "loss_exits", *short, *hard}
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=0)
    for n in ref.parts:
        torch.testing.assert_close(fused.parts[n], ref.parts[n], rtol=RTOL.get(n, 1e-5), atol=0, msg=n)
    assert g_f.keys() == g_r.keys() and "router.fc2.weight" in g_r
    assert ("router.forecast.weight" in g_r) == bool(m.cfg.router_hard_gate)  # the forecast learns its labels
    for n in g_r:
        _close(g_f[n], g_r[n], 1e-5, n)
    L = m.net.cfg.loops
    if m.cfg.shortcut:
        assert fused.lm_heads == L + 1 and float(fused.loops_executed) == L + 2  # every exit's head; shortcut (1, 3)
    else:
        assert fused.lm_heads == L and float(fused.loops_executed) == L  # every exit's head, one pass
    assert float(fused.full.mean_depth) == L and float(fused.routed.mean_depth) < L  # runs all; routes fewer
    # the exits differ and pi weighs them: per token, the mixture lies strictly between its best and worst exit
    with torch.no_grad():
        ce = _exit_ce(m, m.net(x, exits=True).exits, y)[y != -1]  # (N, L)
    lo, hi = float(ce.min(-1).values.mean()), float(ce.max(-1).values.mean())
    assert hi - lo > 1e-3 and lo < float(fused.parts["loss_exits"]) < hi


@pytest.mark.parametrize(
    "key,value",
    [("router_exit_uniform", 1.0), ("router_exit_weights", "depth"), ("router_exit_weights", "depth_label")],
)
def test_the_networks_exit_weights_move_and_the_routers_gradient_does_not(key, value):
    """objective.router_exit_uniform=a: the exits' weights in the network's loss are (1 - a) pi_d + a / L;
    objective.router_exit_weights=depth: 1 at the exit of the depth the router gives the token, 0 elsewhere;
    depth_label: as depth, but 0 everywhere for a token whose hard-token target (its first exit whose loss is at
    most the batch's mean there (ratio 1), the last if none; recomputed here by hand) lies deeper than its routed
    depth; the objective reports which (`learnt_exit`, `withheld`). The router's gradient stays the expected loss's (and the hard target's) either way. The loss and every
    gradient are linear in the weights' value, so the setting against pi must differ by exactly
    sum_tau sum_d (w_d - sg(pi_d)) CE_d / N in value and network gradients, and not at all in the router's
    gradients (the network runs every loop whatever the router says)."""
    # ratio 1: about half the tokens are hard at each exit of an untrained net, whose losses are alike
    hard = ("objective.router_hard_weight=0.5", "objective.router_hard_ratio=1") if value == "depth_label" else ()
    m = _model("t-loopformer", *EXPECTED_RECIPE, "objective.lambda_short=0", "objective.lambda_align=0", *hard)
    with torch.no_grad():
        for layer in m.net.layers:
            layer.modulator[1].weight.normal_(0, 0.05)
    x, y = _batch()
    default = getattr(m.cfg, key)
    runs = {}
    for v in (default, value):
        setattr(m.cfg, key, v)
        runs[v] = (_run(m, x, y, True), _run(m, x, y, False))
    m.zero_grad()
    out = m.net(x, exits=True)
    pi = torch.softmax(out.router.logits.float(), -1).detach()
    ce = _exit_ce(m, out.exits, y)  # (B, T, L): 0 where not scored
    L = ce.shape[-1]
    if key == "router_exit_uniform":
        w = torch.full_like(pi, 1 / L)
    else:  # by hand: depth 1 + #{i >= 2 : p(i) = sum_{d >= i} pi_d > theta}
        cont = pi.flip(-1).cumsum(-1).flip(-1)[..., 1:]
        depth = 1 + (cont > m.net.cfg.router_threshold).sum(-1)
        assert len(set(depth[y != -1].tolist())) > 1  # the router spreads the scored tokens over several depths
        w = F.one_hot(depth - 1, L).float()
        if value == "depth_label":
            scored = y != -1
            is_hard = ce > ce.sum((0, 1)) / scored.sum()  # (B, T, L) ratio 1
            label = [[next((d for d in range(L) if not row[d]), L - 1) + 1 for row in r] for r in is_hard.tolist()]
            wait = (torch.tensor(label) > depth) & scored  # (B, T) the answers that wait for the router
            assert 0 < int(wait.sum()) < int((scored & (depth < L)).sum())  # some wait, some do not
            w = w * ~wait[..., None]
            for o, _ in runs[value]:  # what the objective reports: the exit each token was learnt at, the share
                assert torch.equal(o.learnt_exit, torch.where(scored & ~wait, depth, 0))
                assert float(o.stats["withheld"]) == pytest.approx(float(wait.sum() / scored.sum()))
        else:
            assert torch.equal(runs[value][0][0].learnt_exit, torch.where(y != -1, depth, 0))
    delta = ((w - pi) * ce).sum() / (y != -1).sum()
    delta.backward()
    g_delta = {n: p.grad.clone() for n, p in m.net.named_parameters() if p.grad is not None}
    assert float((w - pi)[y != -1].abs().max()) > 0.1  # the two weightings differ here ...
    assert max(float(g.abs().max()) for g in g_delta.values()) > 1e-3  # ... and so do the network's gradients
    for i in range(2):  # fused, plain
        (o0, g0), (o1, g1) = runs[default][i], runs[value][i]
        for got in (o1.parts["loss_exits"] - o0.parts["loss_exits"], o1.loss - o0.loss):  # fp32 losses ~10: 1e-6 off
            torch.testing.assert_close(got, delta.detach(), rtol=0, atol=1e-5)
        routers = [n for n in g0 if n.startswith("router.")]
        assert routers and set(g_delta).isdisjoint(routers)
        for n in routers:
            _close(g1[n], g0[n], 1e-5, n)
        for n in g_delta:
            _close(g1[n] - g0[n], g_delta[n], 1e-3, n)


def test_the_hard_labels_read_losses_bounded_at_chance(monkeypatch):
    """objective.router_hard_bound: the hard-token labels are computed from each exit's per-token loss bounded at
    ln(vocab_size), so the losses above chance (a perturbed net has many) enter the batch mean and the comparison
    as chance; the loss itself is not bounded."""
    from pipeline.model.router import Router

    seen = []
    real = Router.hard_labels
    monkeypatch.setattr(Router, "hard_labels", staticmethod(lambda ce, *a: seen.append(ce.clone()) or real(ce, *a)))
    x, y = _batch()
    outs = []
    for bound in ("false", "true"):
        m = _model(
            "t-loopformer", *EXPECTED_RECIPE, "objective.router_hard_weight=0.5", f"objective.router_hard_bound={bound}"
        )
        with torch.no_grad():
            m.net.lm_head.weight.mul_(30.0)  # confident wrong answers: many losses far above chance
        outs.append(_run(m, x, y, True)[0])
    free, bounded = seen
    assert float(free.max()) > math.log(V) + 1  # the case the bound is for
    torch.testing.assert_close(bounded, free.clamp_max(math.log(V)))
    assert float(outs[0].parts["loss_L"]) == float(outs[1].parts["loss_L"]) > math.log(V)  # the loss is not bounded


def test_which_answers_wait_the_forecasts_gate_does_not_decide_the_withhold_keys_do():
    """objective.router_exit_weights=depth_label withholds a token's loss by its hard-token label alone: the gate
    (objective.router_hard_gate) decides where the router sends a token, not what the network learns, so the same
    weights and batch withhold the same tokens with the gate shut nearly everywhere (an untrained forecast says ~0.5,
    below tau 0.9) as without it, while the router's hard target itself changes. objective.router_withhold_gate = g
    keeps, of those, the ones whose forecast at their routed exit exceeds g, and objective.router_withhold_learnt =
    e the ones at an exit where the batch's tokens that are not hard have a mean loss below e (recomputed here)."""
    m = _model(
        "base-loop-router",
        *EXPECTED_RECIPE,
        "model.exited_keys=frozen",
        "objective.router_hard_weight=0.5",
        "objective.router_hard_ratio=1",
        "objective.router_exit_weights=depth_label",
        "model.router_forecast=true",
        "objective.router_hard_gate=0.9",
    )
    x, y = _batch()
    gated = _run(m, x, y, True)[0]
    m.cfg.router_hard_gate = 0.0  # the same network, the labels ungated
    free = _run(m, x, y, True)[0]
    assert float(gated.withheld) > 0 and torch.equal(gated.learnt_exit, free.learnt_exit)
    assert float(gated.loss_hard) != float(free.loss_hard)  # the gate still shapes the router's target
    # objective.router_withhold_gate = g: of those, only where the forecast says hard at the routed exit above g
    with torch.no_grad():
        r = m.net(x, exits=True).router
        f = torch.sigmoid(m.net.router.hard_forecast(r).float())  # (B, T, L-1)
    waits = free.learnt_exit == 0
    waits &= y != -1
    routed = r.depth(m.net.cfg.loops, m.net.cfg.router_threshold)
    at = f.gather(-1, (routed - 1).clamp(max=f.shape[-1] - 1)[..., None])[..., 0]  # (B, T)
    g = float(at[waits].median())
    m.cfg.router_hard_gate, m.cfg.router_withhold_gate = 0.9, g  # (the config holds the forecast and gate together)
    gated_w = _run(m, x, y, True)[0]
    want = torch.where((y != -1) & ~(waits & (at > g)), routed, 0)
    assert 0 < int((waits & (at > g)).sum()) < int(waits.sum()) and torch.equal(gated_w.learnt_exit, want)
    # objective.router_withhold_learnt = e: only where the batch's scored tokens not hard at the routed exit have a
    # mean loss there below e (labels by hand at ratio 1: hard where above the batch's mean at that exit)
    m.cfg.router_withhold_gate = 0.0
    with torch.no_grad():
        ce = _exit_ce(m, m.net(x, exits=True).exits, y)  # (B, T, L): 0 where not scored
    easy = ((ce <= ce.sum((0, 1)) / (y != -1).sum()) & (y != -1)[..., None]).float()
    rest = (ce * easy).sum((0, 1)) / easy.sum((0, 1))  # (L,)
    seen = sorted(set(rest[routed[waits] - 1].tolist()))
    assert len(seen) > 1  # the waiting tokens sit at exits whose rest differ: e can split them
    e = (seen[0] + seen[1]) / 2
    m.cfg.router_withhold_learnt = e
    learnt = _run(m, x, y, True)[0]
    kept = waits & (rest[routed - 1] < e)
    assert 0 < int(kept.sum()) < int(waits.sum())
    assert torch.equal(learnt.learnt_exit, torch.where((y != -1) & ~kept, routed, 0))


def test_a_new_kind_waits_from_its_first_step_a_kind_seldom_hard_does_not():
    """objective.router_withhold_kind = g: of the answers the labels withhold, only those whose kind's running hard
    rate at the routed exit exceeds g wait. The table (`KindRates`, the objective's, not the network's) starts at 1,
    so on the first batch every kind is new and the labels alone decide; each batch then moves its kinds' rates
    toward their tokens' mean hard label (recomputed here token by token), and the next batch reads them (from a
    table set by hand). Its state
    goes out and back in whole; a table of another shape is a one-line error."""
    from pipeline.train.objective import KindRates

    args = [*EXPECTED_RECIPE, "model.exited_keys=frozen", "objective.router_hard_weight=0.5"]
    args += ["objective.router_hard_ratio=1", "objective.router_exit_weights=depth_label"]
    m = _model("base-loop-router", *args, "objective.router_withhold_kind=0.5", "objective.router_kind_buckets=61")
    m.kind_rates.decay = 0.25
    labels_only = Objective(m.net, m.cfg)
    labels_only.kind_rates = None
    x, y = _batch()
    scored = y != -1
    first = _run(m, x, y, True)[0]
    plain = _run(labels_only, x, y, True)[0]
    assert float(first.withheld) > 0 and torch.equal(first.learnt_exit, plain.learnt_exit)  # every kind new
    # the table by hand: bucket (position x vocab + token) mod 61, each scored kind's mean label at exits 1..L-1
    with torch.no_grad():
        ce = _exit_ce(m, m.net(x, exits=True).exits, y)
    hard = (ce > ce.sum((0, 1)) / scored.sum()) & scored[..., None]  # ratio 1
    L = hard.shape[-1]
    want = torch.ones(61, L - 1)
    by_kind = {}
    for b, t in scored.nonzero().tolist():
        by_kind.setdefault((t * V + int(x[b, t])) % 61, []).append(hard[b, t, :-1].float())
    for k, rows in by_kind.items():
        want[k] = 0.25 + 0.75 * torch.stack(rows).mean(0)
    assert torch.allclose(m.kind_rates.rate, want, atol=1e-6) and len(by_kind) < 61  # unseen kinds stay at 1
    # the next batch waits only where the labels say so and the kind's rate exceeds 0.5 (rates set here at random)
    rate = torch.rand(61, L - 1, generator=torch.Generator().manual_seed(2))
    m.kind_rates.rate.copy_(rate)
    second = _run(m, x, y, True)[0]
    routed = m.net(x, exits=True).router.depth(L, m.net.cfg.router_threshold)
    kinds = (torch.arange(x.shape[1]) * V + x) % 61
    at = rate[kinds].gather(-1, (routed - 1).clamp(max=L - 2)[..., None])[..., 0]  # (B, T)
    waits = plain.learnt_exit == 0
    waits &= scored
    kept = waits & (at > 0.5)
    assert 0 < int(kept.sum()) < int(waits.sum())
    assert torch.equal(second.learnt_exit, torch.where(scored & ~kept, routed, 0))
    # the objective's state: out and back in whole; another shape names the checkpoint
    other = Objective(m.net, m.cfg)
    other.load_state(m.state(), "ck")
    assert torch.equal(other.kind_rates.rate, m.kind_rates.rate) and labels_only.state() == {}
    other.kind_rates = KindRates(7, L, V, 0.25)
    with pytest.raises(
        ValueError, match=rf"^ck: its kind table is \(61, {L - 1}\), this run.s .* needs \(7, {L - 1}\)"
    ):
        other.load_state(m.state(), "ck")


def test_labels_against_each_exits_answers_and_the_kind_alone_deciding():
    """objective.router_hard_reference=routed: a token is hard at exit d when its loss there exceeds ratio x the mean
    loss of the scored tokens the router runs at depth d (the batch's at an exit that runs none), recomputed here and
    read through the kinds' table it updates; objective.router_withhold_kind_only: every scored answer the router
    runs short of the last loop waits where its kind's rate at its routed exit exceeds g, whatever its own label."""
    args = [*EXPECTED_RECIPE, "model.exited_keys=frozen", "objective.router_hard_weight=0.5"]
    args += ["objective.router_hard_ratio=1", "objective.router_exit_weights=depth_label"]
    args += [
        "objective.router_withhold_kind=0.5",
        "objective.router_kind_buckets=61",
        "objective.router_kind_decay=0.25",
    ]
    m = _model(
        "base-loop-router", *args, "objective.router_withhold_kind_only=true", "objective.router_hard_reference=routed"
    )
    x, y = _batch()
    scored = y != -1
    L = m.net.cfg.loops
    rate = torch.rand(61, L - 1, generator=torch.Generator().manual_seed(3))
    m.kind_rates.rate.copy_(rate)
    out = _run(m, x, y, True)[0]
    with torch.no_grad():
        r = m.net(x, exits=True)
        ce = _exit_ce(m, r.exits, y)
    routed = r.router.depth(L, m.net.cfg.router_threshold)
    kinds = (torch.arange(x.shape[1]) * V + x) % 61
    at = rate[kinds].gather(-1, (routed - 1).clamp(max=L - 2)[..., None])[..., 0]  # (B, T)
    short = scored & (routed < L)
    kept = short & (at > 0.5)
    assert 0 < int(kept.sum()) < int(short.sum())
    assert torch.equal(out.learnt_exit, torch.where(scored & ~kept, routed, 0))
    # the labels the table learnt: against the mean of each exit's own answers
    answers = F.one_hot(routed - 1, L).bool() & scored[..., None]  # (B, T, L)
    n = answers.sum((0, 1))
    batch_mean = ce.sum((0, 1)) / scored.sum()
    mean = torch.where(n > 0, (ce * answers).sum((0, 1)) / n.clamp_min(1), batch_mean)
    hard = (ce > mean) & scored[..., None]
    assert not torch.equal(hard, (ce > batch_mean) & scored[..., None])  # (the two references differ here)
    want = rate.clone()
    by_kind = {}
    for b, t in scored.nonzero().tolist():
        by_kind.setdefault(int(kinds[b, t]), []).append(hard[b, t, :-1].float())
    for k, rows in by_kind.items():
        want[k] = 0.25 * rate[k] + 0.75 * torch.stack(rows).mean(0)
    assert torch.allclose(m.kind_rates.rate, want, atol=1e-5)


def test_the_kinds_table_opens_the_routers_gate():
    """objective.router_kind_gate: the router's hard-token target acts where the forecast's gate is open (tau 0.9;
    an untrained forecast says ~0.5, so it is shut nearly everywhere) or the token's kind has a running hard rate
    above g at that exit (a table set by hand), recomputed here through `Router.hard_loss`; what waits is the same."""
    args = [*EXPECTED_RECIPE, "model.exited_keys=frozen", "objective.router_hard_weight=0.5"]
    args += ["objective.router_hard_ratio=1", "objective.router_exit_weights=depth_label"]
    args += ["model.router_forecast=true", "objective.router_hard_gate=0.9"]
    args += ["objective.router_withhold_kind=0.5", "objective.router_kind_buckets=61"]
    m = _model("base-loop-router", *args, "objective.router_kind_gate=true")
    x, y = _batch()
    scored = y != -1
    L = m.net.cfg.loops
    rate = torch.rand(61, L - 1, generator=torch.Generator().manual_seed(4))
    m.kind_rates.rate.copy_(rate)
    opened = _run(m, x, y, True)[0]
    m.kind_rates.rate.copy_(rate)
    m.cfg.router_kind_gate = False
    shut = _run(m, x, y, True)[0]
    assert float(opened.withheld) > 0 and torch.equal(opened.learnt_exit, shut.learnt_exit)
    with torch.no_grad():
        r = m.net(x, exits=True)
        ce = _exit_ce(m, r.exits, y)
        gate = torch.sigmoid(m.net.router.hard_forecast(r.router).float()) > 0.9  # (B, T, L-1)
        hard = (ce > ce.sum((0, 1)) / scored.sum()) & scored[..., None]  # ratio 1, the batch's mean
        hot = rate[(torch.arange(x.shape[1]) * V + x) % 61] > 0.5  # (B, T, L-1)
        want = m.net.router.hard_loss(r.router, hard, scored, gate | hot)
        without = m.net.router.hard_loss(r.router, hard, scored, gate)
    kept = [int(m.net.router.hard_target(hard, scored, gt)[1].sum()) for gt in (gate | hot, gate)]
    assert kept[0] > kept[1] and abs(float(want) - float(without)) > 0.1  # the table opens the gate for some
    assert math.isclose(float(opened.loss_hard), float(want), rel_tol=1e-5)
    assert math.isclose(float(shut.loss_hard), float(without), rel_tol=1e-5, abs_tol=1e-7)
