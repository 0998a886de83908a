"""The fused, chunked LM-head objective (pipeline/model/head_loss.py, docs/design.md §7) equals the plain path of
materialised logits + F.cross_entropy + F.mse_loss: loss, parts and every parameter's gradient, over several
chunks, with ignored targets, under bf16, and keeps no (B, T, V) tensor for backward nor reads the host."""

from pathlib import Path


import pytest
import torch
import torch.nn.functional as F

from helpers import RECIPE, spread_router
from pipeline.config import load_config
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
    ("loopformer", ("objective.align_positions=scored",)),
    ("t-loopformer", ("objective.align_positions=scored",)),
    ("t-loopformer", tuple(RECIPE["budget"])),
]


def _model(variant, *extra, dtype=torch.float32):
    """The training objective (the network is its `.net`) of a tiny preset with perturbed weights; `_run` starts
    each run from its recipe's state as it is now (the kinds' table: every run reads the same)."""
    torch.manual_seed(0)
    cfg = load_config(f"tiny/{variant}", list(extra))
    m = LoopedLM(cfg.model)
    with torch.no_grad():  # non-zero modulators: loops differ
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # a spread router (depths 1..3 here) that is not saturated: a saturated softmax's gradient is all rounding
    obj = Objective(spread_router(m, 0, scale=1.0).to(dtype).train(), cfg.objective)
    obj.start = obj.state()
    return obj


def _batch(B=2, T=20, ignored=5):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    y[0, :ignored] = -1
    return x, y


def _run(m, x, y, fused, autocast=False):
    m.zero_grad()
    m.load_state(m.start, "start")
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
    router = {"loss_router"} if m.cfg.router.recipe == "budget" else set()
    want = ({"loss_L", "loss_S", "loss_align"} if m.cfg.shortcut else {"loss_L"}) | router
    assert fused.parts.keys() == ref.parts.keys() == want
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=0)
    for n in ref.parts:
        torch.testing.assert_close(fused.parts[n], ref.parts[n], rtol=RTOL.get(n, 1e-5), atol=0, msg=n)
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
    """`head_rows` (the per-token losses the kinds recipe reads before the weighted heads
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
    "variant,recipe,extra",
    [
        ("t-loopformer", "expected", ()),
        ("t-loopformer", "expected", ("model.exited_keys=frozen",)),
        ("base-loop-router", "expected", ("model.exited_keys=frozen",)),  # no shortcut pass, no modulation
        ("t-loopformer", "kinds", ()),
        ("base-loop-router", "kinds", ("model.exited_keys=frozen",)),
    ],
)
def test_exit_recipes_fused_equal_the_plain_path(variant, recipe, extra, monkeypatch):
    """The exit recipes' objective (pipeline/train/objective.py): every exit's cross-entropy weighted by the
    recipe's weights (expected: the router's pi; kinds: 1 at the routed exit, pi's gradient) through the fused head,
    over several chunks, equals the materialised sum_d w_d CE_d: the loss, its parts and every gradient, the
    router's included (its only task gradient is through the weights). The kinds recipe's hard target reads the
    per-token losses of each exit either way; its forecast learns its labels."""
    m = _model(variant, *RECIPE[recipe], *extra)
    with torch.no_grad():  # modulators away from zero: each exit's state and loss differ
        for layer in m.net.layers:
            if hasattr(layer, "modulator"):
                layer.modulator[1].weight.normal_(0, 0.05)
    x, y = _batch()
    monkeypatch.setattr(head_loss, "rows_per_chunk", lambda V_, dev: 7)
    fused, g_f = _run(m, x, y, True)
    ref, g_r = _run(m, x, y, False)
    short = {"loss_S", "loss_align"} if m.cfg.shortcut else set()  # base-loop-router: no shortcut pass
    hard = {"loss_hard", "loss_forecast"} if recipe == "kinds" else set()
    assert fused.parts.keys() == ref.parts.keys() == {"loss_L", "loss_router", "loss_exits", *short, *hard}
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=0)
    for n in ref.parts:
        torch.testing.assert_close(fused.parts[n], ref.parts[n], rtol=RTOL.get(n, 1e-5), atol=0, msg=n)
    assert g_f.keys() == g_r.keys() and "router.fc2.weight" in g_r
    assert ("router.forecast.weight" in g_r) == (recipe == "kinds")  # the forecast learns its labels
    for n in g_r:
        _close(g_f[n], g_r[n], 1e-5, n)
    L = m.net.cfg.loops
    if m.cfg.shortcut:
        assert fused.lm_heads == L + 1 and float(fused.loops_executed) == L + 2  # every exit's head; shortcut (1, 3)
    else:
        assert fused.lm_heads == L and float(fused.loops_executed) == L  # every exit's head, one pass
    assert float(fused.full.mean_depth) == L and float(fused.metrics["routed/mean_depth"]) < L  # runs all; routes fewer
    if recipe == "expected":  # the exits differ and pi weighs them: the mixture lies between the best and worst exit
        with torch.no_grad():
            ce = _exit_ce(m, m.net(x, exits=True).exits, y)[y != -1]  # (N, L)
        lo, hi = float(ce.min(-1).values.mean()), float(ce.max(-1).values.mean())
        assert hi - lo > 1e-3 and lo < float(fused.parts["loss_exits"]) < hi
