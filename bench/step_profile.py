"""Where one training step's time goes, loop by loop: torch.profiler over `tlf train`'s step (`Trainer.build` set up
as bench/train_step.py does: a fixed batch, ZeRO-0, AdamW, no callbacks or checkpoints; router weights spread so
depths cover 1..L) for each variant, one after the other in this process.

    python bench/step_profile.py --scale paper --device cuda --micro-batch 6 --variants loopformer,t-loopformer \\
        --set model.vocab_size=50304 --json bench/results/step_profile_paper.json
    python bench/step_profile.py                       # CPU: op counts per step of the fixed small config
    python bench/step_profile.py --baseline tests/fixtures/op_counts.json   # rewrite the test's baseline

Each loop application of each pass runs inside a `record_function` range `tlf/full/i` or `tlf/short/i`,
applied from outside (`loop_ranges`: the network's `loop` and `_compacted_loop` wrapped on the instance for the
profiled steps only, as activation checkpointing and compilation are applied; nothing in the model knows). A
forward op belongs to the loop whose range holds it; a backward op to the loop whose forward op made its autograd
node (the profiler's sequence numbers link the two); the rest (embedding, router, heads and losses, optimizer) is
`rest`. Per loop and pass direction: active tokens and padded slots, ops (aten calls the code or autograd made:
host dispatch work), kernel ops (aten ops that launch work: views and allocations left out; the CPU stand-in for
GPU kernels), and on CUDA the kernels, the small ones (< 10 us: launch-bound) and their device time by kind
(matmul, attention, gather/sort/scatter, other); on CPU the ops' self CPU time by kind. Host syncs: on CUDA the
synchronising runtime calls the profiler saw, and everywhere the host reads of tlf's own code in one step
(`bench/testkit.py` count_host_reads: the model's one read of |A_i| per forward and the trainer's one per step).

Bounded by construction: `--warmup` plain steps, then the profiler's schedule (wait 0, warmup 1, active --steps)
with no shapes, stacks or memory recorded; each phase's seconds (build, warm-up, profile, analysis) are printed as
it ends and kept in the JSON, so a run cut short by a time limit says where it was.

CPU, default arguments: the op counts of one step of `tiny` loopformer and t-loopformer (micro-batch 4, router
spread), machine-independent; tests/test_op_counts.py holds them to the committed baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import fixed_batch_trainer, keyed_step  # bench/ is the script's own directory

# the fixed config whose op counts tests/test_op_counts.py guards (CPU, fp32)
BASELINE = {"scale": "tiny", "variants": ["loopformer", "t-loopformer"], "batch": 4, "overrides": []}
RANGE = "tlf/"  # profiler ranges tlf/full/i, tlf/short/i, tlf/optimizer
SMALL_US = 10.0  # a kernel shorter than this is launch-bound on a GPU
KINDS = {  # the innermost aten op that launched the work -> kind (first match)
    "matmul": re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|_scaled_mm|mv|addmv)$"),
    "attention": re.compile(r"attention"),
    "gather_sort_scatter": re.compile(r"sort|gather|scatter|index|embedding|where|masked|nonzero|take"),
}
NO_KERNEL = {  # aten ops that launch nothing: views, metadata, allocation
    f"aten::{n}"
    for n in (
        "view alias _unsafe_view _reshape_alias reshape view_as t transpose permute expand expand_as as_strided "
        "slice select unsqueeze squeeze narrow split split_with_sizes chunk unbind unflatten flatten detach detach_ "
        "empty empty_like empty_strided resolve_conj resolve_neg lift_fresh set_ contiguous result_type to type_as"
    ).split()
}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")  # CUDA runtime calls that wait


def kind(op: str) -> str:
    return next((k for k, rx in KINDS.items() if rx.search(op)), "other")


@contextlib.contextmanager
def loop_ranges(net, tokens: dict | None = None):
    """Every loop application of `net` (a LoopedLM) inside a profiler range `tlf/PASS/i` (PASS full, then
    short, counted from each forward), applied from outside on the instance and removed on exit. tokens, if
    given, gets per label [active tokens, padded slots] of the last application."""
    from torch.autograd.profiler import record_function

    state = {"pass": -1, "inside": False}
    orig = {name: getattr(net, name) for name in ("loop", "_compacted_loop")}
    sig = {name: inspect.signature(f) for name, f in orig.items()}

    def reset(_mod, _args):
        state["pass"] = -1

    def wrap(name):
        def ranged(h, i, *args, **kw):
            if state["inside"]:  # _compacted_loop calls loop: one range
                return orig[name](h, i, *args, **kw)
            state["pass"] += i == 1
            label = f"{('full', 'short')[min(state['pass'], 1)]}/{i}"
            if tokens is not None:
                n = sig[name].bind(h, i, *args, **kw).arguments.get("n")  # (B,) |A_i| on the host, or None
                slots = h.shape[0] * h.shape[1]
                tokens[label] = [int(n.sum()) if n is not None else slots, slots if n is None else h.shape[0] * max(n)]
            state["inside"] = True
            try:
                with record_function(RANGE + label):
                    return orig[name](h, i, *args, **kw)
            finally:
                state["inside"] = False

        return ranged

    handle = net.register_forward_pre_hook(reset)
    for name in orig:
        setattr(net, name, wrap(name))
    try:
        yield
    finally:
        handle.remove()
        for name in orig:
            delattr(net, name)  # the class's methods again


@contextlib.contextmanager
def step_ranges(trainer, tokens: dict | None = None):
    """`loop_ranges` on the trainer's network, and the optimizer step (`engine.step`) in a range
    `tlf/optimizer`, both applied on the instances and removed on exit."""
    from torch.autograd.profiler import record_function

    engine = trainer.engine
    step = engine.step

    def ranged_step(*a, **kw):
        with record_function(RANGE + "optimizer"):
            return step(*a, **kw)

    engine.step = ranged_step
    try:
        with loop_ranges(trainer.model, tokens):
            yield
    finally:
        del engine.step


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _new_bucket() -> dict:
    return {
        "ops": 0,
        "kernel_ops": 0,
        "kernels": 0,
        "small_kernels": 0,
        "syncs": 0,
        "ms": defaultdict(float),
        "by_op": defaultdict(lambda: [0, 0.0]),  # kernel op -> [calls, ms of its own work]
    }


def attribute(events, cuda: bool, steps: int) -> dict:
    """Per loop label and direction (fwd, bwd; `rest` for what no loop range covers) the per-step counts and
    times of the profiled `events` (a torch.profiler EventList of `steps` steps run under `loop_ranges`)."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    seq_label: dict[int, str] = {}
    where: dict[int, tuple] = {}  # id(event) -> (label, direction, sequence number of its backward node)
    for e in sorted(cpu, key=lambda e: e.time_range.start):  # forward ops in time order: the last op of a
        anc = list(_ancestors(e))  # sequence number is the one that made its autograd node
        bwd = next((a for a in anc if a.name.startswith("autograd::engine::evaluate_function")), None)
        rng = next((a.name[len(RANGE) :] for a in [e, *anc] if a.name.startswith(RANGE)), None)
        if bwd is not None:
            where[id(e)] = (None, "bwd", bwd.sequence_nr)
        else:
            where[id(e)] = (rng or "rest", "fwd", None)
            if rng is not None and e.sequence_nr >= 0:
                seq_label[e.sequence_nr] = rng
    buckets: dict[str, dict[str, dict]] = defaultdict(lambda: {"fwd": _new_bucket(), "bwd": _new_bucket()})
    for e in cpu:
        label, direction, seq = where[id(e)]
        if direction == "bwd":
            label = seq_label.get(seq, "rest")
        b = buckets[label][direction]
        parent_aten = any(a.name.startswith("aten::") for a in _ancestors(e))
        work_below = any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children)
        own_ms = sum(k.duration for k in e.kernels) / 1e3 if cuda else e.self_cpu_time_total / 1e3
        if e.name.startswith("aten::"):
            b["ops"] += not parent_aten
            if e.name not in NO_KERNEL and not work_below:
                b["kernel_ops"] += 1
                b["by_op"][e.name][0] += 1
                b["by_op"][e.name][1] += own_ms
            if not cuda:
                b["ms"][kind(e.name)] += own_ms
        b["syncs"] += e.name in SYNCS
        for k in e.kernels:  # CUDA: the kernels this op launched itself
            b["kernels"] += 1
            b["small_kernels"] += k.duration < SMALL_US
            b["ms"][kind(e.name)] += k.duration / 1e3

    def per_step(k, v):
        if k == "ms":
            return {kk: vv / steps for kk, vv in v.items()}
        if k == "by_op":
            return {kk: [n / steps, ms / steps] for kk, (n, ms) in sorted(v.items(), key=lambda kv: -kv[1][1])}
        return v / steps

    return {
        label: {d: {k: per_step(k, v) for k, v in b.items()} for d, b in dirs.items()}
        for label, dirs in buckets.items()
    }


