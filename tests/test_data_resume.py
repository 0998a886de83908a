"""Resume: interrupt prep-data (a real SIGKILL of a subprocess, and in-process interruptions at
checkpoints for every kind of source cursor), rerun the same command, get byte-identical shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep import prep as prep_mod
from data_prep.assets import ensure_assets
from data_prep.config import load_prep_config
from data_prep.prep import prepare

REPO = Path(__file__).resolve().parent.parent


def files_of(d: Path) -> dict:
    """Every file in the directory except the manifest (whose resume bookkeeping legitimately differs)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "manifest.json"}


def final_manifest(d: Path) -> dict:
    m = json.loads((d / "manifest.json").read_text())
    return {k: m[k] for k in ("complete", "splits", "documents", "total_tokens", "resume")}


@pytest.fixture(scope="module")
def texts():
    rows = [json.loads(line) for line in open(ensure_assets()["demo"])]
    return [r["text"][:4000] for r in rows[:60]] + ["", "   "] + [r["text"][:4000] for r in rows[-30:]]


class Interrupt(Exception):
    pass


def run_interrupted(monkeypatch, cfg_kw, after: int) -> bool:
    """Runs prepare() and interrupts it right after its `after`-th checkpoint; True if it was interrupted."""
    calls = {"n": 0}
    orig = prep_mod._Run._checkpoint

    def checkpoint(self, *a, **k):
        orig(self, *a, **k)
        calls["n"] += 1
        if calls["n"] == after:
            raise Interrupt

    monkeypatch.setattr(prep_mod._Run, "_checkpoint", checkpoint)
    try:
        prepare(load_prep_config(values=cfg_kw), log=lambda m: None)
        return False
    except Interrupt:
        return True
    finally:
        monkeypatch.setattr(prep_mod._Run, "_checkpoint", orig)


def make_inputs(tmp: Path, texts) -> dict:
    src = tmp / "src"
    src.mkdir()
    half = len(texts) // 2
    lines = ["" if i == 5 else json.dumps({"text": t}) for i, t in enumerate(texts)]  # a blank line too
    (src / "a.jsonl").write_text("\n".join(lines[:half]) + "\n")
    (src / "b.jsonl").write_text("\n".join(lines[half:]) + "\n")
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    pq.write_table(pa.table({"text": texts}), src / "d.parquet", row_group_size=9)
    (src / "e.txt").write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts if t.strip()))
    return {
        "jsonl-2-files": dict(inputs=[str(src / "a.jsonl"), str(src / "b.jsonl")]),
        "zst": dict(inputs=[str(src / "c.jsonl.zst")]),
        "parquet": dict(inputs=[str(src / "d.parquet")]),
        "txt-paragraph": dict(inputs=[str(src / "e.txt")], txt_mode="paragraph"),
        "hf-stream": dict(source="hf", hf_dataset="parquet", hf_data_files=[str(src / "d.parquet")]),
    }


@pytest.mark.parametrize("kind", ["jsonl-2-files", "zst", "parquet", "txt-paragraph", "hf-stream"])
def test_resume_after_interruptions_is_byte_identical(tmp_path, monkeypatch, texts, kind):
    case = make_inputs(tmp_path, texts)[kind]
    base = dict(source="files", shard_tokens=2500, val_every=4, batch_bytes=9000, workers=0, progress=False)
    base.update(case)
    prepare(load_prep_config(values={**base, "out": str(tmp_path / "ref")}), log=lambda m: None)
    ref = files_of(tmp_path / "ref")
    assert sum(n.startswith(("parquet_val", "data_val")) for n in ref) >= 2  # both splits span shards

    out = str(tmp_path / "out")
    # Interrupted after checkpoints 2, then 5 more, then 1 more (mid-document and at val/train interleavings).
    for after in (2, 5, 1):
        assert run_interrupted(monkeypatch, {**base, "out": out}, after)
        m = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert not m["complete"] and m["resume"]["doc"] > 0
    prepare(load_prep_config(values={**base, "out": out}), log=lambda m: None)
    assert files_of(tmp_path / "out") == ref
    assert final_manifest(tmp_path / "out") == final_manifest(tmp_path / "ref")


def _cmd(out: Path, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "data_prep",
        "prep-data",
        "--source",
        "demo",
        "--out",
        str(out),
        "--max-tokens",
        "700000",
        "--shard-tokens",
        "20000",
        "--workers",
        str(workers),
        "--no-progress",
        "batch_bytes=30000",
    ]


def _kill_after_shard(out: Path, k: int, env: dict) -> bool:
    """prep-data with 2 workers, SIGKILLed by itself right after its k-th shard file is whole (bench/faults.py's
    PREP_CHILD): the kill is an event of the run, so it lands mid-run however fast the machine. True if killed."""
    from bench.faults import PREP_CHILD

    p = subprocess.run(
        [sys.executable, "-c", PREP_CHILD, *_cmd(out, 2)[3:]],
        env={**env, "KILL_AFTER_SHARD": str(k)},
        cwd=REPO,
        capture_output=True,
    )
    return p.returncode == -signal.SIGKILL


def test_sigkill_then_rerun_gives_identical_shards(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref, 0), check=True, env=env, cwd=REPO, capture_output=True)
    out = tmp_path / "out"
    for at in (3, 12):  # the second run resumes the first, then is killed too
        assert _kill_after_shard(out, at, env), f"prep-data was not killed after shard {at}"
    m = json.loads((out / "manifest.json").read_text())
    assert not m["complete"]
    r = subprocess.run(_cmd(out, 1), env=env, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr
    assert files_of(out) == files_of(ref)
    assert final_manifest(out) == final_manifest(ref)


def test_kill_after_the_complete_manifest_leaves_no_resume_buffers(tmp_path, monkeypatch, texts):
    """A kill after the manifest is marked complete and before the resume buffers are unlinked: the
    rerun through `tlf prep-data` ('nothing to do') removes the `.resume_*` files; the shards stay identical."""
    from click.testing import CliRunner

    from data_prep import files as files_mod
    from pipeline.cli import main

    src = make_inputs(tmp_path, texts)["jsonl-2-files"]["inputs"]
    argv = [
        "prep-data",
        "--source",
        "files",
        *sum((["-i", s] for s in src), []),
        "--shard-tokens",
        "2500",
        "--val-every",
        "4",
        "-j",
        "0",
        "--no-progress",
        "batch_bytes=9000",
    ]
    assert CliRunner().invoke(main, argv + ["--out", str(tmp_path / "ref")]).exit_code == 0
    real = files_mod.write_json

    def killed_after_complete(path, obj, *a, **k):  # the kill lands right after the final manifest is renamed
        real(path, obj, *a, **k)
        if isinstance(obj, dict) and obj.get("complete") is True:
            raise Interrupt

    monkeypatch.setattr(prep_mod, "write_json", killed_after_complete)
    out = tmp_path / "out"
    assert isinstance(CliRunner().invoke(main, argv + ["--out", str(out)]).exception, Interrupt)
    assert list(out.glob(".resume_*")), "the kill should have left resume buffers"
    monkeypatch.setattr(prep_mod, "write_json", real)
    r = CliRunner().invoke(main, argv + ["--out", str(out)])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
    assert not list(out.glob(".resume_*"))
    assert files_of(out) == files_of(tmp_path / "ref")
