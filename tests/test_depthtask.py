"""source=depth-hops: determinism in the seed, the level at the predicting position, every label recomputed by
an independent solver from the document's own context, the need of every token, and the real `tlf prep-data` CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

from data_prep.depthtask import ASK, BOS, doc_length, layout, levels_at, make_document, mean_need, need_at
from data_prep.shards import ShardReader


def solve(doc, R, L):
    """Independent solver from the raw token ids: reads the parent array, walks from each query's start until a
    node is its own parent and counts the steps; returns [(query position, steps, answer token)]."""
    doc = [int(t) for t in doc]
    n = R * (L + 1)
    assert doc[0] == BOS
    parent = [t - 16 for t in doc[1 : 1 + n]]  # symbol s is token 16 + s
    out = []
    for p in range(2 + n, len(doc), 3):
        assert doc[p - 1] == ASK
        steps, y = 0, doc[p] - 16
        while parent[y] != y:
            y, steps = parent[y], steps + 1
        out.append((p, steps, 16 + y))
    return out


def test_deterministic_in_seed():
    a, b = make_document(3, 5, 8, 4, 4), make_document(3, 5, 8, 4, 4)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, make_document(4, 5, 8, 4, 4))
    assert not np.array_equal(a, make_document(3, 6, 8, 4, 4))


@pytest.mark.parametrize("order", ["far", "near"])
@pytest.mark.parametrize("R,L,Q", [(6, 4, 4), (5, 6, 5), (12, 3, 7)])
def test_every_label_recomputed_and_level_at_predicting_position(R, L, Q, order):
    lay = layout(R, L, order)
    for i in range(50):
        doc = make_document(11, i, R, L, Q, order)
        assert doc.size == doc_length(R, L, Q) and doc.max() < lay["vocab_needed"]
        sol = solve(doc, R, L)
        assert len(sol) == Q
        ks = [k for _, k, _ in sol]
        assert len(set(ks[:L])) == min(Q, L) and set(ks) <= set(range(1, L + 1))  # each block of L: distinct levels
        lev = levels_at(doc, lay)
        assert np.count_nonzero(lev) == Q  # scored targets: exactly the answers
        for p, k, y in sol:
            assert lev[p] == k  # the start's label names the level, and the level is the steps to the root
            assert int(doc[p + 1]) == y  # the label is the root, as the solver walks to it
        assert len({y for *_, y in sol}) == Q  # one query per chain: no answer repeats


def test_no_entry_sees_its_parents_entry():
    """No pointer doubling under causal attention: every non-root entry comes before its parent's entry."""
    for i in range(30):
        doc = make_document(2, i, 8, 4, 4)
        parent = doc[1:41] - 16
        for a, b in enumerate(parent):
            assert b == a or b > a


def test_near_order_puts_every_parent_before_its_child():
    """order="near" (pointer doubling allowed): every non-root entry comes after its parent's entry, and the
    same seed draws the same chains under new labels (the two orders are one task, numbered two ways)."""
    for i in range(30):
        near, far = make_document(2, i, 8, 4, 4, "near"), make_document(2, i, 8, 4, 4, "far")
        parent = near[1:41] - 16
        assert all(b == a or b < a for a, b in enumerate(parent))
        assert [k for _, k, _ in solve(near, 8, 4)] == [k for _, k, _ in solve(far, 8, 4)]


def test_an_unknown_label_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        make_document(0, 0, 4, 2, 2, "nearest")
    with pytest.raises(ValueError, match="order must be one of"):
        layout(4, 2, "Far")


def test_chains_are_drawn_per_document():
    """Which node is whose parent changes from document to document (the chains exist only in the context)."""
    arrays = {tuple(make_document(0, i, 8, 4, 4)[1:41]) for i in range(20)}
    assert len(arrays) == 20


