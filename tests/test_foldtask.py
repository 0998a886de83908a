"""bench/foldtask.py (the fold probe task): every answer recomputed by an independent solver, the level at the
predicting position, the oracle depth, and g a Latin square."""

import numpy as np

from bench.foldtask import SYM, W, doc_length, documents, levels, need, rule


def solve(doc, g):
    """Walks the raw ids: each W opens a segment; folds its cells left to right; the token after the last cell
    is the answer. Returns [(position of the last cell, its level, answer token)]."""
    doc, out, t = [int(v) for v in doc], [], 0
    while t < len(doc):
        assert doc[t] == W
        e = t + 1
        while e + 1 < len(doc) and doc[e + 1] != W:
            e += 1
        cells = [v - SYM for v in doc[t + 1 : e]]  # x_0 .. x_k; doc[e] is the answer
        y = cells[0]
        for x in cells[1:]:
            y = int(g[y][x])
        out.append((e - 1, len(cells) - 1, SYM + y))
        assert doc[e] == SYM + y
        t = e + 1
    return out


def test_answers_levels_and_need():
    g = rule(16, 3)
    L = 4
    docs = documents(g, np.random.default_rng(0), 50, L)
    assert docs.shape == (50, doc_length(L))
    lev, nd, nv = levels(L), need(L), need(L, visible=True)
    for doc in docs:
        found = solve(doc, g)
        assert [k for _, k, _ in found] == [1, 2, 3, 4]
        assert sorted(np.flatnonzero(lev)) == [p for p, _, _ in found]
        for p, k, _ in found:
            assert lev[p] == k and nd[p] == k  # the query needs exactly its level
            assert list(nd[p - k : p]) == list(range(1, k + 1))  # x_j is read in loop j + 1
            # exited tokens readable: x_j holds y_j after j loops (x_0 one loop), the query still k
            assert nv[p] == k and list(nv[p - k : p]) == [1] + list(range(1, k))
    assert ((nd >= 1) & (nd <= L)).all() and (nv <= nd).all() and nv[lev == 0].max() == L - 1


def test_rule_is_a_latin_square_and_not_associative():
    g = rule(16, 0)
    for row in [*g, *g.T]:
        assert sorted(row) == list(range(16))
    a = g[g[:, :, None], np.arange(16)[None, None, :]]  # g(g(x, y), z)
    b = g[np.arange(16)[:, None, None], g[None, :, :]]  # g(x, g(y, z))
    assert (a != b).mean() > 0.5
    assert not np.array_equal(rule(16, 0), rule(16, 1))
