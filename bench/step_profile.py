"""Where one training step's time goes, loop by loop: torch.profiler over `tlf train`'s step (`Trainer.build` set up
as bench/train_step.py does: a fixed batch, ZeRO-0, AdamW, no callbacks or checkpoints; router weights spread so
depths cover 1..L) for each case, one after the other in this process: each variant, a routed one under each
execution strategy of `--strategies` (`model.execution`: compact, sorted, bucketed, dense; case `t-loopformer
STRATEGY`), one without a router once.

    python bench/step_profile.py --scale paper --device cuda --micro-batch 6 --variants loopformer,t-loopformer \\
        --set model.vocab_size=50304 --json bench/results/step_profile_paper.json
    python bench/step_profile.py          # CPU: every strategy's figures of the fixed tiny config (bench/README)
    python bench/step_profile.py --baseline tests/fixtures/op_counts.json   # rewrite the test's baseline

Each loop application of each pass runs inside a `record_function` range `tlf/full/i` or `tlf/short/i`,
applied from outside (`loop_ranges`: the network's `loop`, and `_compacted_loop` and `_masked_loop` where a
strategy lays a loop out through them, wrapped on the instance for the profiled steps only, as activation
checkpointing and compilation are applied; nothing in the model knows). A forward op belongs to the loop whose
range holds it; a backward op to the loop whose forward op made its autograd node (the profiler's sequence numbers
link the two); the rest (embedding, router, the sorted strategy's one gather per pass and its per-loop masks,
heads and losses, optimizer) is `rest`. Per loop and pass direction: active tokens and computed slots (every
strategy hands `loop` (B, S, d) states and the mask of the active ones), ops (aten calls the code or autograd made:
host dispatch work), kernel ops (aten ops that launch work: views and allocations left out; the CPU stand-in for
GPU kernels), and on CUDA the kernels, the small ones (< 10 us: launch-bound) and their device time by kind
(matmul, attention, gather/sort/scatter, other); on CPU the ops' self CPU time by kind. Host syncs: on CUDA the
synchronising runtime calls the profiler saw, and everywhere the host reads of tlf's own code in one step
(`bench/testkit.py` count_host_reads: the model's one read of |A_i| per forward and the trainer's one per step).

On CPU (never on CUDA) each case then runs `--shape-steps` training steps (default 50) on fresh random batches, so the router's
depths vary as in training, compiled as `tlf train` compiles it (`pipeline/train/compile.py` with the dynamo
backend `--compile-backend`, default "eager": the same tracing, guards and graph breaks as inductor without code
generation; cheap and machine-independent): the distinct computed lengths S each loop position met, the graphs
dynamo compiled and its graph breaks, and the loops' padded FLOPs ÷ executed FLOPs (computed slots against active
tokens, each at its loop's matmul FLOPs per slot). That run uses vocabulary 512 (SHAPE_VOCAB: the head's cost, not
the loops' shapes).

Bounded by construction: `--warmup` plain steps, then the profiler's schedule (wait 0, warmup 1, active --steps)
with no shapes, stacks or memory recorded; each phase's seconds (build, warm-up, profile, analysis, the steps on
fresh batches) are printed as it ends and kept in the JSON, so a run cut short by a time limit says where it was.

CPU, default arguments: the op counts of one step of `tiny` loopformer and t-loopformer under every strategy
(micro-batch 4, router spread), machine-independent; tests/test_op_counts.py holds them (with 10 uncompiled steps
on fresh batches) to the committed baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import fixed_batch_trainer, keyed_step, strategies, strategy_list  # bench/: the script's directory

# the fixed config whose op counts tests/test_op_counts.py guards (CPU, fp32)
BASELINE = {"scale": "tiny", "variants": ["loopformer", "t-loopformer"], "batch": 4, "overrides": [], "shape_steps": 10}
RANGE = "tlf/"  # profiler ranges tlf/full/i, tlf/short/i, tlf/optimizer
SHAPE_VOCAB = 512  # the --shape-steps run's vocabulary: the loops' shapes do not depend on it, its time does
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


class LoopLog:
    """What `loop_ranges` saw of the loop applications: per `LoopedLM.loop` call its label, rows B, computed slots
    per row S and active mask (None: every slot active). The masks are summed only in `flush` (after the step, so
    the profiled step holds no extra op and no host read); `flush` adds to the totals and returns the step's
    [active tokens, padded slots] per label (the last application of each)."""

    def __init__(self, net=None):
        self.pending: list = []
        self.shapes: dict[str, set] = defaultdict(set)  # label -> the computed lengths S it met
        self.flops = [0.0, 0.0]  # padded, executed: slots and active tokens at the loop's matmul FLOPs per slot
        self.net = net

    def slot_flops(self, S: int) -> float:
        """Forward matmul FLOPs of one slot in a loop computing S slots per row: one loop's share of
        `LoopedLM.flops_per_token` with T = S (the J layers' weights and attention over S keys); 1 without a net."""
        if self.net is None:
            return 1.0
        per = lambda m: self.net.flops_per_token(loops_executed=m, seq_len=S, backward=False)
        return per(1) - per(0)

    def flush(self) -> dict:
        tokens = {}
        for label, B, S, active in self.pending:
            n = B * S if active is None else int(active.sum())
            tokens[label] = [n, B * S]
            self.shapes[label].add(S)
            f = self.slot_flops(S)
            self.flops[0] += B * S * f
            self.flops[1] += n * f
        self.pending = []
        return tokens

    def padded_over_executed(self) -> float | None:
        return self.flops[0] / self.flops[1] if self.flops[1] else None


# the LoopedLM methods that run one loop application: `loop` (every strategy's arithmetic) and the per-loop
# layout work around it where a strategy has one (compact and bucketed: gather/scatter; dense: the mask)
RANGED = ("loop", "_compacted_loop", "_masked_loop")


@contextlib.contextmanager
def loop_ranges(net, log: LoopLog | None = None):
    """Every loop application of `net` (a LoopedLM) inside a profiler range `tlf/PASS/i` (PASS full, then
    short, counted from each forward), applied from outside on the instance and removed on exit: the outermost of
    the RANGED methods a loop runs through opens the range, so a loop's own gather/scatter or mask is inside it
    (the sorted strategy's one gather per pass is not: `rest`). log, if given, gets every `loop` call's label,
    shape and active mask (`LoopLog`)."""
    from torch.autograd.profiler import record_function

    state = {"pass": -1, "depth": 0, "label": None}
    orig = {name: getattr(net, name) for name in RANGED if hasattr(net, name)}

    def reset(_mod, _args):
        state["pass"] = -1

    def wrap(name):
        def ranged(h, i, *args, **kw):
            outer = state["depth"] == 0
            if outer:
                state["pass"] += i == 1
                state["label"] = f"{('full', 'short')[min(state['pass'], 1)]}/{i}"
            if name == "loop" and log is not None:
                active = kw.get("active")
                log.pending.append((state["label"], *h.shape[:2], None if active is None else active.detach()))
            if not outer:  # inside another RANGED method of the same loop: one range
                return orig[name](h, i, *args, **kw)
            state["depth"] += 1
            try:
                with record_function(RANGE + state["label"]):
                    return orig[name](h, i, *args, **kw)
            finally:
                state["depth"] -= 1

        return ranged

    handle = net.register_forward_pre_hook(reset)
    for name in orig:
        setattr(net, name, wrap(name))
    try:
        yield log
    finally:
        handle.remove()
        for name in orig:
            delattr(net, name)  # the class's methods again


@contextlib.contextmanager
def step_ranges(trainer, log: LoopLog | None = None):
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
        with loop_ranges(trainer.model, log):
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


def cases(scale: str, variants: list[str], strats: list[str] | None) -> dict[str, tuple[str, list]]:
    """label -> (variant, overrides): a routed variant once per strategy (`t-loopformer compact`, ...; with strats
    None, once under its config's own strategy, label the variant's name), a variant without a router once (its
    loops run every token: the strategies coincide)."""
    from pipeline.config import load_config

    out = {}
    for v in variants:
        if strats is not None and load_config(f"{scale}/{v}").model.router:
            out.update({f"{v} {s}": (v, [f"model.execution={s}"]) for s in strats})
        else:
            out[v] = (v, [])
    return out


def profile_variant(
    scale: str,
    variant: str,
    device: str,
    batch: int,
    overrides: list,
    warmup: int,
    steps: int,
    timed: int,
    label: str | None = None,
) -> dict:
    """Builds the variant's trainer, runs warm-up, timed and profiled steps; returns its figures."""
    import torch
    from testkit import count_host_reads
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = device.startswith("cuda")
    label = label or variant
    phases, t = {}, time.perf_counter()

    def phase(name):
        nonlocal t
        phases[name] = time.perf_counter() - t
        print(f"  {label}: {name} {phases[name]:.1f} s", file=sys.stderr, flush=True)
        t = time.perf_counter()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cfg, model, trainer, _x, _y = fixed_batch_trainer(scale, variant, device, batch, overrides)
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
    log = LoopLog(model)
    with (
        step_ranges(trainer, log),
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
    tokens = log.flush()  # the last profiled step's loops (after the profiler: no op or read of its own in it)
    phase("profile")
    per = attribute(prof.events(), cuda, steps)
    phase("analysis")
    loops = {k: v for k, v in per.items() if k not in ("rest", "optimizer")}
    tot = _totals(per)
    return {
        "variant": f"{scale}/{variant}",
        "execution": cfg.model.execution if cfg.model.router else None,
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


def shape_run(scale: str, variant: str, batch: int, overrides: list, steps: int, backend: str | None = "eager") -> dict:
    """`steps` training steps on CPU of the case compiled as `tlf train` compiles it (`apply_compile`, with the
    dynamo backend `backend`: "eager" traces, guards and breaks graphs as inductor does, without generating
    code; None: not compiled, graphs and graph breaks None), each step a fresh random batch (so the router's depths and each loop's active counts vary as in
    training) and step 10**6 + k's shortcut schedule, at vocabulary SHAPE_VOCAB (the head's cost, not the loops'
    shapes). Returns the distinct computed lengths S each loop position
    met, the graphs dynamo compiled and the graph breaks it took, and the loops' padded FLOPs ÷ executed FLOPs
    (computed slots against active tokens, each at its loop's matmul FLOPs per slot: `LoopLog`)."""
    import torch
    from torch._dynamo.utils import counters

    from pipeline.train.compile import apply_compile, compile_count, graph_breaks

    overrides = [*overrides, f"model.vocab_size={SHAPE_VOCAB}"]
    cfg, model, trainer, _x, _y = fixed_batch_trainer(scale, variant, "cpu", batch, overrides)
    torch._dynamo.reset()
    counters.clear()
    if steps and backend is not None:
        apply_compile(model, backend=backend)
    g = torch.Generator().manual_seed(2)
    V, T = cfg.model.vocab_size, cfg.model.block_size
    log = LoopLog(model)
    t0 = time.perf_counter()
    with loop_ranges(model, log):
        for k in range(steps):
            trainer.loader.x = torch.randint(0, V, (batch, T), generator=g)
            trainer.loader.y = torch.randint(0, V, (batch, T), generator=g)
            trainer.read(keyed_step(trainer, 10**6 + k))
            log.flush()
    shapes = {k: sorted(v) for k, v in sorted(log.shapes.items(), key=lambda kv: (kv[0][0] == "s", kv[0]))}
    out = {
        "steps": steps,
        "compile_backend": backend,
        "shapes": shapes,
        "distinct_shapes_max": max((len(v) for v in shapes.values()), default=0),
        "distinct_shapes": len({s for v in shapes.values() for s in v}),
        "graphs": compile_count() if backend is not None else None,
        "graph_breaks": graph_breaks() if backend is not None else None,
        "graph_break_reasons": dict(counters["graph_break"]),
        "padded_over_executed": log.padded_over_executed(),
        "seconds": time.perf_counter() - t0,
    }
    torch._dynamo.reset()
    return out


def show(r: dict) -> None:
    tm = r["ms_per_step"]
    print(
        f"{r['label']} on {r['device']}: {r['wall_ms_per_step']:.1f} ms per step ({r['wall_ms_per_step_profiled']:.1f}"
        f" profiled), {r['ops_per_step']:.0f} ops, {r['kernel_ops_per_step']:.0f} kernel ops, {r['kernels_per_step']:.0f}"
        f" kernels ({r['small_kernels_per_step']:.0f} < {SMALL_US:.0f} us), {r['syncs_per_step']:.0f} sync calls,"
        f" {r['host_reads_per_step']} host reads; {r['clock']} ms: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(tm.items()))
    )
    sh = r.get("over_steps")
    if sh:
        how = f"compiled, backend {sh['compile_backend']}" if sh["compile_backend"] else "not compiled"
        print(
            f"  over {sh['steps']} steps ({how}): distinct loop lengths "
            f"{sh['distinct_shapes']} (at most {sh['distinct_shapes_max']} per loop position), {sh['graphs']} graphs, "
            f"{sh['graph_breaks']} graph breaks, padded / executed FLOPs {sh['padded_over_executed']:.3f}"
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
    out = {
        "ops_per_step": r["ops_per_step"],
        "kernel_ops_per_step": r["kernel_ops_per_step"],
        "loop_kernel_ops_per_step": r["loops_per_step"]["kernel_ops"],
        "host_reads_per_step": r["host_reads_per_step"],
    }
    sh = r.get("over_steps")
    if sh:
        out.update({k: sh[k] for k in ("shapes", "distinct_shapes_max", "distinct_shapes")})
        if sh["graphs"] is not None:
            out.update(graphs=sh["graphs"], graph_breaks=sh["graph_breaks"])
        out["padded_over_executed"] = round(sh["padded_over_executed"], 4)
    return out


def run_case(label: str, variant: str, scale: str, device: str, batch: int, overrides: list, a) -> dict:
    """One case: its profile (`profile_variant`) and, on CPU with a.shape_steps > 0, its figures over that many
    compiled steps (`shape_run`) under "over_steps"."""
    r = profile_variant(scale, variant, device, batch, overrides, a.warmup, a.steps, a.timed, label)
    r["label"] = label
    if device == "cpu" and a.shape_steps > 0:
        r["over_steps"] = shape_run(scale, variant, batch, overrides, a.shape_steps, a.compile_backend)
        print(f"  {label}: {a.shape_steps} steps on fresh batches {r['over_steps']['seconds']:.1f} s", file=sys.stderr)
    return r


def baseline_counts(shape_steps: int = BASELINE["shape_steps"], backend: str | None = None) -> dict:
    """Op counts of one step of each BASELINE case on CPU (one thread, fp32: loopformer, t-loopformer under every
    strategy), with the figures of `shape_steps` steps on fresh batches (`shape_run`; compiled with `backend`,
    None: eager, which gives the same shapes and padding; tests/test_compile.py holds the compiled graphs)."""
    import torch

    torch.set_num_threads(1)
    b = BASELINE
    a = argparse.Namespace(warmup=0, steps=1, timed=0, shape_steps=shape_steps, compile_backend=backend)
    out = {}
    for label, (v, extra) in cases(b["scale"], b["variants"], list(strategies())).items():
        out[label] = op_counts(run_case(label, v, b["scale"], "cpu", b["batch"], b["overrides"] + extra, a))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default=BASELINE["scale"])
    ap.add_argument("--variants", default=",".join(BASELINE["variants"]))
    ap.add_argument(
        "--strategies",
        default="all",
        help="model.execution strategies each routed variant runs under, comma-separated (default all: compact, "
        "sorted, bucketed, dense); 'config': the config's own only",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", dest="batch", type=int, default=BASELINE["batch"])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=1, help="plain steps before anything is measured")
    ap.add_argument("--timed", type=int, default=1, help="plain steps timed without the profiler")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps (after one discarded profiler warm-up)")
    ap.add_argument(
        "--shape-steps",
        type=int,
        default=50,
        help="CPU: compiled steps on fresh batches for distinct shapes, graphs, graph breaks, padded/executed "
        "FLOPs (0: none; never on CUDA)",
    )
    ap.add_argument(
        "--compile-backend", default="eager", help="dynamo backend of the --shape-steps run ('none': not compiled)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "step_profile.json"))
    ap.add_argument("--baseline", help="write the op counts of the fixed CPU config to this file (the test's)")
    a = ap.parse_args(argv)
    a.compile_backend = None if a.compile_backend == "none" else a.compile_backend
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if a.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from data_prep.files import write_json

    if a.baseline:
        out = {
            "command": f"python bench/step_profile.py --baseline {a.baseline}",
            "config": {**BASELINE, "shape_vocab": SHAPE_VOCAB},
            "torch": torch.__version__.split("+")[0],
            "counts": baseline_counts(),
        }
        print(json.dumps(out, indent=1))
        write_json(a.baseline, out)
        return out
    torch.set_num_threads(a.threads)
    strats = strategy_list(a.strategies)
    results = {}
    for label, (v, extra) in cases(a.scale, a.variants.split(","), strats).items():
        r = run_case(label, v, a.scale, a.device, a.batch, a.overrides + extra, a)
        results[label] = r
        show(r)
        write_json(a.json, {"settings": vars(a), "variants": results})
    print(f"wrote {a.json}")
    return {"settings": vars(a), "variants": results}


if __name__ == "__main__":
    main()
