"""data_prep/foldtask.py (the fold task; `tlf prep-data --source depth-fold`): every answer recomputed by an
independent solver, the level at the predicting position (by position, and from the openers in any window), the
oracle depth, g a Latin square, and the source's shards: deterministic in the seed, scored by the loader only at
the answers."""

import json
import subprocess
import sys

import numpy as np
import pytest

from data_prep.foldtask import (
    PAD,
    SYM,
    W,
    doc_length,
    documents,
    layout,
    levels,
    levels_at,
    make_document,
    need,
    rule,
    slot_length,
    slot_need,
)


def solve(doc, g, typed=False):
    """Walks the raw ids: each opener (an id below SYM: W, or the source's W_k) opens a segment; folds its cells
    left to right; the token after the last cell is the answer. Returns [(position of the last cell, its level,
    answer token)]. typed: the cells after the first are input tokens SYM + m + x."""
    doc, out, t, m = [int(v) for v in doc], [], 0, len(g)
    while t < len(doc):
        if doc[t] == PAD:  # the slots layout's filler after an answer
            t += 1
            continue
        assert doc[t] < SYM
        e = t + 1
        while e + 1 < len(doc) and doc[e + 1] >= SYM:
            e += 1
        cells = [v - SYM for v in doc[t + 1 : e]]  # x_0 .. x_k; doc[e] is the answer
        if typed:
            assert cells[0] < m and all(m <= c < 2 * m for c in cells[1:])
            cells = cells[:1] + [c - m for c in cells[1:]]
        assert max(cells) < m and doc[e] < SYM + m
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
        assert [int(doc[p - k - 1]) for p, k, _ in found] == [1, 2, 3, 4]  # segment k opens with W_k = k
        assert sorted(np.flatnonzero(lev)) == [p for p, _, _ in found]
        for p, k, _ in found:
            assert lev[p] == k and nd[p] == k  # the query needs exactly its level
            assert list(nd[p - k : p]) == list(range(1, k + 1))  # x_j is read in loop j + 1
            # exited tokens readable: x_j holds y_j after j loops (x_0 one loop), the query still k
            assert nv[p] == k and list(nv[p - k : p]) == [1] + list(range(1, k))
    assert ((nd >= 1) & (nd <= L)).all() and (nv <= nd).all() and nv[lev == 0].max() == L - 1


def quadrangle_violations(g) -> int:
    """How often g breaks the quadrangle criterion (a Latin square is an isotope of a group iff it never does):
    g(a, c) = g(a', c'), g(a, d) = g(a', d') and g(b, c) = g(b', c') must give g(b, d) = g(b', d')."""
    m = len(g)
    col_of = np.argsort(g, axis=1)  # col_of[r, s]: the column holding s in row r
    row_of = np.argsort(g, axis=0)  # row_of[s, c]: the row holding s in column c
    a, a2, c, d, b = np.meshgrid(*[np.arange(m)] * 5, indexing="ij")
    c2 = col_of[a2, g[a, c]]
    d2 = col_of[a2, g[a, d]]
    b2 = row_of[g[b, c], c2]
    return int((g[b, d] != g[b2, d2]).sum())


@pytest.mark.parametrize("kind", ["cyclic", "random"])
def test_rule_is_a_latin_square_and_not_associative(kind):
    g = rule(16, 0, kind)
    for row in [*g, *g.T]:
        assert sorted(row) == list(range(16))
    a = g[g[:, :, None], np.arange(16)[None, None, :]]  # g(g(x, y), z)
    b = g[np.arange(16)[:, None, None], g[None, :, :]]  # g(x, g(y, z))
    assert (a != b).mean() > 0.5
    assert np.array_equal(rule(16, 0, kind), g) and not np.array_equal(rule(16, 1, kind), g)


