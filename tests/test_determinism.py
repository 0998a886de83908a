"""train.deterministic: on, two runs of the same command and a run SIGKILLed and resumed give bit-identical losses
with the default thread count; off, nothing is changed (README: resume is as exact as any rerun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from bench.faults import CHILD  # run() in a child that SIGKILLs itself at KILL_AT_MICRO; prints losses
from test_train import PY, REPO, TINY, clean_env, make_shards


def default_threads_env(**extra) -> dict:
    env = clean_env(**extra)
    env.pop("OMP_NUM_THREADS")  # the default thread count: what a user gets
    env.pop("MKL_NUM_THREADS", None)
    return env


def train(args: list[str], **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=default_threads_env(**extra),
    )


def test_deterministic_on_is_bit_exact_across_reruns_and_a_kill(tmp_path):
    data = make_shards(tmp_path / "shards", windows=10)
    common = TINY + [f"data.dir={data}", "checkpoint.interval=3", "train.deterministic=true", "logging.mlflow=false"]
    a = train(common + [f"checkpoint.dir={tmp_path / 'a'}"])
    assert a.returncode == 0, a.stderr[-3000:]
    ra = json.loads(a.stdout.strip().splitlines()[-1])
    assert ra["det"] is True and ra["threads"] == 1 and len(ra["losses"]) == 8
    # SIGKILL during step 5 (after the step-3 checkpoint), then the same command again resumes from step 3
    k = train(common + [f"checkpoint.dir={tmp_path / 'b'}"], KILL_AT_MICRO="4")
    assert k.returncode == -signal.SIGKILL, k.stderr[-3000:]
    assert (tmp_path / "b" / "latest").read_text() == "global_step3"
    b = train(common + [f"checkpoint.dir={tmp_path / 'b'}"])
    assert b.returncode == 0, b.stderr[-3000:]
    rb = json.loads(b.stdout.strip().splitlines()[-1])
    assert rb["start"] == 3 and rb["losses"] == ra["losses"][3:]  # exact float equality


def test_deterministic_off_changes_nothing():
    from pipeline.config import load_config
    from pipeline.train import determinism

    assert load_config("tiny/t-loopformer").train.deterministic is False
    before = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    assert determinism.apply(False, "cpu") == {}
    assert (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    ) == before
    readme = (REPO / "README.md").read_text()
    assert "as exact as any rerun" in readme and "train.deterministic" in readme


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_deterministic_on_sets_the_contract(kind, monkeypatch):
    from pipeline.train import determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = determinism._settings()
    try:
        got = determinism.apply(True, kind)
        assert torch.are_deterministic_algorithms_enabled()
        if kind == "cuda":
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and got["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
            assert torch.utils.deterministic.fill_uninitialized_memory  # a device memset: cheap, kept
        else:
            assert torch.get_num_threads() == 1 and got["cpu_threads"] == 1
            assert not torch.utils.deterministic.fill_uninitialized_memory and not got["fill_uninitialized_memory"]
        determinism.apply(True, kind)  # a second run on: still the settings from before the first
    finally:
        # a later run with it off gets back what was there before (a sweep or notebook runs many in one process)
        assert determinism.apply(False, kind) == {}
        assert determinism._settings() == before and determinism._before is None