def _totals(per_label: dict) -> dict:
    keys = ("ops", "kernel_ops", "kernels", "small_kernels", "syncs")
    tot = {k: sum(d[k] for dirs in per_label.values() for d in dirs.values()) for k in keys}
    ms = defaultdict(float)
    for dirs in per_label.values():
        for d in dirs.values():
            for k, v in d["ms"].items():
                ms[k] += v
    return {**tot, "ms": dict(ms)}


def profile_variant(
    scale: str, variant: str, device: str, batch: int, overrides: list, warmup: int, steps: int, timed: int
) -> dict:
    """Builds the variant's trainer, runs warm-up, timed and profiled steps; returns its figures."""
    import torch
    from testkit import count_host_reads
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.startswith("cuda")
    phases, t = {}, time.perf_counter()

    def phase(name):
        nonlocal t
        phases[name] = time.perf_counter() - t
        print(f"  {variant}: {name} {phases[name]:.1f} s", file=sys.stderr, flush=True)
        t = time.perf_counter()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    _cfg, model, trainer, _x, _y = fixed_batch_trainer(scale, variant, device, batch, overrides)
    phase("build")

    def step(i):
        trainer.read(keyed_step(trainer, 10**6 + i))  # the steps of bench/train_step.py's timed rounds

    for i in range(warmup):
        step(i)
    sync()
    phase("warmup")
    t0 = time.perf_counter()
    for i in range(timed):
        step(i)
    sync()
    wall_plain = (time.perf_counter() - t0) / max(timed, 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tokens: dict = {}
    with (
        step_ranges(trainer, tokens),
        profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof,
    ):
        with count_host_reads() as reads:  # tlf's own host reads in one step as `tlf train` makes it
            step(-1)  # the profiler's warm-up step (discarded)
        prof.step()
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
            prof.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    phase("profile")
    per = attribute(prof.events(), cuda, steps)
    phase("analysis")
    loops = {k: v for k, v in per.items() if k not in ("rest", "optimizer")}
    tot = _totals(per)
    return {
        "variant": f"{scale}/{variant}",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "clock": "device kernel time" if cuda else "self CPU time",
        "micro_batch": batch,
        "wall_ms_per_step": 1e3 * wall_plain,
        "wall_ms_per_step_profiled": 1e3 * wall,
        "busy_ms_per_step": sum(tot["ms"].values()) if cuda else None,
        **{f"{k}_per_step": v for k, v in tot.items() if k != "ms"},
        "ms_per_step": tot["ms"],
        "loops_per_step": _totals(loops),
        "host_reads_per_step": len(reads),
        "tokens": tokens,
        "loops": loops,
        "optimizer": per.get("optimizer"),
        "rest": per.get("rest"),
        "phases_s": phases,
    }


def show(r: dict) -> None:
    tm = r["ms_per_step"]
    print(
        f"{r['variant']} on {r['device']}: {r['wall_ms_per_step']:.1f} ms per step ({r['wall_ms_per_step_profiled']:.1f}"
        f" profiled), {r['ops_per_step']:.0f} ops, {r['kernel_ops_per_step']:.0f} kernel ops, {r['kernels_per_step']:.0f}"
        f" kernels ({r['small_kernels_per_step']:.0f} < {SMALL_US:.0f} us), {r['syncs_per_step']:.0f} sync calls,"
        f" {r['host_reads_per_step']} host reads; {r['clock']} ms: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(tm.items()))
    )
    print(
        f"  {'loop':<10} {'tokens':>7} {'slots':>7} {'dir':>4} {'ops':>6} {'k.ops':>6} {'kern':>6} {'small':>6} {'syncs':>5} ms by kind"
    )
    for label, dirs in [*r["loops"].items(), ("optimizer", r["optimizer"] or {}), ("rest", r["rest"] or {})]:
        tok, slots = r["tokens"].get(label, ["", ""])
        for d, b in dirs.items():
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(b["ms"].items()))
            print(
                f"  {label:<10} {tok!s:>7} {slots!s:>7} {d:>4} {b['ops']:6.0f} {b['kernel_ops']:6.0f} "
                f"{b['kernels']:6.0f} {b['small_kernels']:6.0f} {b['syncs']:5.0f} {kinds}"
            )