def test_the_cyclic_rule_has_a_group_behind_it_and_the_random_one_has_none():
    """fold_rule=random exists to take away the structure a model could hold the k-fold table by: the cyclic
    rule is an isotope of Z_m (the quadrangle criterion holds), the random rule breaks the criterion."""
    for seed in range(3):
        assert quadrangle_violations(rule(8, seed, "cyclic")) == 0
        assert quadrangle_violations(rule(8, seed, "random")) > 0
    with pytest.raises(ValueError, match="fold rule"):
        rule(8, 0, "magic")


def test_the_sources_documents_mark_each_level_and_are_deterministic():
    g = rule(16, 0)
    L, task = 4, layout(16, 4)
    a = np.stack([make_document(7, i, g, L) for i in range(30)])
    assert np.array_equal(a, np.stack([make_document(7, i, g, L) for i in range(30)]))  # same seed, same bytes
    assert not np.array_equal(a, np.stack([make_document(8, i, g, L) for i in range(30)]))
    lev = levels(L)
    for doc in a:
        found = solve(doc, g)  # the independent solver: every answer recomputed
        assert [int(doc[p - k - 1]) for p, k, _ in found] == [1, 2, 3, 4]  # segment k opens with W_k = k
        assert [k for _, k, _ in found] == [1, 2, 3, 4] and sorted(np.flatnonzero(lev)) == [p for p, _, _ in found]
    assert np.array_equal(levels_at(a, task), np.broadcast_to(lev, a.shape))  # the openers find every level
    # any window of the stream: a segment is scored iff its opener lies in the window, at its last cell
    stream, by_pos = a.reshape(-1), np.tile(lev, len(a))  # the level each stream position predicts
    for start in (0, 3, 17, 40):
        pos = start + np.arange(33)
        lv = by_pos[pos]
        want = np.where(pos - lv - 1 >= start, lv, 0)  # the opener of level k sits k + 1 before its last cell
        assert np.array_equal(levels_at(stream[pos], task), want)
    assert task["mean_need"] == round(float(need(L).mean()), 4)


def test_typed_cells_are_the_same_draws_as_input_tokens_of_their_own():
    """fold_typed: x_1..x_k become input tokens SYM + m + x; x_0 and the answer stay state tokens SYM + y (the
    answer is read through the tied head in the space x_0 is written in). Same draws, same levels, same need."""
    g, L = rule(8, 0), 3
    shared = np.stack([make_document(5, i, g, L) for i in range(20)])
    typed = np.stack([make_document(5, i, g, L, typed=True) for i in range(20)])
    assert layout(8, L, typed=True)["vocab_needed"] == SYM + 16 and layout(8, L)["vocab_needed"] == SYM + 8
    lev = levels(L)
    first = np.zeros_like(lev, dtype=bool)  # x_0 of each segment (its opener is the token before)
    for p, k in zip(np.flatnonzero(lev), lev[lev > 0]):
        first[p - k] = True
    later = (typed != shared) & ~first  # the only tokens that change: the later cells, shifted by m
    assert (typed[later] == shared[later] + 8).all() and later.sum() == 20 * sum(range(1, L + 1))
    for doc in typed:
        assert [k for _, k, _ in solve(doc, g, typed=True)] == [1, 2, 3]
    assert np.array_equal(levels_at(typed, layout(8, L, typed=True)), np.broadcast_to(lev, typed.shape))


