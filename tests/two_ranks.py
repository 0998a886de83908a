"""One real 2-rank run under the DeepSpeed launcher (gloo ranks on CPU), shared by the tests that read it: its parts
are the resumes on another world size and ZeRO stage (test_reshard.py), ZeRO 1/2/3 learning and the bit-exact 2-rank
resume (test_train_dist.py), the uninterrupted run that torchrun's restarted job must equal (test_restart.py), a
skipped loss spike and the gradient statistics (test_spikes.py), the zero-shot tasks during training
(test_zeroshot_in_training.py), a data mixture (test_mixture.py) and the per-rank model states against the planner (test_plan_zero.py). Each part
is a function of its test file; a part that raises is recorded with its traceback and the others still run, so
every test reports its own failure (`TwoRanks.part`).

This file is also the worker script: `deepspeed --no_local_rank --num_gpus 2 tests/two_ranks.py OUT TMP`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# part -> (test file, function run on each rank: f(tmp) -> a JSON-able result), in this order: "resume" continues
# the checkpoints of "reshard"; plan_zero's engines are built and left as they are, so it comes last
PARTS = {
    "reshard": ("test_reshard", "two_rank_part"),
    "resume": ("test_train_dist", "resume_part"),
    "zero": ("test_train_dist", "zero_part"),
    "restart": ("test_restart", "two_rank_part"),
    "spikes": ("test_spikes", "two_rank_part"),
    "zeroshot": ("test_zeroshot_in_training", "two_rank_part"),
    "mixture": ("test_mixture", "two_rank_part"),
    "plan_zero": ("test_plan_zero", "two_rank_part"),
}


def worker(out: str, tmp: str) -> None:
    import torch

    from pipeline.train.cli import _exit

    res = {}
    for name, (module, function) in PARTS.items():
        try:
            res[name] = {"ok": getattr(importlib.import_module(module), function)(tmp)}
        except Exception:  # noqa: BLE001 - recorded for the part's own test; the other parts still run
            res[name] = {"error": traceback.format_exc()}
    both = [None, None]
    torch.distributed.all_gather_object(both, res)
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(both))
    _exit(0)


def shm_buffers(port: str) -> set[str]:
    """DeepSpeed's CPU all-reduce buffers in /dev/shm of the run on this master port (one per rank)."""
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")}


@dataclass
class TwoRanks:
    tmp: Path  # the parts' data and checkpoint directories
    results: list | None  # per rank: {part: {"ok": result} or {"error": traceback}}
    failure: str  # why the launcher run gave no results ("" when it did)
    leftover_shm: set  # DeepSpeed all-reduce buffers the run left in /dev/shm (their names hold its port)
    one_rank: dict  # {"ok": test_reshard.one_rank_sources's result} or {"error": traceback}

    def sources(self) -> dict:
        """The 1-rank runs made before the launcher run (test_reshard.one_rank_sources)."""
        assert "error" not in self.one_rank, (
            f"the 1-rank runs before the shared 2-rank run raised:\n{self.one_rank['error']}"
        )
        return self.one_rank["ok"]

    def part(self, name: str) -> list:
        """Rank 0's and rank 1's results of part `name`; fails with that part's traceback if it raised."""
        assert self.results is not None, f"the shared 2-rank launcher run failed: {self.failure}"
        errors = [r[name]["error"] for r in self.results if "error" in r[name]]
        others = [p for p in PARTS if p != name and any("error" in r[p] for r in self.results)]
        also = f" (parts {others} raised too)" if others else ""
        assert not errors, f"part {name!r} of the shared 2-rank run raised{also}:\n{errors[0]}"
        return [r[name]["ok"] for r in self.results]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory) -> TwoRanks:
    from bench.faults import launcher  # (bench is importable in pytest's process, not in the ranks')
    from test_reshard import one_rank_sources
    from test_train import clean_env, make_shards

    tmp = tmp_path_factory.mktemp("two_ranks")
    make_shards(tmp / "rep", windows=4)  # one global batch of 2 ranks x 2, repeated every step
    try:  # the 1-rank checkpoints that the reshard part resumes on 2 ranks (and the shards it reads)
        one_rank = {"ok": one_rank_sources(tmp)}
    except Exception:  # noqa: BLE001 - the reshard part then fails on its missing sources; the others still run
        one_rank = {"error": traceback.format_exc()}
    out = tmp / "out.json"
    cmd = launcher("--no_local_rank", __file__, str(out), str(tmp))  # the real DeepSpeed launcher
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=clean_env(), cwd=tmp)
    ok = p.returncode == 0 and out.is_file()
    failure = "" if ok else f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    results = json.loads(out.read_text()) if ok else None
    return TwoRanks(tmp, results, failure, shm_buffers(cmd[cmd.index("--master_port") + 1]), one_rank)


if __name__ == "__main__":
    worker(*sys.argv[1:])
