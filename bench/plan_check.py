"""How far off is `tlf plan`? Runs the real `tlf train` (one process, DeepSpeed at world size 1) for a few steps
per case on real shards, plans the same config, world size and micro-batch on --gpu's row (`tlf plan`'s
`Planner`, in this process) and reads back from each run's metrics.jsonl (docs/planning.md): the measured
CUDA max allocated at the first step and over the whole run (the first step's peak comes before the optimizer's
state exists; later steps hold it) beside the plan's predicted per-GPU peak, the routed mean depth (the plan
assumes the router prior's mean), the longest shortcut pass drawn, tokens/s and MFU (median over the steps after
the first two; MFU against --gpu's datasheet peak).

    python bench/plan_check.py --data data/gpucheck --cases paper/t-loopformer,paper/loopformer --gpu h200
    python bench/plan_check.py --data data/demo --cases tiny/t-loopformer:loop --gpu cpu --steps 4   # a smoke run

A case is PRESET[:AC] (activation checkpointing none|loop|layer, default none). The global batch is set to one
micro-batch (grad-accum 1), the per-GPU shape of the preset on its full world size. Checkpoints go to a temporary
directory that is removed after each case. Writes JSON (--json) after every case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import load_config
from pipeline.hardware import GPU, gpu
from pipeline.plan.core import Planner
from pipeline.tracking import METRICS_FILE, read_metrics


def case_overrides(ac: str, mb: int, data: str, steps: int, peak_flops: float, ckpt: str, extra) -> list[str]:
    """One case's overrides of its preset: global batch = its micro-batch, every step logged, no MLflow."""
    return [
        f"data.dir={data}",
        f"schedule.max_steps={steps}",
        f"train.global_batch_size={mb}",
        f"train.activation_checkpointing={ac}",
        "train.log_interval=1",
        "logging.mlflow=false",
        f"logging.peak_flops={peak_flops}",
        f"checkpoint.dir={ckpt}",
        "checkpoint.interval=0",
        *extra,
    ]


def train_cmd(preset: str, overrides: list[str]) -> list:
    """The real `tlf train` of one case: one process."""
    return [sys.executable, "-m", "pipeline.train", preset, *overrides, "--resume", "none"]


def planned_peak_gb(preset: str, overrides: list[str], hw: GPU) -> float:
    """The plan's predicted per-GPU peak (GiB) of the case's config on one rank: what `tlf plan` says for it."""
    cfg = load_config(preset, overrides)
    t = cfg.train
    return Planner(cfg, hw).memory(t.zero_stage, t.activation_checkpointing, t.micro_batch_size, 1)["peak"] / 2**30


def run_case(case: str, data: str, steps: int, hw: GPU, extra: list[str], timeout: float) -> dict:
    preset, _, ac = case.partition(":")
    ac = ac or "none"
    mb = load_config(preset, extra).train.micro_batch_size
    with tempfile.TemporaryDirectory(prefix="plan_check_") as ckpt:
        overrides = case_overrides(ac, mb, data, steps, hw.peak_flops, ckpt, extra)
        pred = planned_peak_gb(preset, overrides, hw)
        cmd = train_cmd(preset, overrides)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e.stdout or "")[-3000:]
        wall = time.time() - t0
        rows = read_metrics(Path(ckpt) / METRICS_FILE)
    out = {"case": case, "preset": preset, "ac": ac, "micro_batch": mb, "rc": rc, "wall_s": wall}
    if not rows:
        return {**out, "error": tail}
    first, timed = rows[0], rows[2:] or rows

    def med(key):
        vals = [r[key] for r in timed if key in r]
        return statistics.median(vals) if vals else None

    def top(key):
        vals = [r[key] for r in rows if key in r]
        return max(vals) if vals else None

    peak_first, peak_max = first.get("mem/cuda_max_allocated_gb"), top("mem/cuda_max_allocated_gb")
    out.update(
        steps=len(rows),
        predicted_peak_gb=pred,
        measured_peak_gb_step1=peak_first,
        peak_ratio_step1=peak_first / pred if peak_first else None,
        measured_peak_gb_max=peak_max,
        peak_ratio_max=peak_max / pred if peak_max and pred else None,
        reserved_gb_max=top("mem/cuda_max_reserved_gb"),
        mean_depth=statistics.mean(r.get("router/full/mean_depth", float("nan")) for r in rows),
        longest_short_pass=top("router/short/loops"),
        tokens_per_s=med("tokens_per_s"),
        step_time_s=med("step_time_s"),
        mfu=med("mfu"),
        loss_first=first.get("loss"),
        loss_last=rows[-1].get("loss"),
    )
    if rc != 0:
        out["error"] = tail
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a tlf shard directory (tlf prep-data)")
    ap.add_argument("--cases", default="paper/t-loopformer,paper/loopformer")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gpu", default="h200", help="the GPU table's name (pipeline/hardware.py): MFU's peak")
    ap.add_argument("--set", action="append", default=[], help="an extra override for every case")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "plan_check.json"))
    a = ap.parse_args()
    hw = gpu(a.gpu)
    results = []
    for case in a.cases.split(","):
        r = run_case(case, a.data, a.steps, hw, a.set, a.timeout)
        results.append(r)
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"gpu": a.gpu, "steps": a.steps, "cases": results}, indent=1))
        show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "error"}
        print(json.dumps(show), flush=True)
        if "error" in r:
            print(r["error"], flush=True)


if __name__ == "__main__":
    main()