def op_counts(r: dict) -> dict:
    """The machine-independent figures of a CPU profile that the op-count test guards."""
    return {
        "ops_per_step": r["ops_per_step"],
        "kernel_ops_per_step": r["kernel_ops_per_step"],
        "loop_kernel_ops_per_step": r["loops_per_step"]["kernel_ops"],
        "host_reads_per_step": r["host_reads_per_step"],
    }


def baseline_counts() -> dict:
    """Op counts of one step of each BASELINE variant on CPU (one thread, fp32)."""
    import torch

    torch.set_num_threads(1)
    b = BASELINE
    return {
        v: op_counts(profile_variant(b["scale"], v, "cpu", b["batch"], b["overrides"], 1, 1, 0)) for v in b["variants"]
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default=BASELINE["scale"])
    ap.add_argument("--variants", default=",".join(BASELINE["variants"]))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", dest="batch", type=int, default=BASELINE["batch"])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=1, help="plain steps before anything is measured")
    ap.add_argument("--timed", type=int, default=1, help="plain steps timed without the profiler")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps (after one discarded profiler warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "step_profile.json"))
    ap.add_argument("--baseline", help="write the op counts of the fixed CPU config to this file (the test's)")
    a = ap.parse_args(argv)
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if a.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from data_prep.files import write_json

    if a.baseline:
        out = {
            "command": f"python bench/step_profile.py --baseline {a.baseline}",
            "config": BASELINE,
            "torch": torch.__version__.split("+")[0],
            "counts": baseline_counts(),
        }
        print(json.dumps(out, indent=1))
        write_json(a.baseline, out)
        return out
    torch.set_num_threads(a.threads)
    results = {}
    for v in a.variants.split(","):
        r = profile_variant(a.scale, v, a.device, a.batch, a.overrides, a.warmup, a.steps, a.timed)
        results[v] = r
        show(r)
        write_json(a.json, {"settings": vars(a), "variants": results})
    print(f"wrote {a.json}")
    return {"settings": vars(a), "variants": results}


if __name__ == "__main__":
    main()
