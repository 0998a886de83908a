"""Forward+backward time and peak memory of every variant at one size, and t-loopformer's gather-scatter
against the dense masked path, side by side in one run.

    python bench/model_step.py                       # defaults below, CPU
    python bench/model_step.py --device cuda --d-model 1024 --seq 2048 --batch 8

Each case runs in a process of its own (so peak memory is its own: `pipeline.memory`, CUDA max allocated, or
the growth of the process's peak RSS over the steps on CPU), and the timed steps of all cases are interleaved round-robin so that
machine load hits every case alike; the median step time is reported. The training objective is the real one (full pass + shortcut pass with
a fixed schedule + alignment). The table gives times as ratios to t-loopformer with gather-scatter,
and for the gather-scatter/dense pair the measured time ratio beside the expected compute ratio
sum_i |A_i| / (M * T) over both passes. Writes JSON (default bench/results/model_step.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from interleave import run_cases, write_json  # bench/ is the script's own directory


def _worker(args: dict, conn) -> None:
    """Builds one case's model, then answers 'step' (one timed fwd+bwd) and 'stats' until 'stop'."""
    import torch

    from pipeline.config import load_config
    from pipeline.memory import region_peak_mib, region_start
    from pipeline.model import LoopedLM
    from pipeline.train.objective import Objective
    from testkit import spread_router

    torch.manual_seed(0)
    torch.set_num_threads(args["threads"])
    dev = torch.device(args["device"])
    o = args
    scale_overrides = [
        f"model.d_model={o['d_model']}",
        f"model.n_heads={o['n_heads']}",
        f"model.d_ff={o['d_ff']}",
        f"model.block_size={o['seq']}",
        f"model.vocab_size={o['vocab']}",
    ]
    run_cfg = load_config(f"tiny/{o['variant']}", scale_overrides + o["extra"])
    cfg = run_cfg.model
    if o["variant"] == "base":  # the dense baseline has the looped models' effective depth
        cfg.n_layers, cfg.loops = o["layers"] * o["loops"], 1
    else:
        cfg.n_layers, cfg.loops = o["layers"], o["loops"]
    model = spread_router(LoopedLM(cfg)).to(dev).train()  # depths over 1..L (a trained router's; init is near uniform)
    objective = Objective(
        model, run_cfg.objective
    )  # the training objective around the network, as `tlf train` builds it
    L = cfg.loops
    k = torch.tensor([L // 2, L - L // 2]) if L >= 2 else None  # fixed shortcut schedule: same work each step
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (o["batch"], o["seq"]), generator=g).to(dev)
    tgt = torch.randint(0, cfg.vocab_size, (o["batch"], o["seq"]), generator=g).to(dev)
    dtype = torch.bfloat16 if o["bf16"] else None
    base = region_start(dev)  # peak memory of the steps only (not of imports and model building)
    out = None

    def step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            res = objective(idx, tgt, k if run_cfg.objective.shortcut else None)
        res.loss.backward()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return res

    for _ in range(o["warmup"]):
        out = step()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "step":
            t0 = time.perf_counter()
            out = step()
            conn.send(time.perf_counter() - t0)
        elif cmd == "stats":
            T = o["seq"] * o["batch"]
            active = float(out.stats["full/active_tokens"]) + float(out.stats.get("short/active_tokens", 0.0))
            dense = T * L + (T * len(k) if run_cfg.objective.shortcut else 0)
            peak = region_peak_mib(dev, base)
            conn.send(
                {
                    "peak_mem_mb": peak,
                    "mean_depth": float(out.stats["full/mean_depth"]),
                    "compute_ratio": active / dense,
                    "params": model.num_params(),
                }
            )
        else:
            return


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=640)
    ap.add_argument("--layers", type=int, default=2, help="J of the looped variants (base gets J*L layers)")
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192, help="small vocab so the loops, not the LM head, dominate")
    ap.add_argument("--steps", type=int, default=7, help="timed rounds (each case one step per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "model_step.json"))
    a = ap.parse_args(argv)
    from pipeline.config import VARIANTS

    variants = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    common = {
        k: getattr(a, k)
        for k in (
            "device",
            "d_model",
            "n_heads",
            "d_ff",
            "layers",
            "loops",
            "seq",
            "batch",
            "vocab",
            "steps",
            "warmup",
            "threads",
            "bf16",
        )
    }
    specs = {v: {**common, "variant": v, "extra": []} for v in variants}
    specs["t-loopformer (dense)"] = {**common, "variant": "t-loopformer", "extra": ["model.execution=dense"]}
    results = run_cases(_worker, specs, a.steps)
    for r in results.values():
        r["tokens_per_s"] = a.batch * a.seq / r["time_s"]

    ref = results.get("t-loopformer", next(iter(results.values())))
    print(
        f"\nmodel_step: fwd+bwd of the training objective, B={a.batch} T={a.seq} d={a.d_model} "
        f"J={a.layers} L={a.loops} vocab={a.vocab} on {a.device}{' bf16' if a.bf16 else ''}"
    )
    print(
        f"{'case':<22} {'ms/step':>9} {'x t-loopformer':>15} {'tok/s':>9} {'peak MB':>8} {'mean depth':>10} {'compute':>8}"
    )
    for label, r in results.items():
        print(
            f"{label:<22} {r['time_s'] * 1e3:9.1f} {r['time_s'] / ref['time_s']:15.2f} {r['tokens_per_s']:9.0f} "
            f"{r['peak_mem_mb']:8.0f} {r['mean_depth']:10.2f} {r['compute_ratio']:8.2f}"
        )
    summary = {}
    if "t-loopformer" in results and "t-loopformer (dense)" in results:
        gs, dn = results["t-loopformer"], results["t-loopformer (dense)"]
        summary = {
            "gather_scatter_time_ratio": gs["time_s"] / dn["time_s"],
            "expected_compute_ratio": gs["compute_ratio"],
            "gather_scatter_memory_ratio": gs["peak_mem_mb"] / max(dn["peak_mem_mb"], 1e-9),
        }
        print(
            f"\ngather-scatter / dense: time {summary['gather_scatter_time_ratio']:.2f} "
            f"(expected compute ratio sum|A_i|/(M*T) = {summary['expected_compute_ratio']:.2f}), "
            f"peak memory {summary['gather_scatter_memory_ratio']:.2f}"
        )
    out = {"settings": common, "results": results, "summary": summary}
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
