"""source=depth-hops: determinism in the seed, the level marker at the predicting position, every label
recomputed by an independent solver from the document's own context, and the real `tlf prep-data` CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest

from data_prep.depthtask import MARK_BASE, SYM_BASE, doc_length, levels_at, make_document
from data_prep.shards import ShardReader
from data_prep.tokenizer import EOT


def solve(doc):
    """Independent solver: reads the pairs as a dict from the tokens, follows the pointer k times for each
    marker; returns [(marker position, k, answer)]."""
    doc = [int(t) for t in doc]
    assert doc[0] == EOT
    f, i = {}, 1
    while doc[i + 1] - MARK_BASE not in range(1, 65):  # pairs until the first query (x, marker, y)
        assert doc[i] not in f
        f[doc[i]] = doc[i + 1]
        i += 2
    out = []
    for p in range(i, len(doc)):
        k = doc[p] - MARK_BASE
        if 1 <= k <= 64:
            y = doc[p - 1]
            for _ in range(k):
                y = f[y]
            out.append((p, k, y))
    return out


def test_deterministic_in_seed():
    a, b = make_document(3, 5, 12, 4, 10), make_document(3, 5, 12, 4, 10)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, make_document(4, 5, 12, 4, 10))
    assert not np.array_equal(a, make_document(3, 6, 12, 4, 10))


@pytest.mark.parametrize("n,L,Q", [(16, 4, 16), (8, 6, 6), (30, 3, 20)])
def test_every_label_recomputed_and_marker_at_predicting_position(n, L, Q):
    for i in range(50):
        doc = make_document(11, i, n, L, Q)
        assert doc.size == doc_length(n, Q)
        sol = solve(doc)
        assert len(sol) == Q
        assert {k for _, k, _ in sol} == set(range(1, L + 1))  # every level in every document
        lev = levels_at(doc)
        assert np.count_nonzero(lev) == Q  # scored targets: exactly the answers
        for p, k, y in sol:
            assert lev[p] == k  # the position predicting the answer holds the marker naming the level
            assert int(doc[p + 1]) == y  # the label is f^k(x) as the solver computes it
            assert SYM_BASE <= y < SYM_BASE + n


def test_level_k_needs_k_steps():
    """An answer at level k differs from f^j(x) for some j < k in most queries (levels are not shortcuts)."""
    same = total = 0
    for i in range(40):
        doc = make_document(1, i, 16, 4, 16)
        f = {int(doc[j]): int(doc[j + 1]) for j in range(1, 33, 2)}
        for p, k, y in solve(doc):
            if k > 1:
                x = int(doc[p - 1])
                ys = [x]
                for _ in range(k - 1):
                    ys.append(f[ys[-1]])
                same += y in ys
                total += 1
    assert same / total < 0.3


def test_prep_data_cli_writes_shards_and_manifest(tmp_path):
    cmd = [sys.executable, "-m", "pipeline.cli", "prep-data", "--source", "depth-hops", "--out", str(tmp_path / "d"),
           "depth_docs=60", "seed=2", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["complete"] and m["depth_task"]["levels"] == 4
    toks = np.concatenate([np.asarray(ShardReader(tmp_path / "d" / s["name"]).tokens)
                           for s in m["splits"]["train"]["shards"]]).astype(np.int64)
    docs = [d for d in np.split(toks, np.flatnonzero(toks == EOT)[1:])]
    assert len(docs) == m["splits"]["train"]["docs"] == 57  # docs 0, 20, 40 go to val
    assert np.array_equal(docs[0], make_document(2, 1, 16, 4, 16))
    r2 = subprocess.run(cmd, capture_output=True, text=True)  # rerun: complete, nothing to do
    assert r2.returncode == 0 and "nothing to do" in r2.stderr
    r3 = subprocess.run(cmd[:-3] + ["depth_docs=61"], capture_output=True, text=True)
    assert r3.returncode != 0 and "--overwrite" in r3.stderr and "Traceback" not in r3.stderr
    bad = subprocess.run(cmd[:-3] + ["depth_queries=2"], capture_output=True, text=True)
    assert bad.returncode != 0 and "depth_queries" in bad.stderr and "Traceback" not in bad.stderr


def test_loader_scores_only_the_answers(tmp_path):
    """Shards stay plain tokens; the loader derives the loss mask from the markers (ignore index -1)."""
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare
    from pipeline.train.data import TrainLoader, ValLoader
    cfg = load_prep_config(None, {"source": "depth-hops", "out": str(tmp_path / "d"), "progress": False},
                           ["depth_docs=40", "depth_levels=3", "depth_queries=5", "depth_symbols=6"])
    prepare(cfg, log=lambda m: None)
    for loader in (TrainLoader(str(tmp_path / "d"), "train", 32, 4, 0, 1, 0, 50304),
                   next(ValLoader(str(tmp_path / "d"), "val", 32, 2, 0, 1, 50304).batches(1))):
        x, y = loader.next() if hasattr(loader, "next") else loader
        lev = levels_at(x.numpy())
        assert ((y != -1).numpy() == (lev > 0)).all() and (lev > 0).any()
        assert (y[y != -1] >= SYM_BASE).all() and (y[y != -1] < SYM_BASE + 6).all()
        # unmasked targets are the plain next tokens
        assert (x[:, 1:][y[:, :-1] != -1] == y[:, :-1][y[:, :-1] != -1]).all()
