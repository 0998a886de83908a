"""DeepSpeed's shm op: a one-process CPU run does not JIT-build it (nothing to all-reduce with); a multi-rank run
says once, with the directory, that it is building; extension builds go to a per-virtualenv directory."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.faults import CHILD, TINY, _env
from data_prep.shards import write_shard
from pipeline.train import ds

import numpy as np


def test_one_process_cpu_run_builds_no_extension(tmp_path):
    ext = tmp_path / "ext"
    data = tmp_path / "shards"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 512, 10 * 32 + 1))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 512, 8 * 32 + 1))
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            *TINY,
            f"data.dir={data}",
            "schedule.max_steps=1",
            f"checkpoint.dir={tmp_path / 'ck'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(TORCH_EXTENSIONS_DIR=str(ext)),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert not ext.exists() or not list(ext.rglob(f"{ds.SHM_OP}*")), list(ext.rglob("*"))
    assert "building" not in p.stderr


def test_extensions_dir_defaults_under_the_venv(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    d = ds.extensions_dir()
    assert d == __import__("pathlib").Path(sys.prefix) / ".cache" / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(d)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert str(ds.extensions_dir()) == "/somewhere/else"


def test_a_multi_rank_build_is_announced_once_with_its_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = []
    monkeypatch.setattr(ds._ds_torch(), "build_shm_op", lambda: built.append(1) or "op")
    assert ds._shm_op(1, 0)() is None and not built  # a group of one: DeepSpeed's builder is never called
    assert ds._shm_op(2, 1)() == "op" and capsys.readouterr().err == ""  # local rank 1 stays quiet
    assert ds._shm_op(2, 0)() == "op"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{ds.SHM_OP} op into {tmp_path}" in err
    so = tmp_path / ds.SHM_OP / f"{ds.SHM_OP}.so"  # as torch lays it out under $TORCH_EXTENSIONS_DIR
    so.parent.mkdir(parents=True)
    so.write_bytes(b"")
    assert ds._shm_op(2, 0)() == "op" and capsys.readouterr().err == ""  # built already: nothing said
