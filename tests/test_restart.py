"""Recovery without a person: 2 gloo ranks under torchrun's elastic agent (`--max-restarts`, the README's
restart recipe); rank 1 is SIGKILLed during step 6 of the first attempt (when the loader hands it that step's
micro-batch: an event of the program, not a time); the agent stops rank 0, starts both again, they resume from
the newest complete checkpoint (checkpoint.resume=auto) and the job finishes on its own with exit status 0, the
losses after the resume and the final weights bit-equal to an uninterrupted run (train.deterministic=true).

This file is also the worker script: `torchrun --standalone --nproc-per-node 2 tests/test_restart.py OUT DATA CKPT [KILL_MICRO]`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, clean_env

pytestmark = pytest.mark.slow  # real multi-process runs (`-m 'not slow'` skips them)

STEPS, KILL_MICRO = 8, 5  # 2 ranks x micro-batch 2 = the global batch: micro-batch k is step k + 1


def _cfg(data: str, ck: str):
    from pipeline.config import load_config

    return load_config(
        "tiny/t-loopformer",
        TINY
        + [
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            f"data.dir={data}",
            f"checkpoint.dir={ck}",
            f"schedule.max_steps={STEPS}",
            "checkpoint.interval=2",
            "train.eval_interval=0",
            "train.deterministic=true",
        ],
    )


def two_rank_part(tmp: str) -> dict:
    """The uninterrupted run, in the shared 2-rank launcher run: its start and losses."""
    from pipeline.train.trainer import run

    res = run(_cfg(f"{tmp}/data", f"{tmp}/restart_ref"))
    return {"start": res.start_step, "losses": res.losses}


def worker(out: str, data: str, ck: str, kill: str = "-1") -> None:
    from pipeline.train.cli import _exit
    from pipeline.train.data import TrainLoader
    from pipeline.train.trainer import run

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ["RANK"] == "1" and attempt == "0":
        orig = TrainLoader.next

        def nxt(self):
            if self.micro == int(kill):
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self)

        TrainLoader.next = nxt
    res = run(_cfg(data, ck))
    if os.environ["RANK"] == "0":
        Path(out, f"attempt{attempt}.json").write_text(json.dumps({"start": res.start_step, "losses": res.losses}))
    _exit(0)


def _torchrun(out: Path, data: Path, ck: Path, *extra: str) -> subprocess.CompletedProcess:
    out.mkdir()
    # --standalone: a c10d rendezvous on a free local port, a fresh round per restart (a static --master-port
    # rendezvous hands the restarted gloo ranks the dead attempt's addresses: "connectFullMesh failed")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        __file__,
        str(out),
        str(data),
        str(ck),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env(), cwd=out)


def test_a_killed_rank_restarts_and_the_job_finishes_bit_exact(tmp_path, two_ranks):
    full = two_ranks.part("restart")[0]  # the uninterrupted run (rank 0's)
    p = _torchrun(tmp_path / "run", two_ranks.tmp / "data", tmp_path / "ck", str(KILL_MICRO))
    assert p.returncode == 0, p.stderr[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in p.stderr  # the agent saw rank 1 killed, then restarted
    assert not (tmp_path / "run" / "attempt0.json").exists()  # the first attempt never finished
    again = json.loads((tmp_path / "run" / "attempt1.json").read_text())
    assert again["start"] == 4  # the newest complete checkpoint before step 6: step 4
    assert again["losses"] == full["losses"][4:]  # bit-equal
    final = f"global_step{STEPS}/model/model.safetensors"
    assert (tmp_path / "ck" / final).read_bytes() == (two_ranks.tmp / "restart_ref" / final).read_bytes()


if __name__ == "__main__":
    worker(*sys.argv[1:])
