"""The warm-up-stable-decay schedule (schedule.decay=wsd): its learning-rate curve, a run killed in its stable phase
and resumed with a larger schedule.max_steps continuing bit for bit as a run that had that value from the start,
and a cooldown branch from a stable checkpoint into a new run directory: the same losses as a run with the shorter
schedule from the start, the source run untouched, and a new MLflow run tagged with where it branched from.
The killed run is a real child process (bench/faults.py's CHILD, the trainer's real entry); its resume, the runs
compared with it and the branch call the same entry, run(), in this process (helpers.run_here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import CHILD
from pipeline.config import ConfigError, load_config
from pipeline.train.ds import lr_multiplier
from test_no_clobber import digests
from test_train import TINY, clean_env, make_shards

WSD = ["schedule.decay=wsd", "schedule.decay_steps=2", "schedule.warmup_steps=2", "schedule.min_lr=1e-3"]


def curve(steps: int, *extra: str) -> list[float]:
    cfg = load_config("tiny/t-loopformer", [*WSD, f"schedule.max_steps={steps}", *extra])
    f = lr_multiplier(cfg)
    return [f(i) for i in range(steps)]


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_the_learning_rate_warms_up_stays_then_decays_to_min_lr_at_the_last_update(shape):
    lr = curve(10, "schedule.decay_steps=4", f"schedule.decay_shape={shape}", "optim.lr=1e-2")
    assert lr[:2] == [0.5, 1.0] and lr[2:6] == [1.0] * 4
    assert all(a > b for a, b in zip(lr[5:], lr[6:])) and lr[-1] == pytest.approx(0.1)
    mid = {"linear": 0.55, "cosine": 0.55, "1-sqrt": 1 - 0.9 * 0.5**0.5}[shape]
    assert lr[7] == pytest.approx(mid)  # halfway through the decay


def test_the_stable_phase_does_not_depend_on_max_steps():
    short, long = curve(6), curve(40)
    assert short[:4] == long[:4]


@pytest.mark.parametrize(
    "bad,key",
    [
        (["schedule.decay=wsd"], "schedule.decay_steps=0"),
        (["schedule.decay_steps=3"], "schedule.decay=cosine"),
        (["schedule.decay=wsd", "schedule.decay_steps=7", "schedule.max_steps=8"], "exceed schedule.max_steps=8"),
    ],
)
def test_inconsistent_wsd_keys_are_named(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny/t-loopformer", ["schedule.warmup_steps=2", *bad])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


def args(root: Path, data: Path, steps: int, *extra: str) -> list[str]:
    return [
        *TINY,
        *WSD,
        f"data.dir={data}",
        f"checkpoint.dir={root}",
        "checkpoint.interval=2",
        "checkpoint.keep_last=4",
        f"schedule.max_steps={steps}",
        "train.eval_interval=0",
        "train.log_interval=1",
        "train.deterministic=true",
        *extra,
    ]


def child(root: Path, data: Path, steps: int, *extra: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args(root, data, steps, *extra)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(**env),
    )


def here(root: Path, data: Path, steps: int, *extra: str) -> dict:
    """The same run as `child` without a kill, in this process (helpers.run_here: the child's entry, run())."""
    from helpers import run_here

    return run_here(args(root, data, steps, *extra))


@pytest.fixture(scope="module")
def full8(data, tmp_path_factory) -> tuple[Path, dict]:
    """The uninterrupted 8-step wsd run (stable through step 6), logged to MLflow."""
    root = tmp_path_factory.mktemp("full8")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    res = here(root / "run", data, 8, "logging.mlflow=true", f"logging.tracking_uri={uri}")
    return root / "run", res


def test_a_run_killed_in_its_stable_phase_extends_bit_for_bit(tmp_path, data, full8):
    """A 6-step run killed after its step-4 save (stable until step 4) and resumed with schedule.max_steps=8: the
    losses after the kill are the 8-step run's, exactly."""
    root = tmp_path / "run"
    p = child(root, data, 6, KILL_AFTER_SAVE="4")
    assert p.returncode != 0
    res = here(root, data, 8)
    assert res["start"] == 4 and res["losses"] == full8[1]["losses"][4:]


def test_a_cooldown_branch_decays_from_a_stable_checkpoint_without_touching_the_source(tmp_path, data, full8):
    """checkpoint.resume=<the 8-step run's step 4> into a new checkpoint.dir with schedule.max_steps=6: its steps
    5-6 are a 6-step run's (which decays there), the source's files keep their bytes, and its MLflow run is a new
    one tagged with the checkpoint, step and run it branched from."""
    from mlflow.tracking import MlflowClient

    source, src = full8
    before = digests(source)
    uri = f"sqlite:///{source.parent / 'mlflow.db'}"
    six = here(tmp_path / "six", data, 6)
    flags = ["logging.mlflow=true", f"logging.tracking_uri={uri}", f"checkpoint.resume={source / 'global_step4'}"]
    branch = here(tmp_path / "cool", data, 6, *flags)
    assert branch["start"] == 4 and branch["losses"] == six["losses"][4:]
    assert branch["losses"] != src["losses"][4:6]  # the 8-step run was still stable there
    assert digests(source) == before
    tracking = json.loads((tmp_path / "cool" / "tracking.json").read_text())
    source_run = json.loads((source / "tracking.json").read_text())["run_id"]
    assert tracking["run_id"] != source_run
    tags = MlflowClient(uri).get_run(tracking["run_id"]).data.tags
    assert tags["branched_from"] == str(source / "global_step4") and tags["branched_from_step"] == "4"
    assert tags["branched_from_run"] == source_run
