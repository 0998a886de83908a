"""A start never overwrites a run: `tlf train` into a run directory holding another run (or checkpoints past the
one resumed) refuses with one line and touches nothing (sha256 of every file before and after); `--overwrite` moves
the directory aside whole; a checkpoint's files.json holds every file's sha256, so a same-size bit flip is found and
the newest checkpoint falls back, and the damaged one is renamed, never overwritten."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import TINY, clean_env, make_shards

TLF = str(Path(sys.executable).with_name("tlf"))


def args(data: Path, root: Path, steps: int) -> list[str]:
    return [
        "tiny/t-loopformer",
        *TINY,
        f"data.dir={data}",
        f"checkpoint.dir={root}",
        "checkpoint.interval=2",
        "checkpoint.keep_last=3",
        f"schedule.max_steps={steps}",
        "train.eval_interval=0",
        "train.log_interval=1",
        "train.deterministic=true",
    ]


def train(data: Path, root: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TLF, "train", *args(data, root, steps), *extra], capture_output=True, text=True, timeout=300, env=clean_env()
    )


def digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def losses(root: Path) -> dict[int, float]:
    from pipeline.tracking import read_metrics

    return {m["step"]: m["loss"] for m in read_metrics(root / "metrics.jsonl") if "loss" in m}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


@pytest.fixture(scope="module")
def earlier(data, tmp_path_factory) -> Path:
    """An earlier run's directory: checkpoints at steps 2 and 4, four lines of metrics. (Made by `tlf train`'s
    run() in this process, helpers.run_here: the starts into it are the real `tlf train`.)"""
    from helpers import run_here

    root = tmp_path_factory.mktemp("earlier") / "run"
    preset, *over = args(data, root, 4)
    assert run_here(over, preset)["step"] == 4
    return root


@pytest.fixture
def run_dir(earlier, tmp_path) -> Path:
    """A copy of the earlier run, for a test to start into."""
    shutil.copytree(earlier, tmp_path / "run")
    return tmp_path / "run"


def refused(p: subprocess.CompletedProcess) -> str:
    """The one error line of a refused start (exit 1, no traceback)."""
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.mark.parametrize("how", ["resume none", "another config", "rewind"])
def test_a_start_that_would_overwrite_is_refused_and_touches_nothing(data, run_dir, how):
    """`--resume none`, a fresh start of another run from elsewhere, and a resume from step 2 while step 4 exists:
    refused naming what is there and both ways on; every file as it was."""
    before = digests(run_dir)
    extra = {
        "resume none": ["--resume", "none"],
        "another config": ["--resume", "none", "optim.lr=2e-2"],
        "rewind": ["--resume", str(run_dir / "global_step2")],
    }[how]
    line = refused(train(data, run_dir, 4, *extra))
    assert f"checkpoint.dir={run_dir}" in line and "global_step4" in line, line
    assert "another checkpoint.dir" in line and "--overwrite" in line, line
    if how != "rewind":
        assert "global_step2" in line and "metrics.jsonl" in line, line
    assert digests(run_dir) == before
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]


def test_overwrite_moves_the_old_run_aside_whole(data, run_dir, earlier):
    """`--resume none --overwrite`: the old run is a sibling `run.replaced-<time>`, byte for byte; the new run's
    directory holds only the new run, whose losses are the old one's (same config, deterministic)."""
    before = digests(run_dir)
    p = train(data, run_dir, 4, "--resume", "none", "--overwrite")
    assert p.returncode == 0, p.stderr[-3000:]
    (aside,) = run_dir.parent.glob("run.replaced-*")
    assert digests(aside) == before
    assert f"moved {run_dir}" in p.stdout + p.stderr
    assert losses(run_dir) == losses(aside)
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]


def test_overwrite_rewind_resumes_from_the_moved_checkpoint(data, run_dir):
    """`--resume RUN/global_step2 --overwrite`: the run continues from step 2 of the moved directory, bit for bit
    as the old run did; the old run's step 4 stays as it was."""
    old = losses(run_dir)
    p = train(data, run_dir, 4, "--resume", str(run_dir / "global_step2"), "--overwrite")
    assert p.returncode == 0, p.stderr[-3000:]
    (aside,) = run_dir.parent.glob("run.replaced-*")
    assert f"resumed from {aside / 'global_step2'}" in p.stdout + p.stderr
    assert losses(run_dir) == {s: old[s] for s in (3, 4)}
    assert (aside / "global_step4" / "rank0_state.pt").is_file()


def test_files_json_holds_a_checksum_of_every_file(earlier):
    """Every file of a checkpoint is listed with its size and sha256, and the sha256 is the file's."""
    import json

    ck = earlier / "global_step4"
    rec = json.loads((ck / "files.json").read_text())
    files = {k: v for k, v in digests(ck).items() if k != "files.json"}
    assert set(rec) == set(files) and "model/model.safetensors" in rec
    assert all(rec[k]["sha256"] == files[k] and rec[k]["size"] == (ck / k).stat().st_size for k in files)


def test_a_same_size_bit_flip_falls_back_and_is_kept_aside(data, run_dir):
    """One bit flipped in the newest checkpoint's weights (size unchanged): generate/eval's loader and the resume
    take step 2 with a warning naming the mismatch; the save at step 4 renames the damaged checkpoint
    `global_step4.damaged` (its bytes as they were) instead of overwriting it, and the run ends as the earlier did."""
    from pipeline.model.io import find_export
    from pipeline.rundir import damage

    f = run_dir / "global_step4" / "model" / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[-5] ^= 1
    f.write_bytes(bytes(b))
    assert "sha256" in damage(run_dir / "global_step4")
    assert damage(run_dir / "global_step4", deep=False) is None  # sizes alone do not see it
    assert find_export(run_dir) == run_dir / "global_step2" / "model"
    flipped, old = digests(run_dir / "global_step4"), losses(run_dir)
    p = train(data, run_dir, 6)
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [ln for ln in p.stderr.splitlines() if "is damaged (" in ln]
    assert len(warn) == 1 and "sha256 mismatch" in warn[0] and "global_step2" in warn[0], p.stderr
    assert digests(run_dir / "global_step4.damaged") == flipped
    assert damage(run_dir / "global_step4") is None
    assert {s: losses(run_dir)[s] for s in (3, 4)} == {s: old[s] for s in (3, 4)}
