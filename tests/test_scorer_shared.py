"""Scoring that shares contexts (tree packing) against the unshared path and against unpacked forwards."""

from __future__ import annotations

import pytest
import torch

from evaluation.forward import hidden_states
from evaluation.scorer import Scorer, encode_pair
from helpers import perturbed_tiny, spread_router

from bench.testkit import count_forwards

CASES = [
    ("tiny/t-loopformer", True),
    ("tiny/t-loopformer", False),
    ("tiny/loopformer", True),
    ("tiny/loopformer", False),
    ("tiny/base", True),
]


def model_for(name: str, gather_scatter: bool):
    m, cfg = perturbed_tiny(name, overrides=() if gather_scatter else ("model.execution=dense",))
    if m.router is not None:
        spread_router(m)
    return m, cfg


def requests(seed: int = 3) -> list[tuple[list[int], list[int]]]:
    """Contexts with several choices of different lengths (and repeated one-token choices), choices sharing
    leading tokens, an identical request, an empty context (EOT), requests longer than block_size 64: truncated
    ones whose continuations have equal lengths (one shared truncated prefix) and different lengths (no
    sharing), and a context with more branch tokens than block_size (two rows)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, 50257, (n,), generator=g).tolist()
    c1, c2, c3, long1, long2 = r(12), r(30), r(5), r(80), r(60)
    one = r(1)
    reqs = [
        (c1, one),
        (c1, r(3)),
        (c1, r(7)),
        (c1, r(1)),
        (c1, one),
        (c2, r(2)),
        (c2, r(5)),
        (c2, r(11)),
        encode_pair("", " hello world"),
        encode_pair("", " hi"),
        (long1, r(4)),
        (long1, r(4)),
        (long1, r(9)),
        (long2, r(3)),
        (long2, r(6)),
        (r(70), r(70)),
    ]
    reqs += [(c3, r(20)) for _ in range(5)]  # 95 branch tokens after one prefix: more than one row
    lead = r(3)
    reqs += [(c2, lead + r(4)), (c2, lead[:1] + r(5)), (c2, lead + r(2))]  # shared leading tokens: one trie
    reqs.append(reqs[1])  # an identical request
    return reqs


@pytest.mark.parametrize("name,gs", CASES)
def test_shared_scores_equal_unshared(name, gs):
    m, cfg = model_for(name, gs)
    reqs = requests()
    L = cfg.model.loops
    for M in sorted({1, max(1, L // 2), L}):
        base = Scorer(m, batch_size=4, share_context=False).score(reqs, M)
        for bs in (1, 3):
            sc = Scorer(m, batch_size=bs)
            got = sc.score(reqs, M)
            for (ctx, cont), a, b in zip(reqs, base, got):
                assert b.logprob == pytest.approx(a.logprob, abs=1e-5), (len(ctx), len(cont), M, bs)
                assert b.greedy == a.greedy and b.n_tokens == a.n_tokens
    # the sharing is real: a 12-token context with choices of 1, 3 and 7 tokens runs 12 + 0 + 2 + 6 token
    # slots in one row instead of 12 + 14 + 18 in three
    three = reqs[:3]
    for share, tokens, rows in ((False, 44, 3), (True, 20, 1)):
        with count_forwards(m) as n:
            Scorer(m, batch_size=1, share_context=share).score(three, 1)
        assert (n["tokens"], n["forwards"]) == (tokens, rows)
    # branches that share leading tokens share trie nodes: (5,6,7), (5,8,7) and (5,6,7) again are 5 nodes
    ctx = reqs[0][0]
    tri = [(ctx, [5, 6, 7, 9]), (ctx, [5, 8, 7, 9]), (ctx, [5, 6, 7, 2])]
    for share, tokens, rows in ((False, 30, 2), (True, 17, 1)):
        with count_forwards(m) as n:
            Scorer(m, batch_size=1, share_context=share).score(tri, 1)
        assert (n["tokens"], n["forwards"]) == (tokens, rows)


def test_greedy_flags_vary():
    """The equality above is not vacuous: some continuations are greedy (contexts ending in their first token's
    argmax), some are not."""
    m, _ = model_for("tiny/t-loopformer", True)
    ctx = requests()[0][0]
    h, _ = hidden_states(m, torch.tensor([ctx]), 4)
    top = int(m.head(h[0, -1])[0].argmax())
    reqs = [(ctx, [top]), (ctx, [top + 1]), (ctx, [top, 5])]
    for share in (True, False):
        got = Scorer(m, 2, share_context=share).score(reqs, 4)
        assert [s.greedy for s in got[:2]] == [True, False]


def test_greedy_is_argmax_on_ties():
    """Two vocabulary rows made equal (tied head): both tokens reach the maximum, argmax (the harness's greedy
    test) picks the lower index, so only that one is greedy."""
    m, _ = model_for("tiny/loopformer", True)
    ctx = requests()[0][0]
    hf = m.head(hidden_states(m, torch.tensor([ctx]), 4)[0][0, -1])[1]  # (d,) final-normed state
    low, top = 3, 11
    with torch.no_grad():  # both rows 10 * hf: logit 10 |hf|^2, far above every other token's
        m.lm_head.weight[low] = m.lm_head.weight[top] = 10 * hf
    for share in (True, False):
        got = Scorer(m, 2, share_context=share).score([(ctx, [top]), (ctx, [low])], 4)
        assert [s.greedy for s in got] == [False, True]
        assert got[0].logprob == got[1].logprob


@pytest.mark.parametrize("gs", [True, False])
def test_packed_row_equals_unpacked_rows(gs):
    """LoopedLM.hidden_states with positions and a tree mask: every token's state and depth equal those of its
    own unpacked row (prefix + its branch), with token depths spread over 1..L."""
    m, cfg = model_for("tiny/t-loopformer", gs)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 50257, (9,), generator=g)
    brs = [torch.randint(0, 50257, (n,), generator=g) for n in (4, 1, 6)]
    idx = torch.cat([prefix] + brs)[None]  # (1, 20)
    pos = torch.cat([torch.arange(9)] + [torch.arange(9, 9 + len(b)) for b in brs])[None]
    seg = torch.cat([torch.zeros(9, dtype=torch.long)] + [torch.full((len(b),), k) for k, b in enumerate(brs, 1)])
    mask = ((seg[None, :] == 0) | (seg[None, :] == seg[:, None])) & torch.ones(20, 20, dtype=torch.bool).tril()
    for M in (2, 4):
        h, depth = hidden_states(m, idx, M, pos, mask[None])
        if M == 4:
            assert len(set(depth[0].tolist())) >= 3
        st = 9
        for b in brs:
            hb, db = hidden_states(m, torch.cat([prefix, b])[None], M)
            sl = list(range(9)) + list(range(st, st + len(b)))
            assert torch.allclose(h[0, sl], hb[0], atol=1e-5)
            assert torch.equal(depth[0, sl], db[0])
            st += len(b)


def test_empty_inputs_are_clear_errors():
    m, _ = model_for("tiny/base", True)
    with pytest.raises(ValueError, match="empty context"):
        Scorer(m).score([([], [1, 2])], 1)
    with pytest.raises(ValueError, match="empty continuation"):
        Scorer(m).score([([1], [])], 1)
