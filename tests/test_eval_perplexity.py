"""Perplexity on validation shards against a brute-force per-token computation; windows; depth statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from data_prep.shards import write_shard
from evaluation.perplexity import TokenStream, make_windows, perplexity
from helpers import perturbed_tiny as tiny


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    d = tmp_path_factory.mktemp("val")
    rng = np.random.default_rng(0)
    write_shard(d / "demo_val_000000.bin", rng.integers(0, 50257, 100))
    write_shard(d / "demo_val_000001.bin", rng.integers(0, 50257, 81))  # the stream spans two shards
    return TokenStream(d, "val")


@torch.no_grad()
def brute_nll(model, toks, M, T, S):
    """Per-target NLL: target j (1..n-1) predicted from the window that covers it, one forward per window,
    per-token log_softmax of the full logits (no batching, no padding)."""
    n = toks.numel()
    nll, dep = {}, {}
    s = 0
    while len(nll) < n - 1:
        e = min(s + T, n - 1)
        out = model(toks[s:e][None], loops=M)
        lp = out.logits[0].float().log_softmax(-1)
        for p in range(e - s):
            j = s + p + 1
            if j not in nll:
                nll[j] = -float(lp[p, toks[j]])
                dep[j] = int(out.depth[0, p])
        s += S
    return nll, dep


def test_windows_cover_every_target_once():
    for n, T, S in [(181, 64, 0), (181, 64, 16), (65, 64, 0), (2, 64, 0), (200, 64, 64), (130, 64, 63)]:
        w = make_windows(n, T, S)
        covered = []
        for s, ln, f in zip(w.starts, w.lengths, w.first_scored):
            assert 1 <= ln <= T
            covered += [s + p + 1 for p in range(f, ln)]
        assert covered == list(range(1, n))
    w = make_windows(181, 64, 16)
    assert w.first_scored[1:] == [48] * (len(w.starts) - 1)  # after the first window: >= T - stride context


@pytest.mark.parametrize("stride", [0, 24])
def test_perplexity_equals_brute_force(stream, stride):
    m, cfg = tiny()
    T = cfg.model.block_size
    for M in (2, 4):
        res = perplexity(m, stream, M, stride=stride, batch_size=2)
        nll, dep = brute_nll(m, stream.read(0, stream.num_tokens), M, T, stride or T)
        assert res["tokens"] == 180 == len(nll)
        mean = sum(nll.values()) / len(nll)
        assert res["mean_nll"] == pytest.approx(mean, abs=1e-5)
        assert res["ppl"] == pytest.approx(math.exp(mean), rel=1e-5)
        assert res["protocol"] == ("sliding" if stride else "non-overlapping")
        d = res["depth"]
        counts = np.bincount(list(dep.values()), minlength=M + 1)[1:]
        assert d["counts"] == counts.tolist() and sum(d["share"]) == pytest.approx(1.0)
        assert d["mean"] == pytest.approx(np.mean(list(dep.values())))
        for k in range(1, M + 1):
            sel = [nll[j] for j in nll if dep[j] == k]
            assert (
                (d["ppl"][k - 1] is None)
                if not sel
                else d["ppl"][k - 1] == pytest.approx(math.exp(np.mean(sel)), rel=1e-5)
            )


def test_budget_changes_perplexity_for_looped_models_not_depth_for_others(stream):
    m, _ = tiny()
    a, b = perplexity(m, stream, 2), perplexity(m, stream, 4)
    assert abs(a["ppl"] - b["ppl"]) > 1e-3 * a["ppl"]
    assert a["depth"]["mean"] <= 2 < b["depth"]["mean"]  # the router clips at M
    lf, _ = tiny("tiny/loopformer")  # no router: every token runs M loops
    r = perplexity(lf, stream, 3)
    assert r["depth"]["share"] == [0.0, 0.0, 1.0] and r["depth"]["mean"] == 3.0


def test_max_tokens_limits_the_stream(stream, tmp_path):
    s = TokenStream(stream.dir, "val", max_tokens=50)
    assert s.num_tokens == 51 and s.read(0, 51).tolist() == stream.read(0, 51).tolist()
    m, _ = tiny("tiny/base")
    assert perplexity(m, s, 1)["tokens"] == 50
