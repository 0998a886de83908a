"""`tlf eval` end to end on tiny checkpoints: every budget in one run, outputs (JSON, Table-1 markdown, depth
PNG), MLflow, the base model's budgets, latency through the inference benchmark, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from data_prep.shards import write_shard
from evaluation.evaluate import run
from evaluation.tasks import TaskDataError
from helpers import perturbed_tiny as tiny
from pipeline.config import ConfigError
from pipeline.model.io import save_model

RACE_ROW = {
    "article": "Tom grew up on a farm. Every morning he fed the chickens.",
    "problems": str(
        [{"answer": "A", "options": ["chickens", "cows", "dogs", "fish"], "question": "What did Tom feed?"}]
    ),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    for name in ("tiny/t-loopformer", "tiny/base", "tiny/base-loop"):
        m, cfg = tiny(name)
        save_model(root / name.split("/")[1], m, cfg)
    rng = np.random.default_rng(0)
    for d in ("demo", "enwiki"):
        (root / d).mkdir()
        write_shard(root / d / f"{d}_val_000000.bin", rng.integers(0, 50257, 300))
    (root / "race.jsonl").write_text(json.dumps(RACE_ROW) + "\n")
    return root


def overrides(env, tasks="[copa,race,lambada_openai,sciq]", **kw):
    ov = [
        f"eval.tasks={tasks}",
        "eval.limit=2",
        "eval.source=offline",
        f"eval.race_file={env / 'race.jsonl'}",
        f"data.dir={env / 'demo'}",
        f"data.extra_val_dirs=[{env / 'enwiki'}]",
        "eval.ppl_tokens=130",
        "eval.latency=false",
        f"logging.tracking_uri=sqlite:///{env / 'mlflow.db'}",
        "eval.batch_size=8",
    ]
    return ov + [f"eval.{k}={v}" for k, v in kw.items()]


def test_every_budget_in_one_run_with_all_outputs(env):
    out = env / "out_tlf"
    res = run(env / "t-loopformer", overrides(env, out_dir=str(out)), loops="2,4", log=lambda *a: None)
    assert [b["loops"] for b in res["budgets"]] == [2, 4]
    b2, b4 = res["budgets"]
    assert set(b2["tasks"]) == {"copa", "race", "lambada_openai", "sciq"}
    assert b2["tasks"]["sciq"]["split"] == "validation" and "validation" in b2["tasks"]["sciq"]["note"]
    assert b2["tasks"]["copa"]["split"] == "validation" and b2["tasks"]["lambada_openai"]["split"] == "test"
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(b2["tasks"]["sciq"])
    assert {"acc", "perplexity"} <= set(b2["tasks"]["lambada_openai"])
    assert [p["set"] for p in b2["perplexity"]] == ["demo", "enwiki"] and b2["perplexity"][0]["tokens"] == 130
    assert b2["perplexity"][0]["ppl"] != pytest.approx(b4["perplexity"][0]["ppl"], rel=1e-4)  # budget matters
    assert b2["depth"]["mean"] <= 2 < b4["depth"]["mean"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["budgets"][1]["perplexity"][1]["ppl"] == pytest.approx(b4["perplexity"][1]["ppl"])
    md = (out / "table1.md").read_text()
    for b in (b2, b4):  # the FLOPs executed: J x the measured mean depth, not the nominal J x M
        assert f"| T-LoopFormer (2 ⊗ {b['loops']}) | {2 * b['depth']['mean']:.2f}x |" in md
    assert "PPL demo | PPL enwiki | COPA | HS | LB | OBQA | PIQA | Race | SciQ | ARC-C | SIQA | ARC-E | Avg Acc" in md
    assert "sciq offline: validation split" in md
    for M in (2, 4):
        assert (out / f"depth_M{M}.png").read_bytes()[:4] == b"\x89PNG"
    avg = np.mean([b4["tasks"][t]["acc"] for t in ("copa", "race", "lambada_openai", "sciq")])
    assert b4["avg_acc"] == pytest.approx(avg)
    # MLflow: a new run tagged with variant and preset, metrics for every budget, the files as artifacts
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{env / 'mlflow.db'}")
    r = client.get_run(res["mlflow_run_id"])
    assert r.data.tags["variant"] == "t-loopformer" and r.data.tags["preset"] == "tiny/t-loopformer"
    assert r.data.tags["split.sciq"] == "validation" and r.data.tags["split.copa"] == "validation"
    assert r.data.metrics["eval/M4/sciq/acc"] == pytest.approx(b4["tasks"]["sciq"]["acc"])
    assert r.data.metrics["eval/M2/ppl/enwiki/ppl"] == pytest.approx(b2["perplexity"][1]["ppl"])
    assert r.data.metrics["eval/M4/depth/mean"] == pytest.approx(b4["depth"]["mean"])
    arts = {a.path for a in client.list_artifacts(res["mlflow_run_id"], "eval")}
    assert {"eval/results.json", "eval/table1.md", "eval/depth_M2.png"} <= arts


def test_base_model_budget_does_nothing(env):
    res = run(
        env / "base",
        overrides(env, tasks="[copa]", out_dir=str(env / "out_base"), mlflow="false"),
        loops="1,2,4",
        log=lambda *a: None,
    )
    assert [b["effective_loops"] for b in res["budgets"]] == [1, 1, 1] and "not looped" in res["note"]
    first = res["budgets"][0]
    for b in res["budgets"][1:]:
        assert b["tasks"] == first["tasks"] and b["perplexity"] == first["perplexity"]
    assert first["depth"]["share"] == [1.0]
    assert "| Base (8 ⊗ 1) | 8.00x |" in (env / "out_base" / "table1.md").read_text()


class _Trap:
    """Unpickling this creates a file: the sign that someone ran torch.load(weights_only=False) on it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_logs_into_the_checkpoints_recorded_run(env, tmp_path):
    """The trainer's layout: run dir with `latest` -> global_step<N>/ holding the model export in model/ with its
    plain-JSON run.json (MLflow run id and step). The trainer's pickled rank0_state.pt is never unpickled: a
    booby-trapped one beside it does nothing."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{env / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("train") or client.get_experiment(client.create_experiment("train"))
    train_run = client.create_run(exp.experiment_id).info.run_id
    run_dir = tmp_path / "run"
    shutil.copytree(env / "base", run_dir / "global_step5" / "model")
    rec = run_dir / "global_step5" / "model" / "run.json"
    rec.write_text(json.dumps({"mlflow_run_id": train_run, "tracking_uri": uri, "step": 5}))
    marker = tmp_path / "unpickled"
    torch.save(
        {"step": 9, "mlflow_run_id": "f" * 32, "trap": _Trap(str(marker))}, run_dir / "global_step5" / "rank0_state.pt"
    )
    (run_dir / "latest").write_text("global_step5\n")
    res = run(
        run_dir, overrides(env, tasks="[copa]", perplexity="false", out_dir=str(tmp_path / "o")), log=lambda *a: None
    )
    assert res["mlflow_run_id"] == train_run and res["mlflow_run"] == "checkpoint's run"
    assert not marker.exists()
    hist = client.get_metric_history(train_run, "eval/M1/copa/acc")
    assert (
        len(hist) == 1
        and hist[0].step == 5
        and hist[0].value == pytest.approx(res["budgets"][0]["tasks"]["copa"]["acc"])
    )
    assert client.get_run(train_run).data.tags["eval.split.copa"] == "validation"
    # a run id the tracking store does not know (trained against another store): a new run links it
    rec.write_text(json.dumps({"mlflow_run_id": "0" * 32, "tracking_uri": uri, "step": 5}))
    res = run(
        run_dir, overrides(env, tasks="[copa]", perplexity="false", out_dir=str(tmp_path / "o2")), log=lambda *a: None
    )
    assert res["mlflow_run"] == "new run" and "not in" in res["mlflow_note"]
    assert client.get_run(res["mlflow_run_id"]).data.tags["train_run_id"] == "0" * 32


def test_naive_loop_ee_is_the_base_loop_checkpoint_under_its_own_name(env, tmp_path):
    """--variant naive-loop-ee reads a base-loop export (no training run of its own): the results and a new MLflow
    run carry the naive-loop-ee name and link the base-loop training run; compare shows its rows under it."""
    from mlflow.tracking import MlflowClient
    from evaluation.compare import run as compare

    uri = f"sqlite:///{env / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("train") or client.get_experiment(client.create_experiment("train"))
    train_run = client.create_run(exp.experiment_id, tags={"variant": "base-loop"}).info.run_id
    export = tmp_path / "base-loop"
    shutil.copytree(env / "base-loop", export)
    (export / "run.json").write_text(json.dumps({"mlflow_run_id": train_run, "tracking_uri": uri, "step": 3}))
    ov = overrides(env, tasks="[copa]", perplexity="false", out_dir=str(tmp_path / "o"))
    res = run(export, ov, loops="2", variant="naive-loop-ee", log=lambda *a: None)
    assert res["model"]["variant"] == "naive-loop-ee" and res["model"]["trained_as"] == "base-loop"
    assert res["mlflow_run_id"] != train_run and res["mlflow_run"] == "new run"
    tags = client.get_run(res["mlflow_run_id"]).data.tags
    assert tags["variant"] == "naive-loop-ee" and tags["train_run_id"] == train_run
    assert not client.get_run(train_run).data.metrics  # the base-loop run's own evaluation keys stay free
    assert "| Naive-Loop-EE (2 ⊗ 2) |" in (tmp_path / "o" / "table1.md").read_text()
    t1 = compare(uri, run_ids=(res["mlflow_run_id"],), out=tmp_path / "cmp").tables[0]
    assert [r[0] for r in t1.rows] == ["naive-loop-ee (M=2)"]
    assert t1.rows[0][t1.columns.index("COPA")] == pytest.approx(100 * res["budgets"][0]["tasks"]["copa"]["acc"])
    with pytest.raises(
        ConfigError, match="--variant naive-loop-ee: evaluates a base-loop checkpoint, this one is t-loopformer"
    ):
        run(env / "t-loopformer", overrides(env, mlflow="false"), variant="naive-loop-ee", log=lambda *a: None)


def test_latency_uses_the_inference_benchmark():
    import evaluation.latency as lat_mod
    from evaluation.latency import measure_latency
    from pipeline.inference import timing

    assert lat_mod.timing is timing  # the same ttft()/tpot() that bench/decode.py times
    m, _ = tiny("tiny/t-loopformer")
    lat = measure_latency(m.eval(), 2, "cpu", repeats=1, steps=2, batches=(1, 2))
    assert set(lat["ttft_ms"]) == {"31"} and set(lat["tpot_ms"]) == {"1", "2"}
    assert all(v > 0 for v in list(lat["ttft_ms"].values()) + list(lat["tpot_ms"].values()))
    assert 1 <= lat["decode_mean_depth"] <= 2


def test_latency_in_the_run_outputs(env, tmp_path, monkeypatch):
    """run() measures latency per budget with the benchmark's code (a quick setting here) and reports it in
    the JSON, the markdown and MLflow (the keys `tlf compare` reads)."""
    import evaluation.evaluate as E
    from evaluation.latency import measure_latency

    quick = lambda m, M, d: measure_latency(m, M, d, repeats=1, steps=2, batches=(1, 2))
    monkeypatch.setattr(E, "measure_latency", quick)
    res = run(
        env / "t-loopformer",
        overrides(env, tasks="[]", perplexity="false", latency="true", out_dir=str(tmp_path / "o")),
        loops="1,4",
        log=lambda *a: None,
    )
    lat = [b["latency"] for b in res["budgets"]]
    assert all(set(x["tpot_ms"]) == {"1", "2"} for x in lat) and lat[0]["decode_mean_depth"] == 1.0
    md = (tmp_path / "o" / "table1.md").read_text()
    assert "| M | TTFT ms (P=31) | TPOT ms (B=1) | TPOT ms (B=2) | decode mean depth |" in md
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(tracking_uri=f"sqlite:///{env / 'mlflow.db'}").get_run(res["mlflow_run_id"]).data.metrics
    assert metrics["eval/M4/latency/tpot_ms_B2"] == pytest.approx(lat[1]["tpot_ms"]["2"])
    assert "eval/M1/latency/ttft_ms_P31" in metrics


def test_clear_errors(env, tmp_path):
    with pytest.raises(TaskDataError, match="unknown task 'hellaswagg'"):
        run(env / "base", overrides(env, tasks="[copa,hellaswagg]", mlflow="false"), log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"exceeds the checkpoint's training loops model.loops=4"):
        run(env / "t-loopformer", overrides(env, mlflow="false"), loops="2,8", log=lambda *a: None)
    with pytest.raises(
        ConfigError, match=r"checkpoint is not a tiny/base model: model.variant: checkpoint 't-loopformer'"
    ):
        run(env / "t-loopformer", overrides(env, mlflow="false"), config="tiny/base", log=lambda *a: None)
    mixed = tmp_path / "mixed"  # t-loopformer weights with the base model's config.yaml
    shutil.copytree(env / "t-loopformer", mixed)
    shutil.copy(env / "base" / "config.yaml", mixed / "config.yaml")
    with pytest.raises(ConfigError, match=r"weights do not match its config.yaml"):
        run(mixed, overrides(env, mlflow="false"), log=lambda *a: None)
    with pytest.raises(TaskDataError, match="race: no offline copy"):
        run(
            env / "base",
            overrides(env, tasks="[race]", mlflow="false", strict="true") + [f"eval.race_file={tmp_path / 'no.jsonl'}"],
            log=lambda *a: None,
        )


def test_cli(env, tmp_path):
    from pipeline.cli import main

    r = CliRunner().invoke(
        main,
        [
            "eval",
            str(env / "base"),
            "--tasks",
            "copa",
            "--limit",
            "1",
            "--no-ppl",
            "--no-latency",
            "--no-mlflow",
            "--source",
            "offline",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "copa (validation): acc=" in r.output and (tmp_path / "o" / "results.json").is_file()
    r = CliRunner().invoke(main, ["eval", str(env / "base"), "--tasks", "copa,nope", "--no-mlflow"])
    assert r.exit_code == 2 and "task 'nope' is not one of copa, hellaswag" in r.output
    r = CliRunner().invoke(main, ["eval", str(env / "base"), "--variant", "naive-loop-ee", "--no-mlflow"])
    assert r.exit_code != 0 and "evaluates a base-loop checkpoint, this one is base" in r.output


def test_cli_paths_with_quotes(env, tmp_path):
    """--race-file and --out values reach the config verbatim, quotes included."""
    from pipeline.cli import main

    race = tmp_path / 'it\'s "q"' / "race.jsonl"
    race.parent.mkdir()
    shutil.copy(env / "race.jsonl", race)
    out = tmp_path / "o'ut"
    r = CliRunner().invoke(
        main,
        [
            "eval",
            str(env / "base"),
            "--tasks",
            "race",
            "--limit",
            "1",
            "--no-ppl",
            "--no-latency",
            "--no-mlflow",
            "--source",
            "offline",
            "--race-file",
            str(race),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert "race" in res["budgets"][0]["tasks"]  # read from the quoted path
