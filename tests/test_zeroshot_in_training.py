"""Zero-shot tasks during training (train.zeroshot_interval, evaluation/in_training.py): the metrics logged at the
interval steps are `tlf eval`'s of the checkpoint of that step, bit for bit; training is the same with it on and off
(train.deterministic: losses and weights bit-identical; RNG states and the engine's mode untouched); on 2 gloo ranks
(part "zeroshot" of the shared launcher run, tests/two_ranks.py) the all-reduced numbers are on every rank and equal
one process's evaluation of the checkpoint; empty, unknown and unreachable tasks; the cost lines."""

from __future__ import annotations

import contextlib
import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, make_shards

from pipeline.train.callbacks import Callback

TASKS = ["eval.tasks=[copa,piqa]", "eval.limit=8", "eval.source=offline", "eval.batch_size=4"]
LOOPS = "1,3"  # two budgets of the tiny model's L = 3


def over(*extra: str) -> list[str]:
    """TINY with the GPT-2 vocabulary (the tasks' text), the zero-shot settings and `extra`, a key given once."""
    keys = {}
    for o in [*TINY, "model.vocab_size=50304", "schedule.max_steps=4", "checkpoint.interval=2"]:
        keys[o.split("=")[0]] = o
    for o in [*TASKS, f"eval.loops=[{LOOPS}]", "checkpoint.keep_last=3", *extra]:
        keys[o.split("=")[0]] = o
    return list(keys.values())


def eval_keys(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("eval/")}


def tlf_eval(checkpoint: Path, out: Path) -> dict:
    """`tlf eval` of the checkpoint with the same task settings (no perplexity, depth or latency): its MLflow metrics."""
    from evaluation import results
    from evaluation.evaluate import run

    ov = [*TASKS, "eval.perplexity=false", "eval.depth=false", "eval.latency=false", "eval.mlflow=false"]
    res = run(checkpoint, [*ov, "eval.progress=false", f"eval.out_dir={out}"], loops=LOOPS, log=lambda *a: None)
    return results.flatten(res)


def _rng() -> tuple:
    import torch

    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state().numpy().tobytes()


class Before(Callback):
    """Runs before the registered callbacks: what the RNGs and the engine's mode are."""

    def __init__(self) -> None:
        self.seen = {}

    def post_step(self, step, metrics):
        self.seen[step] = (_rng(), self.trainer.engine.module.training)


class After(Callback):
    """Runs after them: the same RNG states and mode, and the step's eval/ metrics."""

    def __init__(self, before: Before) -> None:
        self.before, self.changed, self.logged = before, [], {}

    def post_step(self, step, metrics):
        if (_rng(), self.trainer.engine.module.training) != self.before.seen[step]:
            self.changed.append(step)

    def log_metrics(self, step, metrics):
        self.logged[step] = eval_keys(metrics)


