"""The Trainer and its callbacks (pipeline.train.trainer.Trainer, pipeline.train.callbacks): hooks in order,
errors reach on_error and end the MLflow run FAILED, the MLflow keys, tags and console lines of a run stay
those `tlf train` has always written, and the trainer plus its callbacks read the device once per step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.testkit import count_host_reads
from pipeline.train.callbacks import Callback
from test_train import make_shards, one_thread, tiny_cfg  # noqa: F401 (one_thread: autouse fixture)

TRAIN = Path(__file__).resolve().parent.parent / "pipeline" / "train"

# What a 2-step tiny t-loopformer run (budget recipe, one extra validation dir "x") logs: the keys of today.
METRICS = {
    "epoch",
    "grad_norm",
    "grad_norm/embeddings",
    "grad_norm/layers.0",
    "grad_norm/layers.1",
    "grad_norm/modulators",
    "grad_norm/router",
    "grad_norm/other",
    "loss",
    "loss_L",
    "loss_S",
    "loss_align",
    "loss_router",
    "lr",
    "mem/peak_rss_gb",
    "mem/rss_gb",
    "router/balance_kl",
    "router/entropy",
    "router/prior_kl",
    "router/full/active_tokens",
    "router/full/compute_ratio",
    "router/full/depth_share_1",
    "router/full/depth_share_2",
    "router/full/depth_share_3",
    "router/full/mean_depth",
    "router/short/active_tokens",
    "router/short/compute_ratio",
    "router/short/depth_share_1",
    "router/short/depth_share_2",
    "router/short/loops",
    "router/short/mean_depth",
    "router/soft_depth",
    "step_time_s",
    "tokens_per_s",
    "train_time_s",
    "train_tokens",
    "train/spike",
    "perf/data_wait_ms",
    "perf/val_s",
    *(f"{v}/M{m}/{k}" for v in ("val", "val/x") for m in (1, 2, 3) for k in ("loss", "mean_depth", "loop_work")),
    "update_ratio",
    "update_ratio/embeddings",
    "update_ratio/layers.0",
    "update_ratio/layers.1",
    "update_ratio/modulators",
    "update_ratio/router",
    "update_ratio/other",
    "val/loss",
    "val/x",
}  # no mfu (nor plan/mfu) on CPU
VAL = (("val", "val/loss"), ("val/x", "val/x"))  # (metric prefix, the set's own name) of the two validation sets
TAGS = {
    "variant": "t-loopformer",
    "preset": "tiny/t-loopformer",
    "scale": "tiny",
    "world_size": "1",
    "device": "cpu",
    "precision": "fp32",
    "zero_stage": "0",
    "activation_checkpointing": "none",
    "compile": "False",
    "final_step": "2",
    "val_tokens": "128",  # 4 windows of 32 (train.eval_batches=2 x micro-batch 2) of a 257-token split
    "val_split_tokens": "257",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


class Recorder(Callback):
    """A user callback: every hook it sees, with the step (and a metric it was given)."""

    def __init__(self):
        self.events = []

    def pre_train(self):
        self.events.append(("pre_train",))

    def pre_step(self, step):
        self.events.append(("pre_step", step))

    def post_step(self, step, metrics):
        assert all(type(v) in (int, float) for v in metrics.values()), metrics  # host values only
        self.events.append(("post_step", step))

    def log_metrics(self, step, metrics):
        assert metrics["tokens_per_s"] > 0  # filled by the Speed callback before
        self.events.append(("log_metrics", step))

    def end_step(self, step):
        self.events.append(("end_step", step))

    def post_train(self):
        self.events.append(("post_train",))

    def post_checkpoint_saved(self, step, path):
        assert (Path(path).parent / "latest").read_text() == f"global_step{step}"
        self.events.append(("post_checkpoint_saved", step))

    def on_error(self, exc):
        self.events.append(("on_error", type(exc).__name__, str(exc)))

    def close(self, status):
        self.events.append(("close", status))


def test_callbacks_see_the_hooks_in_order_and_one_read_per_step(tmp_path, data):
    from pipeline.train.callbacks import default_callbacks
    from pipeline.train.trainer import Trainer

    rec = Recorder()
    cfg = tiny_cfg(tmp_path, data, "schedule.max_steps=3", "checkpoint.interval=2", "train.eval_interval=0")
    trainer = Trainer.build(cfg, default_callbacks() + [rec])
    files = tuple(str(TRAIN / f) for f in ("trainer.py", "validation.py", "callbacks.py", "logger.py"))
    with count_host_reads(files) as reads:
        res = trainer.fit()
    assert len(reads) == 3, reads  # the step's one read; no callback reads the device
    per_step = lambda s: [("pre_step", s), ("post_step", s), ("log_metrics", s)]
    assert rec.events == [
        ("pre_train",),
        *per_step(1),
        ("end_step", 1),
        *per_step(2),
        ("post_checkpoint_saved", 2),
        ("end_step", 2),  # Checkpointer runs first
        *per_step(3),
        ("end_step", 3),
        ("post_checkpoint_saved", 3),
        ("post_train",),
        ("close", "FINISHED"),
    ]
    assert res.step == 3 and res.checkpoint.endswith("global_step3")


def test_an_error_in_the_step_reaches_on_error_and_the_mlflow_run_fails(tmp_path, data, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.train.callbacks import default_callbacks
    from pipeline.train.data import TrainLoader
    from pipeline.train.trainer import Trainer

    orig = TrainLoader.next

    def nxt(self):
        if self.micro == 1:  # step 2's micro-batch
            raise RuntimeError("disk gone")
        return orig(self)

    monkeypatch.setattr(TrainLoader, "next", nxt)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rec = Recorder()
    cfg = tiny_cfg(
        tmp_path / "ck",
        data,
        "logging.mlflow=true",
        f"logging.tracking_uri={uri}",
        "logging.experiment=e",
        "train.eval_interval=0",
    )
    trainer = Trainer.build(cfg, default_callbacks() + [rec])
    with pytest.raises(RuntimeError, match="disk gone"):
        trainer.fit()
    assert rec.events[-5:] == [
        ("log_metrics", 1),
        ("end_step", 1),
        ("pre_step", 2),
        ("on_error", "RuntimeError", "disk gone"),
        ("close", "FAILED"),
    ]
    run = MlflowClient(uri).get_run(trainer.run_id)
    assert run.info.status == "FAILED" and run.data.tags["final_step"] == "1"


def test_mlflow_keys_tags_and_console_lines_are_unchanged(tmp_path, data, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.train.trainer import run

    extra = make_shards(tmp_path / "x", windows=4, seed=3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = run(
        tiny_cfg(
            tmp_path / "ck",
            data,
            "logging.mlflow=true",
            f"logging.tracking_uri={uri}",
            "logging.experiment=k",
            "schedule.max_steps=2",
            "train.eval_interval=2",
            "model.router_norm=true",
            "objective.router.recipe=budget",
            f"data.extra_val_dirs=[{extra}]",
        )
    )
    r = MlflowClient(uri).get_run(res.run_id)
    system = {k for k in r.data.metrics if k.startswith("system/")}  # MLflow's own: what this machine has
    assert set(r.data.metrics) - system == METRICS and "system/cpu_utilization_percentage" in system
    assert {k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.")} == {**TAGS, "tracking_uri": uri}
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[tlf]")]
    num = r"[\d.e+-]+"
    want = [
        rf"\[tlf\] MLflow run {res.run_id} in experiment 'k' at {re.escape(uri)}",
        rf"\[tlf\] tiny/t-loopformer: {num}M params, 1 rank\(s\) on cpu \(fp32, ZeRO-0\), global batch 2 x 32 "
        rf"tokens, checkpoints in {re.escape(str(tmp_path / 'ck'))}",
        *[
            rf"\[tlf\] step {s}/2 \| loss {num} \(L {num} S {num} align {num}\) \| lr {num} \| gnorm {num} \| "
            rf"[\d,]+ tok/s \| depth {num} \| 0:00:\d\d elapsed, ETA 0:00:\d\d"
            for s in (1, 2)
        ],
        rf"\[tlf\] checkpoint {re.escape(str(tmp_path / 'ck' / 'global_step2'))}",
    ]
    # each validation set at the budgets 1, 2, then its own name (M = L), then M3 (the same pass)
    vals = [rf"{v}/M1/loss {num}, {v}/M2/loss {num}, {n} {num}, {v}/M3/loss {num}" for v, n in VAL]
    want.insert(3, r"\[tlf\] step 2: " + ", ".join(vals) + rf" \({num} s\)")  # and the seconds it took
    for k, (name, d) in enumerate((("val/loss", data), ("val/x", extra))):  # what each validation loss rests on
        want.insert(
            2 + k,
            rf"\[tlf\] {name} rests on [\d,]+ tokens \(\d+ windows of 32; train.eval_batches=\d+\) of "
            rf"{re.escape(str(d))}'s val split \([\d,]+ tokens\)",
        )
    assert len(lines) == len(want), lines
    for pat, line in zip(want, lines):
        assert re.fullmatch(pat, line), (pat, line)
