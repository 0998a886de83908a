"""Kill trials: SIGKILL `tlf train` at seeded random moments (and inside a checkpoint save, and inside the final
export), rerun the same command, and check the finished run equals an uninterrupted one.

Every run is `pipeline.train.trainer.run` in a fresh process group with `train.deterministic=true`, so "equals" is
exact float equality of the losses after the resume point. A trial diverges when the rerun fails, resumes from
somewhere other than the newest complete checkpoint, or its losses differ from the reference's.

    python bench/faults.py --trials 10 --seed 0 --out bench/results/faults.json

Covered: `tlf train` in one process. Not yet covered: prep-data, 2 gloo ranks under the launcher, tlf eval.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.interleave import write_json  # noqa: E402
from data_prep.shards import write_shard  # noqa: E402

# A model small enough that a step takes milliseconds on CPU.
TINY = ["model.vocab_size=512", "model.block_size=32", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "model.n_layers=2", "model.loops=3", "model.fourier_dim=16", "train.micro_batch_size=2",
        "train.global_batch_size=2", "schedule.warmup_steps=2", "train.eval_interval=0", "logging.mlflow=false",
        "train.deterministic=true"]

# KILL_IN_SAVE=N: SIGKILL itself inside the save of step N, after DeepSpeed's files and the rank state, before
# the export (N = max_steps: the final export). KILL_AT_MICRO=k: SIGKILL itself when the loader hands out
# micro-batch k (during step k+1 at batch 2). Prints the losses, the steps it started from and ended at, and the
# process's thread count and deterministic-algorithms flag (before and after the run). The tests use it too.
CHILD = """
import json, os, signal, sys, torch
from pipeline.config import load_config
from pipeline.train import checkpoint
from pipeline.train.trainer import run
from pipeline.train.data import TrainLoader
kill = os.environ.get("KILL_IN_SAVE")
kill_micro = int(os.environ.get("KILL_AT_MICRO", "-1"))
orig = TrainLoader.next
def nxt(self):
    if self.micro == kill_micro:
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(self)
TrainLoader.next = nxt
real = checkpoint.export_model
def export(engine, model, cfg, directory, rank):
    if kill and f"global_step{kill}" in str(directory):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(engine, model, cfg, directory, rank)
checkpoint.export_model = export
before = torch.get_num_threads()
res = run(load_config("tiny/t-loopformer", sys.argv[1:]))
print(json.dumps({"losses": [float(x) for x in res.losses], "start": res.start_step, "step": res.step,
                  "threads_before": before, "threads": torch.get_num_threads(),
                  "det": torch.are_deterministic_algorithms_enabled()}))
"""


def _env() -> dict:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "DS_ACCELERATOR": "cpu"}


def _start(args: list[str], **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**_env(), **extra}, start_new_session=True)


def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    if p.returncode:
        raise RuntimeError(f"exit {p.returncode}: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _newest_complete(ck: Path) -> int:
    from pipeline.train.checkpoint import complete_checkpoints

    done = complete_checkpoints(ck) if ck.exists() else []
    return done[-1][0] if done else 0


def train_trials(n: int, seed: int, work: Path, steps: int = 8, interval: int = 2) -> dict:
    """n kill trials of single-process `tlf train`, in turn: killed inside a save (the first in the final export),
    during a random step, at a random time after the start (which may fall in start-up, or after the end). Returns counts and per-trial records."""
    data = work / "shards"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 512, 10 * 32 + 1))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 512, 8 * 32 + 1))
    common = TINY + [f"data.dir={data}", f"schedule.max_steps={steps}", f"checkpoint.interval={interval}"]
    t0 = time.perf_counter()
    ref = _finish(_start(common + [f"checkpoint.dir={work / 'ref'}"]))
    ref_s = time.perf_counter() - t0
    r = random.Random(seed)
    trials, divergences = [], 0
    for i in range(n):
        ck = work / f"trial{i}"
        args = common + [f"checkpoint.dir={ck}"]
        if i % 3 == 0:
            at = steps if i == 0 else r.choice(range(interval, steps + 1, interval))
            how = f"in save of step {at}" + (" (final export)" if at == steps else "")
            p = _start(args, KILL_IN_SAVE=str(at))
            p.communicate(timeout=600)
        elif i % 3 == 1:
            micro = r.randrange(steps)
            how = f"during step {micro + 1}"
            p = _start(args, KILL_AT_MICRO=str(micro))
            p.communicate(timeout=600)
        else:
            delay = r.uniform(0.0, ref_s)
            how = f"after {delay:.2f} s"
            p = _start(args)
            try:
                p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=600)
        killed = p.returncode == -signal.SIGKILL
        newest = _newest_complete(ck)
        rec = {"trial": i, "kill": how, "killed": killed, "newest_complete": newest}
        try:
            res = _finish(_start(args))
            ok = res["start"] == (newest if newest < steps else steps) and res["losses"] == ref["losses"][res["start"]:]
            rec.update(resumed_from=res["start"], ok=ok)
        except RuntimeError as e:
            rec.update(ok=False, error=str(e)[-500:])
        divergences += not rec["ok"]
        trials.append(rec)
        print(f"train trial {i}: killed {how} ({'killed' if killed else 'finished first'}), newest complete "
              f"step {newest}, rerun {'matches' if rec['ok'] else 'DIVERGES'}", flush=True)
    return {"stage": "train (1 process)", "trials": n, "killed": sum(t["killed"] for t in trials),
            "divergences": divergences, "records": trials}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/faults.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = train_trials(a.trials, a.seed, Path(tmp))
    print(f"{res['stage']}: {res['trials']} trials, {res['killed']} killed mid-run, {res['divergences']} divergences")
    write_json(a.out, {"seed": a.seed, "stages": [res]})
    sys.exit(1 if res["divergences"] else 0)


if __name__ == "__main__":
    main()
