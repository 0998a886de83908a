"""`tlf compare` over MLflow runs: tables side by side, best marked, missing metrics blank, plots written."""

import csv

import pytest
from click.testing import CliRunner
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from evaluation import results as R
from evaluation.compare import run
from pipeline.cli import main
from test_results import results_fixture


def _log(client, run_id, values: dict, step: int = 0):
    client.log_batch(run_id, metrics=[Metric(k, float(v), 0, step) for k, v in values.items()])


def _make_runs(uri):
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("cmp")
    ids = {}
    for v, final, mem in (("base-loop", 5.0, 1.5), ("loopformer", 4.5, 1.2), ("t-loopformer", 4.0, 0.9)):
        r = client.create_run(exp, tags={"variant": v, "preset": f"tiny/{v}"}).info.run_id
        for step, loss in enumerate([9.0, 7.0, final], start=1):
            _log(client, r, {"loss": loss, "tokens_per_s": 1000 * step, "mem/peak_rss_gb": mem}, step)
            if v == "t-loopformer":  # shortcut variants also log the full pass's CE, which compare prefers
                _log(client, r, {"loss_L": loss - 0.5}, step)
        _log(client, r, {"val/loss": final + 0.2}, 3)
        if v != "base-loop":  # base-loop has no evaluation metrics: blank cells, not an error
            for M, ppl in ((2, 60.0), (4, 40.0 if v == "t-loopformer" else 45.0)):
                _log(
                    client,
                    r,
                    {
                        f"eval/M{M}/ppl/demo-val/ppl": ppl,
                        f"eval/M{M}/copa/acc": 0.5 + M / 100,
                        f"eval/M{M}/piqa/acc": 0.55,
                        f"eval/M{M}/piqa/acc_norm": 0.6,
                        f"eval/M{M}/latency/tpot_ms_B1": 3.0 + M,
                        f"eval/M{M}/latency/ttft_ms_P128": 10.0,
                    },
                )
            if v == "t-loopformer":
                _log(
                    client,
                    r,
                    {
                        "eval/M4/depth/mean": 2.5,
                        **{f"eval/M4/depth/share_{i}": 0.25 for i in range(1, 5)},
                        "router/full/mean_depth": 2.5,
                    },
                )
        ids[v] = r
    return ids


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    return uri, _make_runs(uri)


def test_compare_tables_and_plots(tmp_path, store):
    uri, _ = store
    res = run(uri, ("cmp",), {}, (), tmp_path / "out")
    t1, t2, t3, t4 = res.tables
    assert t4.rows == [] and not (tmp_path / "out" / "table4.csv").exists()  # no depth-task evaluation here
    labels = [r[0] for r in t1.rows]
    assert labels == ["loopformer (M=2)", "loopformer (M=4)", "t-loopformer (M=2)", "t-loopformer (M=4)"]
    ppl_col = t1.columns.index("PPL demo-val")
    assert [r[ppl_col] for r in t1.rows] == [60.0, 45.0, 60.0, 40.0]
    assert t1.rows[0][t1.columns.index("HS")] is None  # missing task: blank
    assert t1.rows[1][-1] == pytest.approx((54.0 + 55.0) / 2)  # average of the tasks present (x100)
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "**40.00**" in md  # best perplexity marked
    assert [r[0] for r in t3.rows] == ["base-loop", "loopformer", "t-loopformer"]
    assert t3.rows[2][1] == 0.9 and "**0.900**" in md  # lowest memory marked
    assert t3.rows[0][5] == 5.2  # val loss
    assert t3.rows[0][4] == 5.0 and t3.rows[2][4] == 3.5  # train loss: loss_L where logged, else loss
    assert t2.rows and t2.columns[1].startswith("TPOT")
    for name in (
        "table1.csv",
        "table2.csv",
        "table3.csv",
        "loss_curves.png",
        "ppl_vs_loops.png",
        "depth_distribution.png",
        "throughput.png",
    ):
        assert (tmp_path / "out" / name).stat().st_size > 0, name
    rows = list(csv.reader(open(tmp_path / "out" / "table1.csv")))
    assert rows[0][0] == "Model (M)" and len(rows) == 5
    # acc_norm where a task has it
    res2 = run(uri, ("cmp",), {}, (), tmp_path / "out2", metric="acc_norm")
    assert res2.tables[0].rows[0][res2.tables[0].columns.index("PIQA")] == 60.0


def test_compare_cli_filters_and_errors(tmp_path, store):
    uri, ids = store
    r = CliRunner().invoke(
        main,
        [
            "compare",
            "--tracking-uri",
            uri,
            "--experiment",
            "cmp",
            "--tag",
            "variant=loopformer",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "loopformer (M=4)" in r.output and "t-loopformer" not in r.output
    r = CliRunner().invoke(
        main, ["compare", "--tracking-uri", uri, "--run-id", ids["base-loop"], "--out", str(tmp_path / "o2")]
    )
    assert r.exit_code == 0 and "base-loop" in r.output
    r = CliRunner().invoke(main, ["compare", "--tracking-uri", uri, "--experiment", "nope"])
    assert r.exit_code == 2 and "experiment 'nope' not found" in r.output


def test_compare_reads_the_artifact_or_the_metrics_to_the_same_tables(tmp_path, store):
    """One evaluation logged three ways: metrics only (older runs), the results.json artifact only, both."""
    uri, _ = store
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("res")
    res = results_fixture()
    path = R.write(tmp_path / "eval" / "results.json", res)
    for variant, with_metrics, with_artifact in (
        ("loopformer", True, False),
        ("t-loopformer", False, True),
        ("tmlt", True, True),
    ):
        rid = client.create_run(exp, tags={"variant": variant}).info.run_id
        flat = R.flatten(res) if with_metrics else {"eval/M2/avg_acc": 0.0}  # the artifact must win over this
        client.log_batch(rid, metrics=[Metric(k, v, 0, 0) for k, v in flat.items()])
        if with_artifact:
            client.log_artifact(rid, str(path), artifact_path=R.ARTIFACT_DIR)
    out = run(uri, ("res",), {}, (), tmp_path / "cmp")
    for t in out.tables[:2]:
        rows = {}
        for r in t.rows:
            rows.setdefault(r[0].split(" (")[0], []).append(r[1:])
        assert rows["loopformer"] == rows["t-loopformer"] == rows["tmlt"], t.title
    t1 = out.tables[0]
    assert t1.rows[0][t1.columns.index("Avg")] == pytest.approx(12.3)  # the stored average, x100
    assert t1.columns[1:3] == ["PPL demo", "PPL demo-enwiki"]
