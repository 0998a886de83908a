"""Per-level scoring on a depth-task directory (the fold task, prep-data --source depth-fold): counts, accuracy and
depths recomputed independently."""

import numpy as np
import pytest
import torch
from helpers import perturbed_tiny, spread_router

from data_prep.config import load_prep_config
from data_prep.foldtask import levels_at, task_of
from data_prep.prep import prepare
from data_prep.shards import ShardSet
from evaluation.levels import level_scores


def _data(tmp_path):
    """The fold task at 4 levels of 16 symbols; the tiny preset's windows cut across its 22-token documents."""
    opts = ["depth_docs=200", "val_every=2"]
    cfg = load_prep_config(None, {"source": "depth-fold", "out": str(tmp_path / "d"), "progress": False}, opts)
    prepare(cfg, log=lambda m: None)
    return str(tmp_path / "d")


def test_level_scores_match_a_direct_recount(tmp_path):
    d = _data(tmp_path)
    model, cfg = perturbed_tiny("tiny/t-loopformer")
    spread_router(model)
    T = cfg.model.block_size
    r = level_scores(model, d, 4, max_windows=6, batch_size=4)
    rows = np.stack([ShardSet(d, "val").read(w * T, T + 1) for w in range(6)]).astype(np.int64)
    x = torch.from_numpy(rows[:, :-1])
    with torch.no_grad():
        logits = model(x, loops=4).logits  # (B, T, V)
    k = levels_at(rows[:, :-1], task_of(d))
    scored = k > 0
    pred = logits.argmax(-1).numpy()
    ok = pred[scored] == rows[:, 1:][scored]
    assert r["targets"] == scored.sum() == np.sum(r["level_depth"])
    assert abs(r["accuracy"] - ok.mean()) < 1e-9
    _, depth = model.hidden_states(x, 4)
    assert abs(r["work"] - depth.float().mean().item()) < 1e-6  # over every token, not only the answers
    for lev in range(1, 5):
        assert sum(r["level_depth"][lev - 1]) == (k[scored] == lev).sum()
        assert abs(r["accuracy_by_level"][lev] - ok[k[scored] == lev].mean()) < 1e-9
    assert len({i for row in r["level_depth"] for i, c in enumerate(row) if c}) > 1  # the router spreads depths
    off = level_scores(model, d, 3, max_windows=6, router=False)
    assert all(c == 0 for row in off["level_depth"] for c in row[:2]) and off["spearman"] is None


def test_levels_travel_through_the_results_schema(tmp_path):
    from evaluation import results

    d = _data(tmp_path)
    model, _ = perturbed_tiny("tiny/t-loopformer")
    lv = level_scores(spread_router(model), d, 4, max_windows=4)
    flat = results.flatten({"budgets": [{"loops": 4, "levels": lv}]})
    assert flat["eval/M4/levels/accuracy"] == lv["accuracy"] and "eval/M4/levels/acc_L3" in flat
    back = results.from_metrics(flat)["budgets"][0]["levels"]
    assert back["accuracy_by_level"] == lv["accuracy_by_level"] and back["targets"] == lv["targets"]


def test_compare_plots_accuracy_against_loop_work(tmp_path):
    from evaluation.compare import Run, Selection, plot_all

    lv = lambda d, a: {"levels": {"work": d, "accuracy": a}}
    res = {"budgets": [{"loops": 1, **lv(1.0, 0.3)}, {"loops": 4, **lv(2.5, 0.9)}]}
    sel = Selection(
        eval={
            "t-loopformer": Run("r1", "t-loopformer", "n", 0, {}, {}, res),
            "loopformer": Run("r2", "loopformer", "n", 0, {}, {}, {"budgets": []}),
        }
    )
    paths = plot_all(sel, None, tmp_path)
    assert [p.name for p in paths] == ["accuracy_vs_work.png"] and paths[0].stat().st_size > 0


