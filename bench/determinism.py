"""train.deterministic: the drift of reruns with it off, and its step-time cost.

Runs `tlf train`'s run() on `--preset` (synthetic token shards) in fresh processes with the default thread count,
alternating off/on (`--runs` each, interleaved so machine load hits both alike). Reports per setting: the largest
|loss difference| between reruns of the same command and the first step where they differ, and the median step
time (wall and process CPU, from the loader's hand-outs, first 2 steps dropped as warm-up).

    python bench/determinism.py --steps 30 --runs 2 --out bench/results/determinism.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.interleave import write_json
from data_prep.shards import write_shard

CHILD = """
import json, sys, time
from pipeline.config import load_config
from pipeline.train.data import TrainLoader
from pipeline.train.trainer import run
import torch
marks = []
orig = TrainLoader.next
def nxt(self):
    marks.append((time.perf_counter(), time.process_time()))
    return orig(self)
TrainLoader.next = nxt
res = run(load_config(sys.argv[1], sys.argv[2:]))
w = sorted(b[0] - a[0] for a, b in zip(marks[2:], marks[3:]))
c = sorted(b[1] - a[1] for a, b in zip(marks[2:], marks[3:]))
print(json.dumps({"losses": [float(x) for x in res.losses], "wall_s": w[len(w) // 2], "cpu_s": c[len(c) // 2],
                  "threads": torch.get_num_threads()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny/t-loopformer")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="bench/results/determinism.json")
    a = ap.parse_args()
    from pipeline.config import load_config

    cfg = load_config(a.preset)
    T, V = cfg.model.block_size, cfg.model.vocab_size
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["DS_ACCELERATOR"] = "cpu"
    runs: dict[str, list] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        n = cfg.train.global_batch_size * (a.steps + 1)
        write_shard(Path(tmp) / "s_train_000000.bin", rng.integers(0, V, n * T + 1))
        write_shard(Path(tmp) / "s_val_000000.bin", rng.integers(0, V, 4 * T + 1))
        for i in range(a.runs):
            for det in ("off", "on"):
                args = [
                    a.preset,
                    f"data.dir={tmp}",
                    f"checkpoint.dir={tmp}/ck-{det}-{i}",
                    f"schedule.max_steps={a.steps}",
                    "checkpoint.interval=0",
                    "train.eval_interval=0",
                    "logging.mlflow=false",
                    f"train.deterministic={'true' if det == 'on' else 'false'}",
                ]
                p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env)
                if p.returncode:
                    raise SystemExit(p.stderr[-3000:])
                r = json.loads(p.stdout.strip().splitlines()[-1])
                runs[det].append(r)
                print(
                    f"run {i} deterministic={det}: threads {r['threads']}, step {r['wall_s'] * 1e3:.1f} ms wall "
                    f"{r['cpu_s'] * 1e3:.1f} ms cpu",
                    flush=True,
                )
    out = {"preset": a.preset, "steps": a.steps, "runs": a.runs, "cpu_count": os.cpu_count()}
    for det, rs in runs.items():
        ref = np.array(rs[0]["losses"])
        diffs = [np.abs(np.array(r["losses"]) - ref) for r in rs[1:]]
        first = [int(np.flatnonzero(d)[0]) + 1 if d.any() else None for d in diffs]
        out[det] = {
            "threads": rs[0]["threads"],
            "max_abs_loss_diff": float(max((d.max() for d in diffs), default=0.0)),
            "first_differing_step": first,
            "step_wall_ms": float(np.median([r["wall_s"] for r in rs]) * 1e3),
            "step_cpu_ms": float(np.median([r["cpu_s"] for r in rs]) * 1e3),
        }
        print(
            f"deterministic={det}: threads {out[det]['threads']}, max |loss diff| between reruns "
            f"{out[det]['max_abs_loss_diff']:.3g} (first differing step {first}), step "
            f"{out[det]['step_wall_ms']:.1f} ms wall / {out[det]['step_cpu_ms']:.1f} ms cpu"
        )
    write_json(a.out, out)


if __name__ == "__main__":
    main()
