"""The demo's closing printout: the router variant's depth distribution and the loop work it cost."""

import json

from pipeline.demo import PRESETS, depth_summary
from pipeline.config import load_config


def _results(tmp_path, router: bool):
    res = {
        "model": {"variant": "t-loopformer" if router else "loopformer", "router": router},
        "budgets": [
            {"loops": 1, "effective_loops": 1, "depth": {"share": [1.0], "mean": 1.0, "set": "demo"}},
            {
                "loops": 4,
                "effective_loops": 4,
                "depth": {"share": [0.3, 0.2, 0.1, 0.4], "mean": 2.6, "set": "demo", "chart": "c.png"},
            },
        ],
    }
    p = tmp_path / "results.json"
    p.write_text(json.dumps(res))
    return p


def test_depth_summary_reports_the_largest_budget_and_its_loop_work(tmp_path):
    s = depth_summary(_results(tmp_path, router=True))
    assert "at M=4" in s and "depth 1: 30.0%, depth 2: 20.0%, depth 3: 10.0%, depth 4: 40.0%" in s
    assert "mean depth 2.60" in s and "loop work 0.65" in s and "c.png" in s
    assert depth_summary(_results(tmp_path, router=False)) is None


def test_the_demos_t_loopformer_trains_the_budget_preset():
    from pathlib import Path

    from pipeline import demo

    cfg = load_config(PRESETS["t-loopformer"])
    assert cfg.objective.router.recipe == "budget" and cfg.objective.router.target_depth == 2.5
    stages = demo.plan(demo.parse_args([]), Path("runs/demo"), "sqlite:///x.db")
    trains = [st.args[1] for st in stages if st.args[0] == "train"]
    assert trains == ["small/base-loop", "small/loopformer", "small/t-loopformer-budget"]


def test_the_fold_part_trains_valid_configs_on_its_own_data_and_compares_apart():
    """make demo's fold part: each `tlf train` stage's preset and overrides load (the expected recipe's preset at the
    fold task's mean need with frozen keys for t-loopformer), train on the shards its prep stage writes, with one
    document a window, and every stage logs to the fold part's own experiment."""
    from pathlib import Path

    from data_prep.foldtask import doc_length
    from pipeline import demo

    a = demo.parse_args(["--fold-steps", "10"])
    stages = demo.fold_plan(a, Path("runs/demo"), "sqlite:///x.db")
    prep, trains = stages[0], [st for st in stages if st.args[0] == "train"]
    out = prep.args[prep.args.index("--out") + 1]
    assert [st.args[1] for st in trains] == ["fold/loopformer", "fold/t-loopformer-expected"]
    for st in trains:
        cfg = load_config(st.args[1], [o for o in st.args[2:] if not o.startswith("checkpoint.dir")])
        assert cfg.data.dir == out and cfg.model.block_size == doc_length(cfg.model.loops) == doc_length(2)
        assert cfg.logging.experiment == "demo-fold" and cfg.schedule.max_steps == 10
    t = load_config(trains[1].args[1], trains[1].args[3:])
    assert t.objective.router.recipe == "expected" and t.model.exited_keys == "frozen"
    assert abs(t.objective.router.target_depth - 10 / 9) < 1e-3  # the fold task's mean need with frozen keys, L = 2
    assert [st.args[0] for st in stages] == ["prep-data", "train", "train", "eval", "eval", "compare"]
    assert "demo-fold" in stages[-1].args