def test_need_and_mean_need():
    R, L, Q = 8, 4, 4
    lay = layout(R, L)
    docs = np.stack([make_document(5, i, R, L, Q) for i in range(10)])
    need = need_at(docs, lay)
    for doc, nd in zip(docs, need):
        parent = doc[1:41] - 16
        for a in range(40):  # an entry is needed until the loop in which a level-L query reads it
            d, y = 0, a
            while parent[y] != y:
                y, d = parent[y], d + 1
            assert nd[1 + a] == (L - d + 1 if d >= 1 else 1)
        for p, k, _ in solve(doc, R, L):
            assert nd[p] == k and nd[p - 1] == 1 and nd[p + 1] == 1
    assert abs(need.mean() - mean_need(R, L, Q)) < 1e-9  # every level once per document here


def test_prep_data_cli_writes_shards_and_manifest(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "prep-data",
        "--source",
        "depth-hops",
        "--out",
        str(tmp_path / "d"),
        "depth_docs=60",
        "seed=2",
        "--no-progress",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["complete"] and m["depth_task"]["levels"] == 4
    toks = np.concatenate(
        [np.asarray(ShardReader(tmp_path / "d" / s["name"]).tokens) for s in m["splits"]["train"]["shards"]]
    ).astype(np.int64)
    docs = toks.reshape(-1, doc_length(6, 4, 4))
    assert len(docs) == 57  # docs 0, 20, 40 go to val
    assert np.array_equal(docs[0], make_document(2, 1, 6, 4, 4))
    r2 = subprocess.run(cmd, capture_output=True, text=True)  # rerun: complete, nothing to do
    assert r2.returncode == 0 and "nothing to do" in r2.stderr
    r3 = subprocess.run(cmd[:-3] + ["depth_docs=61"], capture_output=True, text=True)
    assert r3.returncode != 0 and "--overwrite" in r3.stderr and "Traceback" not in r3.stderr
    bad = subprocess.run(cmd[:-3] + ["depth_queries=9"], capture_output=True, text=True)
    assert bad.returncode != 0 and "depth_queries" in bad.stderr and "Traceback" not in bad.stderr


def test_loader_scores_only_the_answers(tmp_path):
    """Shards stay plain tokens; the loader derives the loss mask from the markers (ignore index -1)."""
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare
    from pipeline.train.data import TrainLoader, ValLoader

    cfg = load_prep_config(
        None,
        {"source": "depth-hops", "out": str(tmp_path / "d"), "progress": False},
        ["depth_docs=40", "depth_levels=3", "depth_queries=3", "depth_chains=4"],
    )
    prepare(cfg, log=lambda m: None)
    for loader in (
        TrainLoader(str(tmp_path / "d"), "train", 32, 4, 0, 1, 0, 50304),
        next(ValLoader(str(tmp_path / "d"), "val", 32, 2, 0, 1, 50304).batches(1)),
    ):
        x, y = loader.next() if hasattr(loader, "next") else loader
        lev = levels_at(x.numpy(), layout(4, 3))
        assert ((y != -1).numpy() == (lev > 0)).all() and (lev > 0).any()
        assert (y[y != -1] >= 16).all() and (y[y != -1] < 16 + 16).all()  # answers are symbols
        # unmasked targets are the plain next tokens
        assert (x[:, 1:][y[:, :-1] != -1] == y[:, :-1][y[:, :-1] != -1]).all()


@pytest.mark.parametrize("source,opts", [("depth-hops", []), ("depth-fold", ["fold_layout=slots", "fold_symbols=8"])])
def test_worker_processes_write_the_same_bytes(tmp_path, monkeypatch, source, opts):
    """prep-data's `workers` make a synthetic source's documents in chunks, in order: shards and manifest are the
    bytes one process writes (here 9 chunks of 7 documents across 2 processes)."""
    from data_prep import depthtask
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare

    monkeypatch.setattr(depthtask, "CHUNK_DOCS", 7)
    files = {}
    for w in (0, 2):
        out = tmp_path / f"w{w}"
        cfg = load_prep_config(
            None, {"source": source, "out": str(out), "progress": False}, ["depth_docs=60", f"workers={w}", *opts]
        )
        prepare(cfg, log=lambda m: None)
        files[w] = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".json")}
    assert files[0] == files[2] and any(n.endswith(".bin") for n in files[0])
