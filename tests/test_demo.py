"""The demo's closing printout: the router variant's depth distribution and the loop work it cost."""

import json

from pipeline.demo import VARIANT_OVERRIDES, depth_summary
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


def test_demo_router_overrides_are_valid_config():
    cfg = load_config("small/t-loopformer", VARIANT_OVERRIDES["t-loopformer"])
    assert cfg.model.router_recipe == "budget" and 1 < cfg.model.router_target_depth < cfg.model.loops
