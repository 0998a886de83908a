"""Which checkpoint is used after a kill or damage: a kill at the `latest` rename, a truncated or missing
newest checkpoint file, and a full disk inside DeepSpeed's own save. Training runs as a real child process
(bench/faults.py's CHILD, the trainer's real entry) where it is killed, and through `tlf train` for a legacy
checkpoint; the other runs (the uninterrupted one, those damaged afterwards, the resumes) call the child's entry,
run(), in this process (helpers.run_here). Reruns are compared with the uninterrupted run."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.faults import CHILD
from test_train import TINY, clean_env, make_shards

PY = sys.executable


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


@pytest.fixture(scope="module")
def full(data, tmp_path_factory) -> dict:
    """The uninterrupted 6-step run."""
    return here(tmp_path_factory.mktemp("full"), data, 6)


def args(root: Path, data: Path, steps: int) -> list[str]:
    return TINY + [
        f"data.dir={data}",
        f"checkpoint.dir={root}",
        "checkpoint.interval=2",
        "checkpoint.keep_last=3",
        f"schedule.max_steps={steps}",
        "train.eval_interval=0",
        "train.deterministic=true",
    ]


def child(root: Path, data: Path, steps: int, **env) -> subprocess.CompletedProcess:
    a = args(root, data, steps)
    return subprocess.run([PY, "-c", CHILD, *a], capture_output=True, text=True, timeout=300, env=clean_env(**env))


def here(root: Path, data: Path, steps: int) -> dict:
    """The same run as `child` without a kill, in this process (helpers.run_here: the child's entry, run())."""
    from helpers import run_here

    return run_here(args(root, data, steps))


def test_kill_at_the_latest_rename(tmp_path, data, full, capfd):
    """`latest` still names step 2 and its temp file is left; eval/generate and the resume use step 4 anyway, each
    with one warning naming both, and the next save removes the temp file."""
    from pipeline.model.io import find_export

    root = tmp_path / "ck"
    p = child(root, data, 6, KILL_AT_LATEST="4")
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (root / "latest").read_text() == "global_step2" and list(root.glob(".latest.tmp*"))
    capfd.readouterr()
    assert find_export(root) == root / "global_step4" / "model"  # what `tlf eval RUN_DIR` / `tlf generate` load
    said = capfd.readouterr().err
    res = here(root, data, 6)  # the resume
    for err in (said, capfd.readouterr().err):
        warn = [ln for ln in err.splitlines() if "latest" in ln]
        assert len(warn) == 1 and warn[0].startswith("[tlf] warning: "), err[-3000:]
        assert f"{root / 'latest'} names 'global_step2'; using {root / 'global_step4'}" in warn[0], warn
    assert res["start"] == 4 and res["losses"] == full["losses"][4:]
    assert (root / "latest").read_text() == "global_step6" and not list(root.glob(".latest.tmp*"))


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, data, full, capfd):
    """A missing file (the export) or a truncated one (DeepSpeed's model states) in the newest checkpoint: eval and
    the resume use the previous one, with one warning line naming both."""
    from pipeline.model.io import find_export
    from pipeline.rundir import damage

    root = tmp_path / "ck"
    here(root, data, 4)
    (root / "global_step4" / "model" / "model.safetensors").rename(tmp_path / "kept")
    assert damage(root / "global_step4") == "model/model.safetensors is missing"
    assert find_export(root) == root / "global_step2" / "model"
    (tmp_path / "kept").rename(root / "global_step4" / "model" / "model.safetensors")
    f = root / "global_step4" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    assert find_export(root) == root / "global_step2" / "model"
    capfd.readouterr()
    res = here(root, data, 6)  # the resume
    err = capfd.readouterr().err
    warn = [ln for ln in err.splitlines() if "damaged" in ln]
    assert len(warn) == 1 and str(root / "global_step4") in warn[0] and str(root / "global_step2") in warn[0], err
    assert f.name in warn[0]
    assert res["start"] == 2 and res["losses"] == full["losses"][2:]


@pytest.mark.parametrize("hurt", ["truncated", "missing"])
def test_legacy_checkpoint_damaged_newest_falls_back_through_tlf_train(tmp_path, data, full, hurt):
    """A checkpoint written before files.json existed (none in either checkpoint dir) whose newest DeepSpeed file is
    cut short or gone: `tlf train` falls back to the previous one with one warning line naming both (it raised a
    traceback from DeepSpeed's load), and the resumed run's losses are the uninterrupted run's."""
    from pipeline.tracking import read_metrics

    root = tmp_path / "ck"
    here(root, data, 4)
    for f in root.glob("global_step*/files.json"):
        f.unlink()
    f = root / "global_step4" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:-200]) if hurt == "truncated" else f.unlink()
    args = TINY + [
        f"data.dir={data}",
        f"checkpoint.dir={root}",
        "checkpoint.interval=2",
        "checkpoint.keep_last=3",
        "schedule.max_steps=6",
        "train.eval_interval=0",
        "train.deterministic=true",
        "train.log_interval=1",
    ]
    p = subprocess.run(
        [str(Path(PY).with_name("tlf")), "train", "tiny/t-loopformer", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out[-3000:]
    warn = [ln for ln in out.splitlines() if "is damaged (" in ln]
    assert len(warn) == 1 and str(root / "global_step4") in warn[0] and str(root / "global_step2") in warn[0], out
    assert f.name in warn[0] and ("cut short" in warn[0] if hurt == "truncated" else "missing" in warn[0]), warn
    assert f"resumed from {root / 'global_step2'}" in out, out[-3000:]
    got = {m["step"]: m["loss"] for m in read_metrics(root / "metrics.jsonl") if "loss" in m}
    assert [got[s] for s in (3, 4, 5, 6)] == pytest.approx(full["losses"][2:], rel=0, abs=0), got