def train(tmp: Path, name: str, *extra: str) -> dict:
    from pipeline.config import load_config
    from pipeline.train.callbacks import pipeline_callbacks, registered_callbacks
    from pipeline.train.trainer import Trainer

    cfg = load_config("tiny/t-loopformer", over(f"data.dir={tmp / 'data'}", f"checkpoint.dir={tmp / name}", *extra))
    before = Before()
    after = After(before)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        res = Trainer.build(cfg, pipeline_callbacks() + [before] + registered_callbacks() + [after]).fit()
    return {"result": res, "after": after, "stdout": out.getvalue(), "stderr": err.getvalue(), "dir": tmp / name}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One deterministic tiny run with the zero-shot tasks every 2 steps (MLflow on) and one without."""
    tmp = tmp_path_factory.mktemp("zeroshot")
    make_shards(tmp / "data", windows=24)
    on = train(
        tmp,
        "on",
        "train.zeroshot_interval=2",
        "train.deterministic=true",
        "logging.mlflow=true",
        f"logging.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
    )
    off = train(tmp, "off", "train.zeroshot_interval=0", "train.deterministic=true")
    return {"on": on, "off": off, "tmp": tmp}


# ------------------------------------------------------------------------------------------ one process
def test_metrics_logged_at_the_interval_steps_only(runs):
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import read_metrics

    on = read_metrics(runs["on"]["dir"] / "metrics.jsonl")
    assert [r["step"] for r in on] == [1, 2, 3, 4]
    assert {r["step"] for r in on if eval_keys(r)} == {2, 4}
    for r in on:
        if r["step"] in (2, 4):
            assert eval_keys(r) == runs["on"]["after"].logged[r["step"]]  # what metrics.jsonl holds is the step's
            assert {"eval/M1/copa/acc", "eval/M3/piqa/acc_norm", "eval/M3/avg_acc"} <= set(r)
    assert not any(eval_keys(r) for r in read_metrics(runs["off"]["dir"] / "metrics.jsonl"))
    client = MlflowClient(f"sqlite:///{runs['tmp'] / 'mlflow.db'}")
    run_id = runs["on"]["result"].run_id
    hist = client.get_metric_history(run_id, "eval/M3/copa/acc")
    assert sorted(m.step for m in hist) == [2, 4]
    assert {m.step: m.value for m in hist} == {s: runs["on"]["after"].logged[s]["eval/M3/copa/acc"] for s in (2, 4)}


def test_the_numbers_are_tlf_eval_of_the_checkpoint_of_that_step_exactly(runs, tmp_path):
    """Same keys, same values bit for bit: one process scores the same requests in the same batches with the same
    weights, and the metrics come from the same per-example outcomes through the same code."""
    logged = runs["on"]["after"].logged
    for step in (2, 4):
        ref = tlf_eval(runs["on"]["dir"] / f"global_step{step}", tmp_path / str(step))
        assert set(ref) == set(logged[step])
        assert logged[step] == ref, step


def test_training_is_the_same_with_it_on_and_off(runs):
    on, off = runs["on"], runs["off"]
    assert on["result"].losses == off["result"].losses  # bit for bit (train.deterministic)
    assert on["result"].val_losses == off["result"].val_losses
    weights = "global_step4/model/model.safetensors"
    assert (on["dir"] / weights).read_bytes() == (off["dir"] / weights).read_bytes()
    assert on["after"].changed == [] and off["after"].changed == []  # RNG states and the engine's mode as before


def test_its_cost_is_said_at_the_start_and_measured_at_the_first_evaluation(runs):
    out = runs["on"]["stdout"]
    start = [ln for ln in out.splitlines() if "zero-shot tasks every 2 steps" in ln]
    assert len(start) == 1, out
    assert "every 2 steps, 2 times in this run: copa, piqa, 16 examples (eval.limit=8) at budgets [1, 3]" in start[0]
    assert " s per evaluation, " in start[0] and "tokens/s measured at M=3" in start[0]
    measured = [ln for ln in out.splitlines() if "zero-shot tasks at step" in ln]
    assert len(measured) == 1 and "zero-shot tasks at step 2: " in measured[0] and "% of this run" in measured[0]
    assert "zero-shot" not in runs["off"]["stdout"]
    each = [ln for ln in out.splitlines() if ln.startswith(("[tlf] step 2: zero-shot", "[tlf] step 4: zero-shot"))]
    assert len(each) == 2 and all("M=1 avg_acc " in ln and "; M=3 avg_acc " in ln and "(copa " in ln for ln in each)


# ---------------------------------------------------------------------------------------- no training
def test_cost_lines_from_given_times():
    from evaluation.in_training import evaluations_in, measured_line

    assert evaluations_in(0, 10, 4) == 2 and evaluations_in(4, 10, 4) == 1 and evaluations_in(0, 3, 4) == 0
    line = measured_line(step=4, seconds=2.0, estimate=1.5, evaluations=10, step_s=0.5, steps=1000)
    assert line == (
        "zero-shot tasks at step 4: 2.0 s (estimated 1.5 s); 10 times that is about 20.0 s, 3.8% of this run "
        "at its 0.5 s per step so far"
    )


def _stub_trainer(*extra: str, max_steps: int = 4):
    from types import SimpleNamespace

    from pipeline.config import load_config

    cfg = load_config("tiny/t-loopformer", [*TASKS, "train.zeroshot_interval=2", *extra])
    return SimpleNamespace(cfg=cfg, rank=0, ws=1, step=0, max_steps=max_steps)


@pytest.mark.parametrize(
    "stub,said",
    [
        ({"extra": ["eval.tasks=[]"]}, "train.zeroshot_interval=2: no zero-shot task to run (eval.tasks=[])"),
        ({"extra": [], "max_steps": 1}, "train.zeroshot_interval=2: no step of 1..1 is a multiple"),
    ],
)
def test_nothing_to_do_is_said_in_one_line(capsys, stub, said):
    """No task (eval.tasks=[], what tlf eval's --tasks none sets), or no step of the run at the interval."""
    from evaluation.in_training import ZeroShot
    from pipeline.train.logger import log

    cb = ZeroShot()
    cb.trainer = _stub_trainer(*stub["extra"], max_steps=stub.get("max_steps", 4))
    log.open(0)
    try:
        cb.pre_train()
        cb.post_step(2, metrics := {})
    finally:
        log.close()
    assert cb.plan is None and metrics == {}
    assert capsys.readouterr().out == f"[tlf] {said}\n"


def test_a_task_out_of_reach_is_skipped_with_one_warning(capsys, tmp_path):
    """RACE offline without its file (tlf eval with eval.strict=false: skipped, one line); the other task runs."""
    from evaluation.in_training import load_plan
    from pipeline.train.logger import log

    log.open(0)
    try:
        plan = load_plan(_stub_trainer("eval.tasks=[copa,race]", f"eval.race_file={tmp_path / 'none.jsonl'}").cfg, 0, 1)
    finally:
        log.close()
    assert list(plan.inp.tasks) == ["copa"] and list(plan.inp.skipped) == ["race"]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("[tlf] warning: train.zeroshot_interval: skipping race"), lines


def test_an_unknown_task_is_a_config_error():
    from evaluation.in_training import load_plan
    from pipeline.config import ConfigError, load_config

    cfg = load_config("tiny/t-loopformer", ["eval.tasks=[copaa]", "train.zeroshot_interval=2"])
    with pytest.raises(ConfigError, match=r"eval.tasks \(train.zeroshot_interval=2\): unknown task 'copaa'"):
        load_plan(cfg, 0, 1)


# ------------------------------------------------------------------------------------------- two ranks
def two_rank_part(tmp: str) -> dict:
    """Run on each rank of the shared launcher run: 2 gloo ranks under ZeRO-3 (the gathered-copy path), the tasks
    every 2 steps: the eval/ metrics this rank holds at each step, and the steps where the RNGs or the mode changed."""
    from pipeline.config import load_config
    from pipeline.train.callbacks import pipeline_callbacks, registered_callbacks
    from pipeline.train.trainer import Trainer

    dist = ["train.micro_batch_size=2", "train.global_batch_size=4", "train.zero_stage=3", "train.eval_interval=0"]
    extra = [f"data.dir={tmp}/rep", f"checkpoint.dir={tmp}/zeroshot", "train.zeroshot_interval=2", *dist]
    before = Before()
    after = After(before)
    cbs = pipeline_callbacks() + [before] + registered_callbacks() + [after]
    Trainer.build(load_config("tiny/t-loopformer", over(*extra)), cbs).fit()
    return {"metrics": {str(s): m for s, m in after.logged.items() if m}, "changed": after.changed}


@pytest.mark.slow
def test_two_ranks_all_reduce_to_the_one_process_numbers(two_ranks, tmp_path):
    from pipeline.tracking import read_metrics

    p0, p1 = two_ranks.part("zeroshot")
    assert p0["changed"] == p1["changed"] == []  # RNG states and the engine's mode as before, on both ranks
    r0, r1 = p0["metrics"], p1["metrics"]
    assert set(r0) == {"2", "4"} and r0 == r1  # every rank holds the totals
    logged = {str(r["step"]): eval_keys(r) for r in read_metrics(two_ranks.tmp / "zeroshot" / "metrics.jsonl")}
    for step in ("2", "4"):
        assert logged[step] == r0[step]  # rank 0 logs them
        assert r0[step] == tlf_eval(two_ranks.tmp / "zeroshot" / f"global_step{step}", tmp_path / step), step
