"""Where one training step's time goes: torch.profiler over a few optimizer steps of `tlf train`'s step
(`Trainer.build` set up as bench/train_step.py does: a fixed batch, ZeRO-0, AdamW, no callbacks or checkpoints;
router weights spread so depths cover 1..L) for one variant per process. Prints the wall time per step, the
device's busy time per step (the sum of its kernels' time: far below the wall time means the step waits on the
host, launches and syncs) and the top operators by self device time (self CPU time on CPU), and writes them as
JSON.

    python bench/step_profile.py --scale paper --device cuda --micro-batch 6 --variant t-loopformer \\
        --set model.vocab_size=50304
    python bench/step_profile.py --scale tiny --variant t-loopformer        # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit import spread_router
from train_step import _FixedBatch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="tiny")
    ap.add_argument("--variant", default="t-loopformer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", dest="batch", type=int, default=4)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "step_profile.json"))
    a = ap.parse_args(argv)

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pipeline.config import load_config
    from pipeline.model import LoopedLM
    from pipeline.train.trainer import Trainer

    cuda = a.device.startswith("cuda")
    cfg = load_config(
        f"{a.scale}/{a.variant}",
        [
            *a.overrides,
            f"train.micro_batch_size={a.batch}",
            "train.grad_accum_steps=1",
            f"train.global_batch_size={a.batch}",
            "train.zero_stage=0",
            f"train.device={a.device}",
            "checkpoint.resume=none",
            "train.eval_interval=0",
            "logging.mlflow=false",
        ],
    )
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    if model.router is not None:
        spread_router(model)
    B, T = a.batch, cfg.model.block_size
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.model.vocab_size, (B, T), generator=g) for _ in range(2))
    trainer = Trainer.build(cfg, callbacks=[], loader=_FixedBatch(x, y), model=model)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for i in range(a.warmup):
        torch.manual_seed(i)
        trainer.train_step()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for i in range(a.steps):
            torch.manual_seed(10**6 + i)  # the same shortcut schedules as bench/train_step.py's timed rounds
            trainer.train_step()
        sync()
        wall = (time.perf_counter() - t0) / a.steps
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # the device's own events (kernels, copies) sum to its busy time; the operators' self device time is the time
    # of the kernels each launched itself, so the top list is of operators, not kernels (no double count)
    dev_events = [e for e in events if e.device_type != DeviceType.CPU]
    busy = sum(getattr(e, key) for e in (dev_events if cuda else events)) / 1e6 / a.steps  # us -> s per step
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    top = sorted(ops, key=lambda e: getattr(e, key), reverse=True)[: a.top]
    rows = [
        {"op": e.key, "self_s_per_step": getattr(e, key) / 1e6 / a.steps, "calls_per_step": e.count / a.steps}
        for e in top
    ]
    out = {
        "variant": f"{a.scale}/{a.variant}",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "micro_batch": B,
        "seq_len": T,
        "wall_s_per_step": wall,
        "busy_s_per_step": busy,
        "top": rows,
    }
    print(f"{out['variant']} on {out['device']}: {wall * 1e3:.1f} ms per step, {busy * 1e3:.1f} ms of it busy")
    for r in rows:
        print(f"  {r['self_s_per_step'] * 1e3:9.2f} ms  {r['calls_per_step']:8.0f} calls  {r['op'][:90]}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