def test_the_slots_layout_draws_one_level_per_slot_and_starts_every_slot_alike():
    """fold_layout=slots: document i is one slot of L + 3 tokens, W_k x_0 .. x_k A then PAD, its level k drawn
    per document (every level appears); the solver recomputes every answer; the level sits at slot position
    k + 1 and `levels_at` finds it in windows of several slots; the manifest's mean needs are the slots'."""
    g, L = rule(16, 0, "random"), 3
    a = np.stack([make_document(4, i, g, L, typed=True, kind="slots") for i in range(300)])
    assert a.shape == (300, slot_length(L)) and slot_length(L) == L + 3
    assert np.array_equal(a, np.stack([make_document(4, i, g, L, typed=True, kind="slots") for i in range(300)]))
    assert not np.array_equal(a, np.stack([make_document(5, i, g, L, typed=True, kind="slots") for i in range(300)]))
    ks = []
    for doc in a:
        ((p, k, _),) = solve(doc, g, typed=True)  # one segment per slot, its answer recomputed
        assert doc[0] == W and p == k + 1 and (doc[k + 3 :] == PAD).all()  # one opener for every level
        ks.append(k)
    assert sorted(set(ks)) == [1, 2, 3] and min(np.bincount(ks)[1:]) > 60  # uniform over 1..L
    task = layout(16, L, 0, "random", True, "slots")
    assert task["layout"] == "slots" and task["doc_tokens"] == L + 3
    stream = a.reshape(-1)
    for S in (1, 2, 4):  # windows of S whole slots: every slot's query scored at its level
        w = S * slot_length(L)
        lev = levels_at(stream[: len(stream) // w * w].reshape(-1, w), task).reshape(-1, slot_length(L))
        want = np.zeros_like(lev)
        want[np.arange(len(lev)), np.array(ks[: len(lev)]) + 1] = ks[: len(lev)]
        assert np.array_equal(lev, want)
    # the mean needs: per level k, the ordered layout's level-k segment, padded with PAD at one loop
    for visible, key in ((False, "mean_need"), (True, "mean_need_frozen")):
        per_k = [np.r_[need(k, visible)[-(k + 3) :], np.ones(L - k)].mean() for k in range(1, L + 1)]
        assert task[key] == round(float(np.mean(per_k)), 4) == round(slot_need(L, visible), 4)
    with pytest.raises(ValueError, match="fold layout"):
        layout(16, L, kind="nested")
    with pytest.raises(ValueError, match="whole slots"):  # the level is counted over the slot: no cut windows
        levels_at(stream[:-1], task)


def test_prep_data_cli_writes_the_fold_source(tmp_path):
    from data_prep.shards import ShardReader

    cmd = [sys.executable, "-m", "pipeline.cli", "prep-data", "--source", "depth-fold", "--out", str(tmp_path / "d")]
    cmd += ["depth_docs=45", "seed=3", "fold_symbols=8", "depth_levels=3", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "model.block_size=15" in r.stderr  # the run's window: one document
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    task = m["depth_task"]
    assert m["complete"] and task["kind"] == "fold" and task["levels"] == 3 and task["vocab_needed"] == SYM + 8
    toks = np.concatenate(
        [np.asarray(ShardReader(tmp_path / "d" / s["name"]).tokens) for s in m["splits"]["train"]["shards"]]
    ).astype(np.int64)
    docs = toks.reshape(-1, doc_length(3))
    assert len(docs) == 42  # docs 0, 20, 40 go to val
    g = rule(8, 0)
    assert np.array_equal(docs[0], make_document(3, 1, g, 3))
    for doc in docs:
        assert len(solve(doc, g)) == 3
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    # the random rule: the manifest names it, and the solver with that g recomputes every answer
    r = subprocess.run(cmd[:-1] + ["fold_rule=random", "--overwrite", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["depth_task"]["rule"] == "random" and m["source"]["fold_rule"] == "random"
    toks = np.asarray(ShardReader(tmp_path / "d" / m["splits"]["train"]["shards"][0]["name"]).tokens)
    g = rule(8, 0, "random")
    assert np.array_equal(toks[: doc_length(3)], make_document(3, 1, g, 3))
    for doc in toks.astype(np.int64).reshape(-1, doc_length(3)):
        assert len(solve(doc, g)) == 3
    # the slots layout: documents of L + 3 tokens, windows of whole slots
    r = subprocess.run(cmd[:-1] + ["fold_layout=slots", "--overwrite", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "model.block_size=a multiple of 6" in r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["depth_task"]["layout"] == "slots" and m["source"]["fold_layout"] == "slots"
    toks = np.asarray(ShardReader(tmp_path / "d" / m["splits"]["train"]["shards"][0]["name"]).tokens)
    assert np.array_equal(toks[:6], make_document(3, 1, rule(8, 0), 3, kind="slots"))
    # a manifest made before fold_rule existed counts as the default rule, and the options of the removed
    # depth-hops source it records (every manifest made before the removal has them) are not compared: the same
    # command is a no-op
    r = subprocess.run(cmd + ["--overwrite"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    del m["source"]["fold_rule"]
    m["source"].update(depth_chains=6, depth_queries=4)
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to do" in again.stderr
    for bad, key in (
        ("fold_symbols=1", "fold_symbols"),
        ("depth_levels=16", "depth_levels"),
        ("fold_rule=x", "fold_rule"),
        ("fold_layout=x", "fold_layout"),
    ):
        r = subprocess.run(
            cmd[:-6] + ["depth_docs=45", bad, "--overwrite", "--no-progress"], capture_output=True, text=True
        )
        assert r.returncode != 0 and key in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "T,typed,kind", [(15, False, "ordered"), (32, False, "ordered"), (15, True, "ordered"), (12, True, "slots")]
)
def test_loader_scores_only_the_fold_answers(tmp_path, T, typed, kind):
    """Shards stay plain tokens; the loader masks every target but the answers (ignore index -1), in windows of
    one document (T = doc_length) or cut anywhere; in the slots layout, windows of two slots."""
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare
    from pipeline.train.data import TrainLoader, ValLoader

    cfg = load_prep_config(
        None,
        {"source": "depth-fold", "out": str(tmp_path / "d"), "progress": False},
        ["depth_docs=60", "depth_levels=3", "fold_symbols=8", f"fold_typed={typed}", f"fold_layout={kind}"],
    )
    prepare(cfg, log=lambda m: None)
    g = rule(8, 0)
    seen = set()
    for loader in (
        TrainLoader(str(tmp_path / "d"), "train", T, 4, 0, 1, 0, 64),
        next(ValLoader(str(tmp_path / "d"), "val", T, 2, 0, 1, 64).batches(1)),
    ):
        x, y = loader.next() if hasattr(loader, "next") else loader
        lev = levels_at(x.numpy(), layout(8, 3, kind=kind))
        assert ((y != -1).numpy() == (lev > 0)).all() and (lev > 0).any()
        for row, tgt, lv in zip(x.numpy(), y.numpy(), lev):  # every scored target: the fold of its cells
            for p in np.flatnonzero(tgt != -1):
                cells = [int(v) - SYM for v in row[p - lv[p] : p + 1]]  # x_0 .. x_k
                assert row[p - lv[p] - 1] == (W if kind == "slots" else lv[p]) and min(cells) >= 0  # opener, cells
                cells = cells[:1] + [c - 8 * typed for c in cells[1:]]
                y_ = cells[0]
                for c in cells[1:]:
                    y_ = int(g[y_][c])
                assert tgt[p] == SYM + y_
                seen.add((int(lv[p]), p % 6 if kind == "slots" else p))
        if kind == "slots":  # whole slots: the level-k query at slot position k + 1, levels mixed in the batch
            assert {k for k, _ in seen} == {1, 2, 3} and all(q == k + 1 for k, q in seen)
        if T == 15:  # a window is one document: the level is a function of the position
            assert (lev == np.broadcast_to(levels(3), lev.shape)).all()


def _fold_data(tmp_path, docs=60):
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare

    cfg = load_prep_config(
        None,
        {"source": "depth-fold", "out": str(tmp_path / "d"), "progress": False},
        [f"depth_docs={docs}", "depth_levels=3", "fold_symbols=8", "val_every=4"],
    )
    prepare(cfg, log=lambda m: None)
    return tmp_path / "d"


def test_the_curriculum_trains_levels_up_to_its_cap_and_resumes_there(tmp_path):
    """data.curriculum: the loader scores answers of levels 1..level_cap only (the val split all of them); the cap
    is part of the loader's checkpointed state."""
    from pipeline.train.data import TrainLoader

    d = str(_fold_data(tmp_path))

    def scored_levels(loader):
        x, y = loader.next()
        return set(levels_at(x.numpy(), layout(8, 3))[(y != -1).numpy()].tolist())

    on = TrainLoader(d, "train", 15, 8, 0, 1, 0, 64, curriculum=True)
    assert on.level_cap == 1 and scored_levels(on) == {1}
    on.raise_level()
    assert scored_levels(on) == {1, 2}
    state = on.state_dict()
    on.raise_level(), on.raise_level()
    assert on.level_cap == 3 and scored_levels(on) == {1, 2, 3}  # never past the task's levels
    back = TrainLoader(d, "train", 15, 8, 0, 1, 0, 64, curriculum=True)
    back.load_state_dict(state)
    assert back.level_cap == 2 and scored_levels(back) == {1, 2}
    off = TrainLoader(d, "train", 15, 8, 0, 1, 0, 64)
    off.load_state_dict(state)  # the curriculum switched off at a resume: every level
    assert off.level_cap == 0 and scored_levels(off) == {1, 2, 3}
    old = {k: v for k, v in state.items() if k != "level_cap"}  # a state from before the curriculum existed
    late = TrainLoader(d, "train", 15, 8, 0, 1, 0, 64, curriculum=True)
    late.load_state_dict(old)
    assert late.level_cap == 1


def test_the_curriculum_raises_its_level_when_every_trained_level_passes():
    from types import SimpleNamespace

    from pipeline.train.callbacks import Curriculum

    class Loader:
        level_cap, levels = 1, 3

        def raise_level(self):
            self.level_cap += 1

    cb = Curriculum()
    cb.trainer = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(curriculum=0.9)), loader=Loader())
    for accs, cap in [
        ({}, 1),  # no validation this step
        ({"val/acc_L1": 0.89}, 1),
        ({"val/acc_L1": 0.9, "val/acc_L2": 0.0}, 2),
        ({"val/acc_L1": 0.95, "val/acc_L2": 0.92}, 3),
        ({"val/acc_L1": 1.0, "val/acc_L2": 1.0, "val/acc_L3": 1.0}, 3),  # the last level: stays
    ]:
        m = dict(accs)
        cb.post_step(1, m)
        assert m["data/level_cap"] == cap == cb.trainer.loader.level_cap
    cb.trainer.loader.level_cap = 2
    m = {"val/acc_L1": 0.5, "val/acc_L2": 0.99}  # every trained level must pass, not only the newest
    cb.post_step(1, m)
    assert m["data/level_cap"] == 2


def test_tlf_train_on_the_fold_task_logs_accuracy_by_level_and_its_curriculum(tmp_path):
    """Through the trainer: val/acc_L<k> at each validation, equal to a recount on the same val windows from the
    saved weights; data/level_cap every step; a resume keeps the cap; a config without validations or a text
    data.dir refuses the curriculum with a one-line error."""
    import torch

    from pipeline.config import ConfigError, load_config
    from pipeline.train.trainer import run

    d = _fold_data(tmp_path, docs=200)
    base = [
        "model.vocab_size=64",
        "model.block_size=15",
        f"data.dir={d}",
        f"checkpoint.dir={tmp_path / 'run'}",
        "train.micro_batch_size=8",
        "train.global_batch_size=8",
        "train.grad_accum_steps=1",
        "train.eval_interval=2",
        "train.eval_batches=2",
        "schedule.max_steps=4",
        "schedule.warmup_steps=1",
        "checkpoint.interval=2",
        "logging.mlflow=false",
        "train.device=cpu",
        "data.curriculum=1e-9",  # any level answered at all passes: the cap moves when accuracy is > 0
    ]
    torch.set_num_threads(1)
    res = run(load_config("tiny/t-loopformer", base))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in lines}
    assert all("data/level_cap" in r for r in lines) and by_step[1]["data/level_cap"] == 1
    for s in (2, 4):
        r = by_step[s]
        assert {"val/acc_L1", "val/acc_L2", "val/acc_L3"} <= set(r) and all(
            0 <= r[f"val/acc_L{k}"] <= 1 for k in (1, 2, 3)
        )
    want = 2 if by_step[2]["val/acc_L1"] > 0 else 1
    assert by_step[2]["data/level_cap"] == want
    assert res.step == 4
    from pipeline.model.io import load_model
    from pipeline.train.data import ValLoader

    model, _ = load_model(tmp_path / "run")  # step 4's weights: the recount of step 4's accuracies
    right, n = np.zeros(3), np.zeros(3)
    for x, y in ValLoader(str(d), "val", 15, 8, 0, 1, 64).batches(2):
        with torch.no_grad():
            ok = (model(x).logits.argmax(-1) == y).numpy()
        lev = levels_at(x.numpy(), layout(8, 3))
        for k in (1, 2, 3):
            right[k - 1] += ok[lev == k].sum()
            n[k - 1] += (lev == k).sum()
    for k in (1, 2, 3):
        assert abs(by_step[4][f"val/acc_L{k}"] - right[k - 1] / n[k - 1]) < 1e-9
    more = run(load_config("tiny/t-loopformer", [*base, "schedule.max_steps=6", "checkpoint.resume=auto"]))
    assert more.start_step == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in lines if r["step"] == 5][-1]["data/level_cap"] == by_step[4]["data/level_cap"]
    with pytest.raises(ConfigError, match=r"data.curriculum=0.5 needs validations"):
        load_config("tiny/t-loopformer", [*base, "data.curriculum=0.5", "train.eval_interval=0"])
    from data_prep.shards import ShardError
    from test_train import make_shards

    text = make_shards(tmp_path / "text", windows=10, seq_len=15, vocab=64)
    with pytest.raises(ShardError, match=r"data.curriculum needs a depth-task data.dir"):
        run(load_config("tiny/t-loopformer", [*base, f"data.dir={text}", f"checkpoint.dir={tmp_path / 'r2'}"]))
    # `tlf eval` with its default tasks on this checkpoint: the GPT-2 text of the zero-shot tasks does not fit a
    # vocabulary of 64, so they are skipped with one line (or refused under eval.strict) and the levels scored
    from evaluation.evaluate import run as evaluate

    logs, ev = [], ["eval.latency=false", "eval.mlflow=false", f"eval.out_dir={tmp_path / 'ev'}"]
    res = evaluate(tmp_path / "run", ev, loops="4", log=logs.append)
    assert sum("skipping the zero-shot tasks" in ln and "model.vocab_size=64" in ln for ln in logs) == 1
    assert set(res["skipped_tasks"]) == set(load_config("tiny/t-loopformer").eval.tasks)
    assert res["budgets"][0]["levels"]["targets"] > 0 and not res["budgets"][0]["tasks"]
    with pytest.raises(ConfigError, match=r"eval.tasks: model.vocab_size=64"):
        evaluate(tmp_path / "run", [*ev, "eval.strict=true"], loops="4", log=logs.append)


def test_the_slots_layout_refuses_windows_that_cut_a_slot(tmp_path):
    """The loader counts a slot's tokens to find its level, so `tlf train` on slots data with a block size that is
    not a multiple of the slot stops with one line naming model.block_size (and the evaluator too)."""
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare
    from data_prep.shards import ShardError
    from evaluation.levels import level_scores
    from pipeline.config import load_config
    from pipeline.model.looped import LoopedLM

    d = tmp_path / "d"
    cfg = load_prep_config(
        None,
        {"source": "depth-fold", "out": str(d), "progress": False},
        ["depth_docs=200", "depth_levels=2", "fold_symbols=8", "fold_typed=true", "fold_layout=slots"],
    )
    prepare(cfg, log=lambda m: None)
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "fold/base-loop-router", f"data.dir={d}"]
    cmd += [f"checkpoint.dir={tmp_path / 'ck'}", "model.block_size=9", "train.device=cpu", "logging.mlflow=false"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stderr.splitlines() if "model.block_size=9" in ln]
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "multiple of its slot (5 tokens)" in lines[0]
    model = LoopedLM(load_config("fold/base-loop-router", ["model.block_size=9"]).model)
    with pytest.raises(ShardError, match="model.block_size=9"):
        level_scores(model, str(d), 2)


@pytest.mark.parametrize("opts", [[], ["fold_layout=slots", "fold_symbols=8"]])
def test_worker_processes_write_the_same_bytes(tmp_path, monkeypatch, opts):
    """prep-data's `workers` make the fold task's documents in chunks, in order: shards and manifest are the bytes
    one process writes (here 9 chunks of 7 documents across 2 processes)."""
    from data_prep import foldtask
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare

    monkeypatch.setattr(foldtask, "CHUNK_DOCS", 7)
    files = {}
    for w in (0, 2):
        out = tmp_path / f"w{w}"
        cfg = load_prep_config(
            None, {"source": "depth-fold", "out": str(out), "progress": False}, ["depth_docs=60", f"workers={w}", *opts]
        )
        prepare(cfg, log=lambda m: None)
        files[w] = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".bin", ".json")}
    assert files[0] == files[2] and any(n.endswith(".bin") for n in files[0])


def test_the_removed_depth_hops_source_is_a_one_line_error_pointing_to_the_fold_task(tmp_path):
    """A command line, a prep config or an override naming the removed depth-hops source or one of its own options
    stops with one line that says it was removed and names the fold task; so does a data directory it made, in
    the loader and the evaluator."""
    from click.testing import CliRunner

    from data_prep.config import load_prep_config
    from data_prep.configlib import ConfigError
    from data_prep.shards import ShardError
    from evaluation.levels import level_scores
    from pipeline.cli import main
    from pipeline.train.data import TrainLoader

    r = CliRunner().invoke(main, ["prep-data", "--source", "depth-hops", "--out", str(tmp_path / "h")])
    said = [ln for ln in r.output.splitlines() if "depth-hops" in ln]
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert len(said) == 1 and "was removed" in said[0] and "source=depth-fold" in said[0], r.output
    yml = tmp_path / "old.yaml"
    for text, where in (
        ("source: depth-hops\n", "source:"),
        ("source: depth-fold\ndepth_chains: 6\n", "'depth_chains'"),
    ):
        yml.write_text(text)
        with pytest.raises(ConfigError, match="depth-hops task was removed.*source=depth-fold") as e:
            load_prep_config(str(yml), {"out": str(tmp_path / "h")})
        assert where in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"command line \(depth_queries=4\): 'depth_queries': the depth-hops task"):
        load_prep_config(None, {"source": "depth-fold", "out": str(tmp_path / "h")}, ["depth_queries=4"])
    d = _fold_data(tmp_path)  # made as a depth-hops directory: its depth_task has no kind "fold"
    m = json.loads((d / "manifest.json").read_text())
    m["depth_task"] = {k: v for k, v in m["depth_task"].items() if k != "kind"}
    (d / "manifest.json").write_text(json.dumps(m))
    for read in (lambda: TrainLoader(str(d), "train", 15, 8, 0, 1, 0, 64), lambda: level_scores(None, str(d), 2)):
        with pytest.raises(ShardError, match="depth-hops source: the depth-hops task was removed") as e:
            read()
        assert "source=depth-fold" in str(e.value) and "\n" not in str(e.value)
