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

Each number is the best (minimum) over --repeats on CPU, the median on CUDA (--stat), with the variants interleaved
inside every repeat so that load drift hits them alike; on CUDA the models are built on the device and each time is
the device time between two CUDA events (the timed region ends in a host read, so it is also the latency seen).
The table gives tlf's time as a ratio to each baseline and, beside it, the expected compute ratio mean depth / L
(the share of loop work the router leaves). JSON goes to --json.
Modulation is a precomputed (K, 4d) table per layer; no modulator weight is read while decoding.

TPOT against the memory-bandwidth floor (tlf, (c) and (d)): the bytes a decode step cannot avoid reading, over the
device's bandwidth (`pipeline/hardware.py`, this GPU's row; --bandwidth overrides; on CPU the table's
order-of-magnitude row). Per step: the shared block's weights once per loop that any row runs (the modulator
weights are not read: tables), the modulation rows, the router, the final norm and the LM head once, each row's
two embedding rows, and per row and loop it runs, that loop's keys and values of the row (every layer), from the
depths the run drew (prompt depths from the model's forward, step depths from the decoder). `floor_ms`,
`over_floor` (TPOT / floor) and `bytes_ratio_c` (tlf's bytes / (c)'s, the ratio tlf's TPOT / (c)'s would have at
the floor) are in the JSON and the second table.
"""

from __future__ import annotations

import argparse
import statistics
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
from pipeline.hardware import gpu, this_gpu
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
    with torch.device(dev):  # initialised where they run (on a GPU: seconds, not a minute of CPU init)
        tlf = LoopedLM(load_config("tiny/t-loopformer", over).model)
        base = LoopedLM(
            load_config("tiny/base", over[:-2] + [f"model.n_layers={o.layers * o.M}", "model.loops=1"]).model
        )
        lf = LoopedLM(load_config("tiny/loopformer", over).model)  # tlf's weights without its router: every token
    spread_router(tlf, 0, o.router_scale)  # (a CPU generator of its own) init routers are near uniform (depth ~L/2)
    lf.load_state_dict({k: v for k, v in tlf.state_dict().items() if not k.startswith("router.")})  # runs M loops
    return {k: m.to(dev, dtype).eval() for k, m in (("tlf", tlf), ("lf", lf), ("base", base))}


def flops_ratio(models, o, mean_depth, kind, P):
    """Expected tlf/(c) forward FLOPs per token at the executed mean depth, LM head included for TPOT
    (TTFT computes the head for one token only, so it is left out there)."""
    ctx, heads = (P, 0) if kind == "TTFT" else (P + o.steps, 1)
    f = lambda m, loops: m.flops_per_token(loops, ctx, lm_heads=heads, backward=False)
    return f(models["tlf"], mean_depth) / f(models["lf"], o.M)


def step_bytes(model, prompt_depth: np.ndarray, step_depth: np.ndarray, loops: int) -> np.ndarray:
    """(n,) bytes decode step s cannot avoid reading (module docstring) for prompts of depths prompt_depth (B, P)
    and fed tokens of depths step_depth (B, n) in 1..loops (a dense model: loops 1, every depth 1)."""
    cfg, el = model.cfg, model.wte.weight.element_size()
    block = sum(p.numel() for n, p in model.layers.named_parameters() if ".modulator." not in n) * el
    once = (model.lm_head.weight.numel() + model.norm_f.weight.numel()) * el
    once += sum(p.numel() for p in model.router.parameters()) * el if model.router is not None else 0
    B, n = step_depth.shape
    J, d = len(model.layers), cfg.d_model
    i = np.arange(1, loops + 1)
    entries = (prompt_depth[:, :, None] >= i).sum(1)[:, None, :] + np.cumsum(
        step_depth[:, :, None] >= i, 1
    )  # (B, n, M)
    kv = ((step_depth[:, :, None] >= i) * entries).sum((0, 2)) * 2 * J * d * el  # keys and values, every layer
    mods = step_depth.sum(0) * J * 4 * d * el if cfg.conditioning != "none" else 0  # the rows' table entries
    return block * step_depth.max(0) + once + B * 2 * d * el + mods + kv


class _CudaClock:
    """`clock` for pipeline.inference.timing on CUDA: a reading records an event on the current stream; the
    difference of two readings waits for the later one and is the device time between them (seconds)."""

    def __call__(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return _Stamp(ev)


class _Stamp:
    def __init__(self, ev):
        self.ev = ev

    def __sub__(self, earlier: "_Stamp") -> float:
        self.ev.synchronize()
        return earlier.ev.elapsed_time(self.ev) / 1e3


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
    p.add_argument("--ttft-batches", default="1", help="TTFT batch sizes (prompts of one length prefilled together)")
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
    p.add_argument("--stat", choices=["min", "median"], help="over the repeats (default: min on CPU, median on CUDA)")
    p.add_argument("--bandwidth", type=float, help="bytes/s for the TPOT floor (default: the hardware table's row)")
    p.add_argument("--json", default="bench/results/decode.json")
    o = p.parse_args(argv)
    cuda = o.device.startswith("cuda")
    o.stat = o.stat or ("median" if cuda else "min")
    o.bandwidth = o.bandwidth or ((cuda and this_gpu()) or gpu("cpu")).bandwidth
    o.prompt_lens = [int(x) for x in o.prompt_lens.split(",") if x]
    o.batches = [int(x) for x in o.batches.split(",") if x]
    o.ttft_batches = [int(x) for x in o.ttft_batches.split(",") if x]
    o.M = o.M or o.loops
    torch.set_num_threads(o.threads)
    global CLOCK
    if o.clock == "cpu":
        assert o.device == "cpu" and o.threads == 1, "--clock cpu measures one CPU thread: --device cpu --threads 1"
        CLOCK = time.process_time
    elif cuda:
        CLOCK = _CudaClock()
    dev = torch.device(o.device)
    models = build(o)
    g = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randint(0, min(o.vocab, 50257), s, generator=g).to(dev)
    cases = [("TTFT", P, B) for B in o.ttft_batches for P in o.prompt_lens]
    cases += [("TPOT", o.tpot_prompt, B) for B in o.batches]
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
                if kind == "TPOT" and v in FLOOR:
                    info[c].setdefault("step_depth", {})[v] = depth.cpu().numpy()
        print(f"repeat {r} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    rows = []
    stat = min if o.stat == "min" else statistics.median  # min: the repeat least disturbed by other load
    for c in cases:
        kind, P, B = c
        med = {v: stat(times[c][v]) for v in VARIANTS}
        ratio = {v: med["tlf"] / med[v] for v in VARIANTS if v != "tlf"}
        if kind == "TPOT":
            info[c].update(tpot_floor(models, o, inputs[c][0], info[c].pop("step_depth"), med))
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
        f"{o.device} {o.dtype} threads={o.threads}; {'CUDA event' if cuda else o.clock} clock, ms, {o.stat} of "
        f"{o.repeats}"
    )
    print(head)
    for row in rows:
        name = f"{row['metric']} " + (f"P={row['prompt_len']}" if row["metric"] == "TTFT" else f"B={row['batch']}")
        name += f" B={row['batch']}" if row["metric"] == "TTFT" and len(o.ttft_batches) > 1 else ""
        print(
            f"{name:<16}"
            + "".join(f"{row['ms'][v]:>11.2f}" for v in VARIANTS)
            + "      "
            + " ".join(f"{row['tlf_over'][v]:>6.2f}" for v in VARIANTS[1:])
            + f"   {row['mean_depth']:.2f}/{o.loops} = {row['expected_compute_ratio']:.2f}"
            + f"   {row['expected_flops_ratio_c']:>9.2f}"
        )
    print(f"\nTPOT against the bandwidth floor ({o.bandwidth / 1e12:.2f} TB/s; bytes a step must read)")
    print(f"{'case':<16}" + "".join(f"{v + ' ms/floor':>22}" for v in FLOOR) + "   bytes tlf/(c)   TPOT tlf/(c)")
    for row in rows:
        if row["metric"] == "TPOT":
            fl = row["floor_ms"]
            print(
                f"{'TPOT B=' + str(row['batch']):<16}"
                + "".join(f"{row['ms'][v]:>9.2f}/{fl[v]:<6.3f}={row['over_floor'][v]:<5.1f}" for v in FLOOR)
                + f"   {row['bytes_ratio_c']:>13.3f}   {row['tlf_over']['loopformer']:>12.3f}"
            )
    write_json(o.json, {"config": vars(o), "rows": rows})
    return rows


FLOOR = {"tlf": "tlf", "loopformer": "lf", "base": "base"}  # variant -> its model in `build`'s dict


def tpot_floor(models, o, prompt: torch.Tensor, step_depth: dict, ms: dict) -> dict:
    """A TPOT case's bytes per step, floor (ms at o.bandwidth) and TPOT / floor for the FLOOR variants; the
    prompt's depths come from the model's own forward (the decoder's prefill draws the same)."""
    with torch.no_grad():
        pd = models["tlf"].hidden_states(prompt, o.M)[1].cpu().numpy()  # (B, P) tlf's prompt depths
    prompt_depth = {"tlf": pd, "loopformer": np.full_like(pd, o.M), "base": np.ones_like(pd)}
    loops = {"tlf": o.M, "loopformer": o.M, "base": 1}
    by = {v: float(step_bytes(models[m], prompt_depth[v], step_depth[v], loops[v]).mean()) for v, m in FLOOR.items()}
    floor = {v: 1e3 * b / o.bandwidth for v, b in by.items()}
    return {
        "bytes_per_step": by,
        "floor_ms": floor,
        "over_floor": {v: ms[v] * 1e3 / floor[v] for v in FLOOR},
        "bytes_ratio_c": by["tlf"] / by["loopformer"],
    }


if __name__ == "__main__":
    main()