def test_level_depth_table_is_printed_in_percent_of_each_level():
    from evaluation.levels import describe_levels

    lv = {
        "accuracy": 0.5,
        "accuracy_by_level": {1: 1.0, 2: 0.0},
        "work": 1.5,
        "spearman": 1.0,
        "level_depth": [[3, 1], [1, 3]],
    }
    lines = describe_levels(lv, 2)
    assert "L1 1.000, L2 0.000" in lines[0] and "rho(depth, level) 1.000" in lines[0]
    assert lines[2].split("|")[1].split() == ["75.0", "25.0"] and lines[2].endswith("100.0%")
    assert lines[3].split("|")[1].split() == ["25.0", "75.0"] and lines[3].endswith(" 75.0%")  # depth >= 2


def test_compare_tables_accuracy_against_a_fixed_depth_curve_at_equal_work():
    """Table 4: every depth-task evaluation by budget, with loopformer's elastic curve (no router, several
    budgets) interpolated at each row's executed work; results.json keys its levels as strings."""
    from evaluation.compare import Run, Selection, table4

    def lv(work, acc, by, table=None):
        out = {"work": work, "accuracy": acc, "accuracy_by_level": by, "spearman": None}
        return out | ({"level_depth": table} if table else {})

    lf = {
        "model": {"router": False},
        "budgets": [
            {"loops": 1, "levels": lv(1.0, 0.2, {"1": 0.4, "2": 0.0})},
            {"loops": 2, "levels": lv(2.0, 0.6, {"1": 0.8, "2": 0.4})},
        ],
    }
    tl = {
        "model": {"router": True},
        "budgets": [{"loops": 2, "levels": lv(1.25, 0.5, {1: 1.0, 2: 0.0}, [[3, 1], [2, 2]])}],
    }
    sel = Selection(
        eval={
            "loopformer": Run("r1", "loopformer", "n", 0, {}, {}, lf),
            "t-loopformer": Run("r2", "t-loopformer", "n", 0, {}, {}, tl),
            "base": Run("r3", "base", "n", 0, {}, {}, {"budgets": [{"loops": 1}]}),  # no depth task: no row
        }
    )
    t = table4(sel)
    assert t.columns[-2:] == ["loopformer at that work", "difference"]
    rows = {r[0]: r[1:] for r in t.rows}
    assert list(rows) == ["loopformer (M=1)", "loopformer (M=2)", "t-loopformer (M=2)"]
    assert rows["loopformer (M=2)"][:3] == [0.6, 0.8, 0.4] and rows["loopformer (M=2)"][-2:] == [None, None]
    acc, l1, l2, work, rho, ge, at, diff = rows["t-loopformer (M=2)"]
    assert (acc, l1, l2, work, rho) == (0.5, 1.0, 0.0, 1.25, None)
    assert ge == 6 / 8  # level 1: 4 of 4 at depth >= 1; level 2: 2 of 4 at depth 2
    assert abs(at - 0.3) < 1e-12 and abs(diff - 0.2) < 1e-12  # 0.2 + 0.25 * (0.6 - 0.2)
    assert "+0.200" in t.text()
    from evaluation.compare import level_depth_text

    text = level_depth_text(sel).splitlines()  # the router variant only
    assert text[0].startswith("t-loopformer (M=2): level x executed depth") and len(text) == 4
    assert text[3].split("|")[1].split() == ["50.0", "50.0"] and text[3].endswith(" 50.0%")
    assert table4(Selection(eval={"base": sel.eval["base"]})).rows == []
    from evaluation.compare import table1

    assert table1(sel).rows == []  # no perplexity or task accuracy in any of them: no blank rows


def test_spearman_averages_tied_ranks():
    from evaluation.levels import spearman

    assert spearman(np.array([1.0, 2, 3, 4]), np.array([2.0, 4, 6, 8])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 1, 2, 2]), np.array([1.0, 2, 3, 4])) == pytest.approx(2 / 5**0.5)  # ranks 1.5, 3.5
    assert spearman(np.array([3.0, 1, 2]), np.array([1.0, 2, 3])) == pytest.approx(-0.5)
    assert spearman(np.array([1.0, 1]), np.array([1.0, 2])) is None
