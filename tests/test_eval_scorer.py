"""Batched scoring against a brute-force per-request forward; the harness pair encoding; acc / acc_norm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.testkit import count_forwards
from evaluation.forward import hidden_states, logits_at
from evaluation.scorer import Scored, Scorer, encode_pair, mean_stderr, task_metrics
from evaluation.tasks import Example, TaskData
from data_prep.tokenizer import EOT, encode
from helpers import perturbed_tiny as tiny


@pytest.fixture(scope="module")
def tlf():
    return tiny()


def test_encode_pair_follows_the_harness():
    ctx, cont = encode_pair("Question: 2+2?\nAnswer:", " four")
    assert ctx == encode("Question: 2+2?\nAnswer:") and ctx + cont == encode("Question: 2+2?\nAnswer: four")
    # trailing context spaces move to the continuation
    c2, k2 = encode_pair("The man turned on the faucet therefore ", " water")
    assert c2 == encode("The man turned on the faucet therefore") and c2 + k2 == encode(
        "The man turned on the faucet therefore  water"
    )
    assert encode_pair("", " hello") == ([EOT], encode(" hello"))


@pytest.mark.parametrize("name", ["tiny/t-loopformer", "tiny/base"])
def test_hidden_states_equal_the_model_forward(name):
    m, cfg = tiny(name)
    idx = torch.randint(0, 50257, (3, 20))
    for M in sorted({1, cfg.model.loops}):
        out = m(idx, loops=M)
        h, depth = hidden_states(m, idx, M)
        assert torch.allclose(logits_at(m, h), out.logits.float(), atol=1e-5)
        assert torch.equal(depth, out.depth)


@torch.no_grad()
def brute(model, ctx, cont, M):
    """One unpadded forward of the whole request; sum of log p over the continuation; greedy flag."""
    T = model.cfg.block_size
    seq = (ctx + cont)[-(T + 1) :]
    inp = torch.tensor(seq[:-1])[None]
    lp = model(inp, loops=M).logits[0].float().log_softmax(-1)
    n = min(len(cont), len(seq) - 1)
    tg = torch.tensor(seq[-n:])
    rows = lp[-n:]
    return float(rows.gather(-1, tg[:, None]).sum()), bool((rows.argmax(-1) == tg).all())


def test_batched_scores_equal_brute_force(tlf):
    m, cfg = tlf
    g = torch.Generator().manual_seed(3)
    r = lambda n: torch.randint(0, 50257, (n,), generator=g).tolist()
    shared = r(12)
    reqs = [
        (shared, r(1)),
        (shared, r(1)),
        (shared, r(3)),
        (r(5), r(2)),
        (r(30), r(7)),
        ([EOT], r(4)),
        (r(80), r(5)),  # longer than block_size (64): left-truncated
        (shared, r(1)),
    ]
    reqs.append(reqs[0])  # an identical request
    sc = Scorer(m, batch_size=3)
    for M in (1, 2, 4):
        got = sc.score(reqs, M)
        for (ctx, cont), s in zip(reqs, got):
            lp, greedy = brute(m, ctx, cont, M)
            assert s.logprob == pytest.approx(lp, abs=2e-4)
            assert s.greedy == greedy and s.n_tokens == min(len(cont), 64)
    # unshared: requests with one-token continuations after the same context share one input (6 distinct
    # inputs); shared: every request after `shared` joins one row (5 rows)
    for share, rows in ((False, 6), (True, 5)):
        with count_forwards(m) as n:
            Scorer(m, batch_size=1, share_context=share).score(reqs, 2)
        assert n["forwards"] == rows


def test_budget_changes_scores_of_looped_models_only(tlf):
    m, _ = tlf
    reqs = [(encode("The cat sat on the"), encode(" mat")), (encode("Paris is the capital of"), encode(" France"))]
    sc = Scorer(m, 4)
    a, b = sc.score(reqs, 2), sc.score(reqs, 4)
    assert any(abs(x.logprob - y.logprob) > 1e-3 for x, y in zip(a, b))
    base, _ = tiny("tiny/base")
    with pytest.raises(ValueError, match="loop budget 2 must lie in 1..1"):
        Scorer(base, 4).score(reqs, 2)


def test_acc_and_acc_norm_by_hand():
    # choice 0 is short and likely per token-sum, choice 1 long and likely per character
    exs = [
        Example("a", "ctx", ["ab", "abcdefghij"], 1),
        Example("b", "ctx", ["ab", "abcdefghij"], 0),
        Example("c", "ctx", ["xyz", "x"], 1),
    ]
    lls = [-2.0, -5.0, -2.0, -5.0, -6.0, -4.0]
    scored = [Scored(v, False, 1) for v in lls]
    td = TaskData("t", exs, "test", "unit")
    res = task_metrics(td, "mc", ("acc", "acc_norm"), scored, [(0, 2), (2, 4), (4, 6)])
    # acc: argmax lls -> 0, 0, 1 ; acc_norm: argmax lls/len -> (-1, -0.5) 1 ; 1 ; (-2, -4) 0
    assert res["acc"] == pytest.approx(2 / 3) and res["acc_norm"] == pytest.approx(1 / 3)
    assert res["acc_stderr"] == pytest.approx(math.sqrt(np.var([0, 1, 1], ddof=1) / 3))
    assert res["acc_norm_stderr"] == pytest.approx(mean_stderr([1, 0, 0]))
    only_acc = task_metrics(td, "mc", ("acc",), scored, [(0, 2), (2, 4), (4, 6)])
    assert "acc_norm" not in only_acc


def test_lambada_metrics_by_hand():
    exs = [Example(str(i), "c", ["w"], 0) for i in range(3)]
    scored = [Scored(-1.0, True, 1), Scored(-2.0, False, 2), Scored(-3.0, True, 1)]
    res = task_metrics(
        TaskData("lambada_openai", exs, "test", "unit"),
        "lambada",
        ("perplexity", "acc"),
        scored,
        [(0, 1), (1, 2), (2, 3)],
    )
    assert res["acc"] == pytest.approx(2 / 3)
    assert res["perplexity"] == pytest.approx(math.exp(2.0))
