"""Decode latency, side by side in one run: TTFT (prefill of one prompt to its first logits) at several
prompt lengths and TPOT (time per output token) at batch 1 and 32, for

    tlf        t-loopformer, recursion-wise KV cache (compact layout), gather-scatter prefill, early exit
    nocache    (a) the same model without a cache: every new token re-runs the whole sequence
    fulldepth  (b) the same model with a full-depth cache: every token writes every loop (exited tokens
               project k/v from their frozen state; prefill runs every token through every loop)
    loopformer (c) LoopFormer at the same M: the same weights with the router off (every token depth M,
               which docs/design.md §1 makes identical to loopformer), recursion-wise cache (all loops full)
    base       (d) the dense J*M x 1 model (same FLOPs per token as a full-depth looped pass), plain cache

    python bench/decode.py                                  # defaults below (a few minutes on 2 CPU cores)
    python bench/decode.py --prompt-lens 128,512 --d-model 256 --repeats 1     # quicker
    python bench/decode.py --device cuda --dtype bf16 --d-model 2048 --n-heads 32 --d-ff 5120

Each number is the best (minimum) over --repeats, with the variants interleaved inside every repeat so that load
drift hits them alike. The table gives tlf's time as a ratio to each baseline and, beside it, the
expected compute ratio mean depth / L (the share of loop work the router leaves). JSON goes to --json.
Modulation is a precomputed (K, 4d) table per layer; no modulator weight is read while decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.interleave import write_json
from pipeline.config import load_config
from pipeline.inference import timing
from pipeline.model import LoopedLM
from testkit import spread_router  # bench/ is the script's own directory

VARIANTS = ("tlf", "nocache", "fulldepth", "loopformer", "base")
CLOCK = time.perf_counter  # --clock cpu: time.process_time (one thread: the compute, not the waiting)


def build(o):
    """t-loopformer (router spread like a trained one) and the dense base with J*M layers, same width."""
    dev, dtype = torch.device(o.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[o.dtype]
    over = [
        f"model.d_model={o.d_model}",
        f"model.n_heads={o.n_heads}",
        f"model.d_ff={o.d_ff}",
        f"model.vocab_size={o.vocab}",
        f"model.block_size={max(o.prompt_lens + [o.tpot_prompt]) + o.steps + 1}",
        f"model.n_layers={o.layers}",
        f"model.loops={o.loops}",
    ]
    torch.manual_seed(0)
    tlf = LoopedLM(load_config("tiny/t-loopformer", over).model)
    spread_router(tlf, 0, o.router_scale)  # init routers are near uniform (depth ~L/2); a trained one spreads
    base = LoopedLM(load_config("tiny/base", over[:-2] + [f"model.n_layers={o.layers * o.M}", "model.loops=1"]).model)
    lf = LoopedLM(load_config("tiny/loopformer", over).model)  # tlf's weights without its router: every token
    lf.load_state_dict({k: v for k, v in tlf.state_dict().items() if not k.startswith("router.")})  # runs M loops
    return {k: m.to(dev, dtype).eval() for k, m in (("tlf", tlf), ("lf", lf), ("base", base))}


def flops_ratio(models, o, mean_depth, kind, P):
    """Expected tlf/(c) forward FLOPs per token at the executed mean depth, LM head included for TPOT
    (TTFT computes the head for one token only, so it is left out there)."""
    ctx, heads = (P, 0) if kind == "TTFT" else (P + o.steps, 1)
    f = lambda m, loops: m.flops_per_token(loops, ctx, lm_heads=heads, backward=False)
    return f(models["tlf"], mean_depth) / f(models["lf"], o.M)


def _target(models, variant, M):
    """(model, budget, flags) of a benchmark variant."""
    if variant == "loopformer":
        return models["lf"], M, {}
    if variant == "base":
        return models["base"], 1, {}
    return models["tlf"], M, {"cache": variant != "nocache", "full_depth": variant == "fulldepth"}


def ttft(models, variant, M, prompt, dev):
    """Seconds from prompt to first-token logits; and the prompt's router depths."""
    model, m, kw = _target(models, variant, M)
    return timing.ttft(model, m, prompt, clock=CLOCK, **kw)


