"""evaluation/results.py: results.json round-trips, the MLflow keys flatten and read back to the same structure
(tests/test_compare.py: compare gives the same tables from a run's metrics as from its results.json artifact)."""

import copy
import json

import pytest

from evaluation import results as R
from evaluation.tasks import TASK_ORDER


def _task(acc, norm=None):
    t = {"acc": acc, "acc_stderr": 0.01, "n": 40, "split": "validation", "source": "offline"}
    return t if norm is None else {**t, "acc_norm": norm, "acc_norm_stderr": 0.02}


def results_fixture() -> R.Results:
    def budget(M, scale):
        return {
            "loops": M,
            "effective_loops": M,
            "tasks": {
                "copa": _task(0.5 * scale),
                "piqa": _task(0.6 * scale, 0.7 * scale),
                "lambada_openai": {**_task(0.3 * scale), "perplexity": 80.0 / scale, "note": "n"},
            },
            "avg_acc": 0.123 * scale,
            "avg_acc_tasks": 3,
            "perplexity": [
                {
                    "set": s,
                    "ppl": 40.0 / scale + i,
                    "mean_nll": 3.5 - scale + i,
                    "tokens": 512,
                    "dir": f"data/{s}",
                    "split": "val",
                    "context": 64,
                    "stride": 0,
                    "protocol": "p",
                }
                for i, s in enumerate(("demo", "demo-enwiki"))
            ],
            "depth": {
                "mean": 1.0 + scale,
                "share": [0.1 * scale, 0.5, 0.4 - 0.1 * scale][:M],
                "ppl": [10.0] * M,
                "set": "demo",
                "chart": f"depth_M{M}.png",
            },
            "latency": {
                "ttft_ms": {"31": 2.0 * M},
                "tpot_ms": {"1": 0.5 * M, "2": 0.7 * M},
                "decode_mean_depth": 1.5,
                "protocol": "median",
            },
            "timing_s": {"copa": 0.1},
        }

    return {
        "model": {"variant": "t-loopformer", "n_layers": 2, "loops": 3, "router": True},
        "table_metric": "acc",
        "ppl_sets": ["demo", "demo-enwiki"],
        "budgets": [budget(2, 1.0), budget(3, 1.1)],
        "limit": 40,
    }


def test_file_round_trip_and_the_mlflow_keys(tmp_path):
    res = results_fixture()
    R.write(tmp_path / "r" / "results.json", res)
    assert R.read(tmp_path / "r" / "results.json") == res
    assert not [p for p in (tmp_path / "r").iterdir() if p.name != "results.json"]  # no temporary left behind
    flat = R.flatten(res)
    assert flat["eval/M2/copa/acc"] == 0.5 and flat["eval/M3/piqa/acc_norm"] == pytest.approx(0.77)
    assert flat["eval/M2/lambada_openai/perplexity"] == 80.0 and "eval/M2/copa/n" in flat
    assert flat["eval/M2/avg_acc"] == 0.123 and flat["eval/M2/ppl/demo-enwiki/tokens"] == 512.0
    assert flat["eval/M3/depth/share_3"] == pytest.approx(0.29) and flat["eval/M2/depth/mean"] == 2.0
    assert flat["eval/M3/latency/ttft_ms_P31"] == 6.0 and flat["eval/M2/latency/tpot_ms_B2"] == pytest.approx(1.4)
    assert flat["eval/M2/latency/decode_mean_depth"] == 1.5
    assert not [k for k in flat if "split" in k or "protocol" in k or "timing" in k]


def test_flatten_then_read_gives_the_measured_structure():
    res = results_fixture()
    back = R.from_metrics(dict(reversed(list(R.flatten(res).items()))), "t-loopformer", "acc")  # any key order
    want = copy.deepcopy(res)
    for b in want["budgets"]:  # what MLflow carries: the numbers
        for k in ("effective_loops", "avg_acc_tasks", "timing_s"):
            del b[k]
        b["tasks"] = {
            t: {k: float(v) for k, v in r.items() if isinstance(v, (int, float))} for t, r in b["tasks"].items()
        }
        b["perplexity"] = [{k: p[k] for k in ("set", "ppl", "mean_nll", "tokens")} for p in b["perplexity"]]
        b["depth"] = {k: b["depth"][k] for k in ("mean", "share")}
        b["latency"].pop("protocol")
    assert [b["loops"] for b in back["budgets"]] == [2, 3]
    for got, exp in zip(back["budgets"], want["budgets"]):
        assert got["tasks"] == exp["tasks"] and got["depth"] == exp["depth"] and got["latency"] == exp["latency"]
        assert sorted(got["perplexity"], key=lambda p: p["set"]) == exp["perplexity"]
        assert got["avg_acc"] == exp["avg_acc"]
    assert back["model"]["variant"] == "t-loopformer" and R.flatten(back) == R.flatten(res)


def test_the_stored_average_is_used_unless_another_metric_is_asked_for():
    res = results_fixture()
    b = res["budgets"][0]
    assert R.budget_average(res, b, "acc") == 0.123  # stored (deliberately not the mean of the tasks)
    assert R.budget_average(res, b, "acc_norm") == pytest.approx((0.5 + 0.7 + 0.3) / 3)
    assert R.budget_average(res, {k: v for k, v in b.items() if k != "avg_acc"}, "acc") == pytest.approx(1.4 / 3)
    assert list(R.TASK_LABELS) == TASK_ORDER and len(set(R.TASK_LABELS.values())) == 10


def test_run_record_and_bad_files(tmp_path):
    from pipeline.train.checkpoint import RunRecord, read_run_record

    assert read_run_record(tmp_path) is None
    (tmp_path / "run.json").write_text(
        json.dumps({"mlflow_run_id": "a" * 32, "tracking_uri": "sqlite:///x", "step": 7})
    )
    assert read_run_record(tmp_path) == RunRecord("a" * 32, "sqlite:///x", 7)
    (tmp_path / "run.json").write_text("{not json")
    assert read_run_record(tmp_path) is None
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"results.json: not a tlf results file"):
        R.read(tmp_path / "results.json")
