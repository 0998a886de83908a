"""The machine during training: perf/data_wait_ms every step, MLflow's system metrics (logging.system_metrics; one
sample at the end at least, so a short run has them too), and train.profile_steps=A:B's Chrome trace in the run
dir and as an MLflow artifact; a bad profile_steps is named."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError
from test_train import make_shards, tiny_cfg


@pytest.fixture(scope="module")
def run_of(tmp_path_factory):
    """A 4-step run logged to a sqlite MLflow store, steps 2..3 profiled: (run dir, tracking URI, run id)."""
    from pipeline.train.trainer import run

    tmp = tmp_path_factory.mktemp("machine")
    data = make_shards(tmp / "data", windows=10)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = tiny_cfg(
        tmp / "ck",
        data,
        "logging.mlflow=true",
        f"logging.tracking_uri={uri}",
        "schedule.max_steps=4",
        "train.profile_steps=2:3",
    )
    res = run(cfg)
    return tmp / "ck", uri, res.run_id


def test_data_wait_is_logged_every_step(run_of):
    from pipeline.tracking import read_metrics

    rows = read_metrics(run_of[0] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["perf/data_wait_ms"] >= 0 for r in rows)


def test_system_metrics_reach_the_mlflow_run(run_of):
    from mlflow.tracking import MlflowClient

    _, uri, run_id = run_of
    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)


def test_the_profiled_steps_are_a_chrome_trace_in_the_run_dir_and_mlflow(run_of):
    from mlflow.tracking import MlflowClient

    root, uri, run_id = run_of
    trace = root / "profile_steps_2-3_rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    assert [a.path for a in MlflowClient(uri).list_artifacts(run_id, "profiles")] == [
        "profiles/profile_steps_2-3_rank0.json"
    ]


@pytest.mark.parametrize("value", ["3:2", "a:b", "0:1", "2", "2:"])
def test_a_bad_profile_range_is_named(tmp_path, value):
    with pytest.raises(ConfigError, match=r"train\.profile_steps="):
        tiny_cfg(tmp_path, tmp_path, f"train.profile_steps={value}")


def test_mlflow_shows_a_model_training_run_with_its_source_and_dataset(run_of):
    """MLflow 3's UI opens the experiment on its runs (kind custom_model_development), the run table's Source is
    `tlf train` at the checkout's commit, and its Dataset is the data.dir trained on (context training)."""
    from mlflow.tracking import MlflowClient

    _, uri, run_id = run_of
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["mlflow.source.name"] == "tlf train" and run.data.tags["mlflow.source.type"] == "LOCAL"
    assert "mlflow.source.git.commit" in run.data.tags or "tlf_version" in run.data.tags
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "data" and inp.dataset.source_type == "local"
    assert [(t.key, t.value) for t in inp.tags] == [("mlflow.data.context", "training")]


def test_the_ui_link_opens_a_server_experiment_as_model_training():
    from pipeline.tracking import ui_link

    assert ui_link("http://host:5000/", "3", "abc") == (
        "http://host:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    )
    assert ui_link("https://h", "3") == "https://h/#/experiments/3?workflowType=machine_learning"
    assert ui_link("sqlite:///mlflow.db", "3") is None