def tpot(models, variant, M, prompts, feed, dev):
    """Seconds per decode step (mean over the fed tokens) after an untimed prefill; depths and cache memory."""
    model, m, kw = _target(models, variant, M)
    return timing.tpot(model, m, prompts, feed, clock=CLOCK, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=640)
    p.add_argument("--layers", type=int, default=3, help="J, shared layers")
    p.add_argument("--loops", type=int, default=8, help="L")
    p.add_argument("--M", type=int, default=0, help="loop budget (0: L)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--prompt-lens", default="128,512,1024,2048")
    p.add_argument("--tpot-prompt", type=int, default=128, help="prompt length before TPOT decoding")
    p.add_argument("--batches", default="1,32", help="TPOT batch sizes")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per TPOT measurement")
    p.add_argument("--nocache-steps", type=int, default=4, help="steps timed for (a), which re-runs everything")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--router-scale", type=float, default=1.0, help="router weight spread (depth diversity)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: latency as seen; cpu: process CPU time (with --threads 1 on a CPU shared with other "
        "jobs, the time the work itself took)",
    )
    p.add_argument("--json", default="bench/results/decode.json")
    o = p.parse_args(argv)
    o.prompt_lens = [int(x) for x in o.prompt_lens.split(",") if x]
    o.batches = [int(x) for x in o.batches.split(",") if x]
    o.M = o.M or o.loops
    torch.set_num_threads(o.threads)
    global CLOCK
    if o.clock == "cpu":
        assert o.device == "cpu" and o.threads == 1, "--clock cpu measures one CPU thread: --device cpu --threads 1"
        CLOCK = time.process_time
    dev = torch.device(o.device)
    models = build(o)
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randint(0, min(o.vocab, 50257), s, generator=g).to(dev)
    cases = [("TTFT", P, 1) for P in o.prompt_lens] + [("TPOT", o.tpot_prompt, B) for B in o.batches]
    inputs = {c: (rand(c[2], c[1]), rand(c[2], o.steps)) for c in cases}
    times = {c: {v: [] for v in VARIANTS} for c in cases}
    info = {c: {} for c in cases}
    t0 = time.perf_counter()
    for v in VARIANTS:  # warm-up: first calls allocate and pick kernels
        ttft(models, v, o.M, inputs[cases[0]][0], dev)
        tpot(models, v, o.M, inputs[cases[-1]][0][:1], inputs[cases[-1]][1][:1, :2], dev)
    for r in range(1, o.repeats + 1):
        for c in cases:
            kind, P, B = c
            prompt, feed = inputs[c]
            for v in VARIANTS:
                if kind == "TTFT":
                    sec, depth = ttft(models, v, o.M, prompt, dev)
                    mem = None
                else:
                    f = feed[:, : o.nocache_steps] if v == "nocache" else feed
                    sec, depth, mem = tpot(models, v, o.M, prompt, f, dev)
                times[c][v].append(sec)
                if v == "tlf":
                    info[c]["mean_depth"] = float(depth.float().mean())
                    info[c]["depth_hist"] = np.bincount(depth.flatten().cpu().numpy(), minlength=o.M + 1)[1:].tolist()
                if mem is not None:
                    info[c].setdefault("cache", {})[v] = {k: mem[k] for k in ("entries", "dense_entries", "bytes_used")}
        print(f"repeat {r} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    rows = []
    for c in cases:
        kind, P, B = c
        med = {v: min(times[c][v]) for v in VARIANTS}  # best of the repeats: least disturbed by other load
        ratio = {v: med["tlf"] / med[v] for v in VARIANTS if v != "tlf"}
        rows.append(
            {
                "metric": kind,
                "prompt_len": P,
                "batch": B,
                "ms": {v: 1e3 * med[v] for v in VARIANTS},
                "ms_all": {v: [1e3 * x for x in times[c][v]] for v in VARIANTS},
                "tlf_over": ratio,
                "expected_compute_ratio": info[c]["mean_depth"] / o.loops,
                "expected_flops_ratio_c": flops_ratio(models, o, info[c]["mean_depth"], kind, P),
                **info[c],
            }
        )
    head = (
        f"{'case':<16}"
        + "".join(f"{v:>11}" for v in VARIANTS)
        + "   tlf/ (a)    (b)    (c)    (d)"
        + "   mean depth/L   FLOPs/(c)"
    )
    print(
        f"d={o.d_model} H={o.n_heads} d_ff={o.d_ff} J={o.layers} L={o.loops} M={o.M} vocab={o.vocab} "
        f"{o.device} {o.dtype} threads={o.threads}; {o.clock} clock, ms, best of {o.repeats}"
    )
    print(head)
    for row in rows:
        name = f"{row['metric']} " + (f"P={row['prompt_len']}" if row["metric"] == "TTFT" else f"B={row['batch']}")
        print(
            f"{name:<16}"
            + "".join(f"{row['ms'][v]:>11.2f}" for v in VARIANTS)
            + "      "
            + " ".join(f"{row['tlf_over'][v]:>6.2f}" for v in VARIANTS[1:])
            + f"   {row['mean_depth']:.2f}/{o.loops} = {row['expected_compute_ratio']:.2f}"
            + f"   {row['expected_flops_ratio_c']:>9.2f}"
        )
    write_json(o.json, {"config": vars(o), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
