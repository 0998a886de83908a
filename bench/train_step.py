"""Training-step throughput and peak memory of every variant, side by side in one run: the whole step of
`tlf train` (set up by `Trainer.build` without data, callbacks, checkpoints or MLflow, timed `Trainer.train_step()`:
DeepSpeed engine at world size 1, ZeRO-0, AdamW + schedule + clipping; forward of the full objective, backward,
optimizer step, the step's device-side meter), with t-loopformer vs loopformer, t-loopformer under each execution
strategy (`--strategies`: `model.execution` compact, sorted, bucketed, dense) and activation checkpointing
none/loop/layer.

    python bench/train_step.py                                   # small scale, vocab 8192, CPU
    python bench/train_step.py --scale paper --device cuda --micro-batch 6 --set model.vocab_size=50304
    python bench/train_step.py --variants loopformer,t-loopformer --strategies all --no-ablations   # strategies

Per strategy (`strategies` in the JSON): tokens/s, MFU, peak GiB and time ÷ FLOPs against loopformer in the same run
(total time of the timed rounds ÷ total FLOPs of the same rounds, each against loopformer's). The t-loopformer case
under the config's own strategy is labelled `t-loopformer`, the others `t-loopformer STRATEGY`.

Each case runs in a process of its own (peak memory is its own: CUDA max allocated, or on CPU the growth of the
process's peak RSS over the steps, i.e. gradients + optimizer state + activations), and the timed steps of all
cases are interleaved round-robin so machine load hits every case alike; the median step time is reported. On CUDA
with more than two cases, a case's process hands its cached blocks back after each step (`torch.cuda.empty_cache`)
and runs one untimed step before each timed one, so several paper-scale cases fit on one GPU side by side and each
timed step still runs on a warm allocator.
Every step runs as a numbered step of a run (`keyed_step`): the trainer draws its shortcut schedule from
(train.seed, step) and torch is reseeded with the step number for the router's exploration draws, so step n is the
same in every case.
By default the router's weights are spread so token depths cover 1..L as a trained router's do (`--router init`
keeps the initialisation, near-uniform pi, every token about L/2 deep); the mean depth is printed.
MFU = tokens/s x model.flops_per_token(executed loops) / --peak-flops. On CPU a step is timed by the process's
CPU time (robust to other load on the machine; one thread per case), on CUDA by the wall clock after a sync.

Memory breakdown (`pipeline.memory.SavedTensors`): one forward of the objective per case counts the bytes autograd
keeps for backward, once per storage (weights saved by the matmuls included, in loop 1), per loop application (full pass loops 1..L, shortcut loops 1..S) with the
tokens that ran it, and the rest (embedding + router, the LM heads with their losses). Host reads per forward
are counted with `bench/testkit.py`. The summary prints the step's three targets: t-loopformer's peak memory
<= 0.80x loopformer's; step-time ratio <= 1.10x the ratio of their model FLOPs per token (mean executed loops of
both passes); <= 1 host read per forward. On CPU the peak compared is that of live tensors (weights + optimizer
state + the peak during one untimed step whose shortcut pass has the most loops, S = L - 1, so the largest;
`pipeline.memory.tensor_peak_mib`), since the process's peak RSS also holds memory the C allocator keeps after
freeing it and moves by ±10% between identical runs; the RSS figure is printed beside it.
Writes JSON (bench/results/train_step.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from interleave import run_cases, write_json  # bench/ is the script's own directory


class _FixedBatch:
    """The trainer's loader for a benchmark: the same (x, y) every micro-batch."""

    epoch = 0

    def __init__(self, x, y):
        self.x, self.y = x, y

    def next(self):
        return self.x, self.y


def fixed_batch_trainer(scale: str, variant: str, device: str, batch: int, overrides: list, router: str = "spread"):
    """`tlf train`'s own set-up (Trainer.build: process group, model, DeepSpeed engine with AdamW + schedule +
    clipping) at world size 1, ZeRO-0, one micro-batch of `batch` per step, without data (one fixed random batch),
    callbacks, checkpoints or MLflow; router "spread": weights set so depths cover 1..L, as a trained router's do
    (before the engine copies them), "init": as initialised. The model is built uncompiled whatever
    train.compile says (the caller compiles it when it wants). Returns (cfg, model, trainer, x, y)."""
    import torch

    from pipeline.config import load_config
    from pipeline.model import LoopedLM
    from pipeline.train.trainer import Trainer
    from testkit import spread_router

    cfg = load_config(
        f"{scale}/{variant}",
        [
            *overrides,
            f"train.micro_batch_size={batch}",
            "train.grad_accum_steps=1",
            f"train.global_batch_size={batch}",
            "train.zero_stage=0",
            f"train.device={device}",
            "checkpoint.resume=none",
            "checkpoint.interval=0",
            f"checkpoint.dir={tempfile.mkdtemp(prefix='train_step_')}",  # nothing is saved; no run dir is read
            "train.eval_interval=0",
            "logging.mlflow=false",
        ],
    )
    compile_ = cfg.train.compile
    cfg.train.compile = False
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    if router == "spread":
        spread_router(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.block_size), generator=g)
    trainer = Trainer.build(cfg, callbacks=[], loader=_FixedBatch(x, y), model=model)
    cfg.train.compile = compile_
    return cfg, model, trainer, x, y


def keyed_step(trainer, key: int):
    """`trainer.train_step()` as step `key` + 1 of a run: the trainer draws the step's shortcut schedule from
    (train.seed, step) and torch's RNG is reseeded with key (the router's exploration draws), so step `key` is the
    same step in every case and process. Returns the step's meter."""
    import torch

    torch.manual_seed(key)
    trainer.step = key
    return trainer.train_step()


def _worker(spec: dict, conn) -> None:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if spec["device"] == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    from pipeline.memory import region_peak_mib, region_start, tensor_peak_mib
    from pipeline.train.compile import apply_compile

    torch.set_num_threads(spec["threads"])
    overrides = spec["overrides"] + spec["extra"] + [f"train.precision={'bf16' if spec['bf16'] else 'fp32'}"]
    cfg, model, trainer, x, y = fixed_batch_trainer(
        spec["scale"], spec["variant"], spec["device"], spec["batch"], overrides, spec["router"]
    )
    compile_ = cfg.train.compile
    compile_mode = spec.get("compile_mode")
    B, T = spec["batch"], cfg.model.block_size
    engine, dev = trainer.engine, trainer.engine.device
    # eager, with the step's activation checkpointing, device and precision
    breakdown = _saved_breakdown(engine.module, x.to(dev), y.to(dev), cfg.model.loops)
    if compile_:
        apply_compile(model, mode=compile_mode)
    cuda = str(dev).startswith("cuda")
    base = region_start(dev)  # the steps' own peak (optimizer state included), not start-up's
    state = {"n": 0, "loops": [], "timed": [], "heads": 1}

    def step(shortcut=None, seed=None):
        # timed round r is step 10**6 + r in every case (whatever its warm-up): the same shortcut schedule
        # everywhere, so time ratios line up with FLOPs ratios round by round
        key = state["n"] if seed is None else seed
        state["n"] += 1
        if shortcut is None:
            meter = keyed_step(trainer, key)  # the micro-batches of one optimizer step of `tlf train`
        else:
            torch.manual_seed(
                key
            )  # the untimed step of the largest peak: a fixed shortcut schedule, the same engine calls
            out = engine(x.to(dev), y.to(dev), shortcut=shortcut)
            engine.backward(out.loss)
            engine.step()
            return
        if cuda:
            torch.cuda.synchronize()
        # sums over the step's one micro-batch
        state["loops"].append(float(meter.loops))
        state["heads"] = meter.lm_heads
        state["depth"] = float(meter.stats["full/mean_depth"])

    for _ in range(spec["warmup"]):
        step()
    release = cuda and spec.get("release", False)  # several cases on one GPU: hold no cache between steps
    alloc_gb = None
    if not cuda:  # weights + optimizer state + the peak of live tensors during one (untimed) step
        persistent = sum(t.numel() * t.element_size() for t in _persistent_tensors(engine))
        longest = torch.tensor([2] + [1] * (cfg.model.loops - 2))  # S = L - 1: the step of the largest peak
        if model.router is not None:  # the depth map of that step, for `tlf plan`'s validation (tests/test_plan.py)
            from pipeline.model.looped import active_counts

            with torch.no_grad():
                m_ = engine.module.net
                state["counts"] = active_counts(
                    m_.route(m_.embed(x.to(dev))).depth(cfg.model.loops, m_._theta(None)), cfg.model.loops
                ).tolist()
        alloc_gb = (persistent / 2**20 + tensor_peak_mib(lambda: step(longest))) / 1024
    if release:
        torch.cuda.empty_cache()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "step":
            if release:
                step()  # untimed: the allocator takes its blocks back before the timed step
            clock = time.perf_counter if cuda else time.process_time  # CPU: this process's CPU time
            t0 = clock()
            step(seed=10**6 + len(state["timed"]))
            dt = clock() - t0
            state["timed"].append(state["loops"][-1])  # this round's loops (the same schedule in every case)
            if release:
                torch.cuda.empty_cache()
            conn.send(dt)
        elif cmd == "stats":
            loops = sum(state["timed"]) / len(state["timed"])  # over the timed rounds only
            peak = region_peak_mib(dev, base) / 1024
            conn.send(
                {
                    "peak_mem_gb": peak,
                    "alloc_peak_gb": alloc_gb if alloc_gb is not None else peak,
                    "mean_depth": state["depth"],
                    "loops_executed": loops,
                    "flops_per_token": model.flops_per_token(loops, T, state["heads"]),
                    "round_flops_per_token": [model.flops_per_token(x, T, state["heads"]) for x in state["timed"]],
                    "params": model.num_params(),
                    "tokens_per_step": B * T,
                    "depth_counts": state.get("counts"),
                    **breakdown,
                }
            )
        else:
            return


def _persistent_tensors(engine):
    """The tensors that live across steps: parameters and the optimizer's state (storage counted once)."""
    import torch

    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    seen, out = set(), []
    tensors = list(engine.module.parameters()) + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
    return out


def _saved_breakdown(objective, x, y, L: int) -> dict:
    """One forward of the objective (the trainer's `Objective` around the network): bytes kept for backward per
    loop application and per token, the rest (embedding + router, LM heads + losses), and the host reads the
    model made."""
    import torch

    from testkit import count_host_reads
    from pipeline.memory import SavedTensors

    acc, calls, tokens = SavedTensors(), [0], {}
    model = objective.net

    def loop_start(mod, args):  # layer 0 starts every loop application
        calls[0] += 1
        k = calls[0]
        acc.label = f"full/{k}" if k <= L else f"short/{k - L}"
        tokens[acc.label] = args[0].shape[0] * args[0].shape[1]

    def head_start(mod, args):
        acc.label = "heads+losses"

    hooks = [model.layers[0].register_forward_pre_hook(loop_start), model.norm_f.register_forward_pre_hook(head_start)]
    acc.label = "embed+router"
    torch.manual_seed(0)
    with acc, count_host_reads() as reads:
        out = objective(x, y)
    del out
    for h in hooks:
        h.remove()
    loops = {k: v for k, v in acc.by_label.items() if k in tokens}
    token_loops = sum(tokens.values())
    return {
        "saved_mib": acc.total / 2**20,
        "saved_loops_mib": sum(loops.values()) / 2**20,
        "saved_other_mib": {k: v / 2**20 for k, v in acc.by_label.items() if k not in tokens},
        "saved_per_loop": {k: {"tokens": tokens[k], "bytes_per_token": v / tokens[k]} for k, v in loops.items()},
        "token_loops": token_loops,
        "loop_bytes_per_token": sum(loops.values()) / max(token_loops, 1),
        "host_reads_per_forward": len(reads),
    }


def strategies() -> tuple[str, ...]:
    """The values of `model.execution` (pipeline/config.py), in its order."""
    import typing

    from pipeline.config import ModelConfig

    return typing.get_args(typing.get_type_hints(ModelConfig)["execution"])


def strategy_list(arg: str) -> list[str] | None:
    """The `--strategies` option of this bench and step_profile: 'all' (every value of `strategies`), a
    comma-separated list, or 'config' (None: the config's own)."""
    if arg == "config":
        return None
    return list(strategies()) if arg == "all" else arg.split(",")


def strategy_label(strategy: str, default: str) -> str:
    """The case of t-loopformer under `strategy`: `t-loopformer` under the config's own (`default`), else
    `t-loopformer STRATEGY`."""
    return "t-loopformer" if strategy == default else f"t-loopformer {strategy}"


def strategy_figures(results: dict, strats: list[str], default: str) -> dict:
    """Per strategy whose case ran: tokens/s, MFU, peak GiB (`alloc_peak_gb`: CUDA max allocated, or on CPU the
    live tensors' peak) and, with loopformer in the run, time ÷ FLOPs against it: the total time of the timed
    rounds over loopformer's, divided by the total FLOPs per token of the same rounds over loopformer's (and the
    lowest and highest round)."""
    lf, out = results.get("loopformer"), {}
    for s_ in strats:
        r = results.get(strategy_label(s_, default))
        if r is None:
            continue
        f = {
            "tokens_per_s": r["tokens_per_s"],
            "mfu": r["mfu"],
            "peak_gib": r["alloc_peak_gb"],
            "time_over_flops": None,
        }
        if lf is not None:
            fl = sum(r["round_flops_per_token"]) / sum(lf["round_flops_per_token"])
            f["time_over_flops"] = sum(r["times_s"]) / sum(lf["times_s"]) / fl
            rounds = [
                (t / tl) / (fa / fb)
                for t, tl, fa, fb in zip(
                    r["times_s"], lf["times_s"], r["round_flops_per_token"], lf["round_flops_per_token"]
                )
            ]
            f["time_over_flops_rounds"] = [min(rounds), max(rounds)]
        out[s_] = f
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="small", help="preset scale: tiny, small or paper")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--micro-batch", dest="batch", type=int, default=8)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="config override for every case (repeatable); default model.vocab_size=8192 so the loops, "
        "not the LM head, dominate",
    )
    ap.add_argument("--variants", default="all")
    ap.add_argument(
        "--strategies",
        default="config",
        help="model.execution strategies t-loopformer runs under, comma-separated, or 'all' (compact, sorted, "
        "bucketed, dense); default 'config': the config's own (and dense among the ablations)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (each case one step per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument(
        "--router",
        choices=["spread", "init"],
        default="spread",
        help="spread: router weights set so depths cover 1..L (like a trained router); init: as initialised "
        "(near-uniform pi, every token about L/2 deep)",
    )
    ap.add_argument("--no-compile", action="store_true", help="leave out the train.compile=true cases")
    ap.add_argument(
        "--no-ablations",
        action="store_true",
        help="only the --variants and --strategies themselves (no dense, checkpointing or compile cases)",
    )
    ap.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="for MFU; default: logging.peak_flops, else this GPU's row of pipeline/hardware.py, else an A100's",
    )
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "train_step.json"))
    a = ap.parse_args(argv)
    from pipeline.config import VARIANTS, load_config
    from pipeline.hardware import gpu, this_gpu

    overrides = a.overrides if a.overrides is not None else ["model.vocab_size=8192"]
    on_gpu = a.device.startswith("cuda") and this_gpu()  # the table's row for this GPU, if it holds one
    peak = (
        a.peak_flops
        or load_config(f"{a.scale}/t-loopformer").logging.peak_flops
        or (on_gpu or gpu("a100-80gb")).peak_flops
    )
    variants = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    default = load_config(f"{a.scale}/t-loopformer", overrides).model.execution
    strats = strategy_list(a.strategies) or [default]
    common = {
        "scale": a.scale,
        "device": a.device,
        "bf16": a.bf16,
        "batch": a.batch,
        "overrides": overrides,
        "warmup": a.warmup,
        "threads": a.threads,
        "router": a.router,
    }
    specs = {v: {**common, "variant": v, "extra": []} for v in variants}
    if "t-loopformer" in variants:
        for s_ in strats:
            specs[strategy_label(s_, default)] = {
                **common,
                "variant": "t-loopformer",
                "extra": [f"model.execution={s_}"],
            }
    ablations = {
        "t-loopformer dense": ("t-loopformer", ["model.execution=dense"]),
        # the expected router recipe: every token runs every loop in training, a head per exit
        "t-loopformer expected": (
            "t-loopformer",
            ["model.router_norm=true", "model.exit_schedule=prefix", "objective.router.recipe=expected"],
        ),
        "t-loopformer ckpt=loop": ("t-loopformer", ["train.activation_checkpointing=loop"]),
        "t-loopformer ckpt=layer": ("t-loopformer", ["train.activation_checkpointing=layer"]),
        "loopformer ckpt=loop": ("loopformer", ["train.activation_checkpointing=loop"]),
        "t-loopformer compile": ("t-loopformer", ["train.compile=true"]),
        "loopformer compile": ("loopformer", ["train.compile=true"]),
        # bucketed's whole loop compiled with static shapes, on CUDA also through CUDA graphs
        "t-loopformer bucketed compile": ("t-loopformer", ["model.execution=bucketed", "train.compile=true"]),
    }
    if a.device.startswith("cuda"):
        ablations["t-loopformer bucketed cudagraphs"] = ablations["t-loopformer bucketed compile"]
    if a.no_ablations:
        ablations = {}
    if a.no_compile:
        ablations = {k: v for k, v in ablations.items() if "compile" not in k and "cudagraphs" not in k}
    for label, (v, extra) in ablations.items():
        if v in variants and label not in specs:  # compiled cases warm up until each 0/1-specialised graph is met
            specs[label] = {
                **common,
                "variant": v,
                "extra": extra,
                **({"warmup": max(a.warmup, 6)} if "compile" in label or "cudagraphs" in label else {}),
                **({"compile_mode": "reduce-overhead"} if "cudagraphs" in label else {}),
            }
    for spec in specs.values():
        spec["release"] = len(specs) > 2  # CUDA: hand cached blocks back between steps (module docstring)
    results = run_cases(_worker, specs, a.steps)
    for r in results.values():
        r["tokens_per_s"] = r["tokens_per_step"] / r["time_s"]
        r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak

    cfg = load_config(f"{a.scale}/t-loopformer", overrides)
    m = cfg.model
    print(
        f"\ntrain_step: one optimizer step (DeepSpeed ZeRO-0, AdamW), micro-batch {a.batch} x T={m.block_size}, "
        f"d={m.d_model}, J={m.n_layers} L={m.loops}, vocab {m.vocab_size}, on {a.device}"
        f"{' bf16' if a.bf16 else ' fp32'}, {a.threads} threads, router {a.router}"
    )
    ref = results.get("t-loopformer", next(iter(results.values())))
    print(
        f"{'case':<26} {'ms/step':>9} {'tok/s':>9} {'x t-loopf':>9} {'peak GB':>8} {'alloc GB':>8} {'depth':>6} {'MFU %':>7} "
        f"{'saved MiB':>9} {'B/tok-loop':>10} {'reads':>5}"
    )
    for label, r in results.items():
        print(
            f"{label:<26} {r['time_s'] * 1e3:9.1f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / ref['tokens_per_s']:9.2f} "
            f"{r['peak_mem_gb']:8.3f} {r['alloc_peak_gb']:8.3f} {r['mean_depth']:6.2f} {100 * r['mfu']:7.3f} {r['saved_mib']:9.1f} "
            f"{r['loop_bytes_per_token']:10.0f} {r['host_reads_per_forward']:5d}"
        )
    for label in ("loopformer", "t-loopformer"):
        if label in results:
            r = results[label]
            per = ", ".join(
                f"{k} {v['bytes_per_token'] / 1024:.1f}KB x{v['tokens']}" for k, v in r["saved_per_loop"].items()
            )
            other = ", ".join(f"{k} {v:.1f}" for k, v in r["saved_other_mib"].items())
            print(f"  {label} kept for backward per loop (bytes/token x tokens): {per}; other MiB: {other}")

    def ratio(a_, b_, key):
        return results[a_][key] / results[b_][key] if a_ in results and b_ in results and results[b_][key] else None

    targets = {}
    if "t-loopformer" in results and "loopformer" in results:
        t, lf = results["t-loopformer"], results["loopformer"]
        # time against FLOPs over the same timed rounds (round r is the same shortcut schedule in both cases):
        # total CPU time of the rounds against total FLOPs of the rounds (not the median step's time against the
        # mean FLOPs of all steps, warm-up included: two different sets of steps).
        flops = sum(t["round_flops_per_token"]) / sum(lf["round_flops_per_token"])
        time_r = sum(t["times_s"]) / sum(lf["times_s"])
        per_round = sorted(
            (a_ / b_) / (fa / fb)
            for a_, b_, fa, fb in zip(
                t["times_s"], lf["times_s"], t["round_flops_per_token"], lf["round_flops_per_token"]
            )
        )
        # the floor: loopformer's peak less its per-token loop bytes for the token-loops t-loopformer skips (rate:
        # the median loop, loop 1 also holds the weights the matmuls save); all else (weights, Adam state, LM heads
        # and losses, embeddings, every token's loop 1) is what both models keep whatever the router does
        rate = sorted(v["bytes_per_token"] for v in lf["saved_per_loop"].values())[len(lf["saved_per_loop"]) // 2]
        floor = 1 - rate * (lf["token_loops"] - t["token_loops"]) / 2**20 / (lf["alloc_peak_gb"] * 1024)
        targets = {
            "peak memory ratio (live tensors)": (t["alloc_peak_gb"] / lf["alloc_peak_gb"], 0.80),
            "peak memory ratio (process RSS, noisy on CPU)": (t["peak_mem_gb"] / lf["peak_mem_gb"], None),
            "peak_mem floor (same bytes per token-loop)": (floor, None),
            "saved-for-backward ratio": (t["saved_mib"] / lf["saved_mib"], None),
            "loop bytes per token-loop ratio": (t["loop_bytes_per_token"] / lf["loop_bytes_per_token"], None),
            "token-loops ratio": (t["token_loops"] / lf["token_loops"], None),
            "model FLOPs ratio": (flops, None),
            "step time ratio / FLOPs ratio": (time_r / flops, 1.10),
            "  the same, round by round: lowest": (per_round[0], None),
            "  the same, round by round: highest": (per_round[-1], None),
            "host reads per forward (t-loopformer)": (float(t["host_reads_per_forward"]), 1.0),
        }
        print()
        for k, (v, tgt) in targets.items():
            verdict = "" if tgt is None else (f"  target <= {tgt:.2f}: " + ("met" if v <= tgt else "MISSED"))
            print(f"{k:<44} {v:6.3f}{verdict}")
    summary = {
        "t-loopformer/loopformer tokens_per_s": ratio("t-loopformer", "loopformer", "tokens_per_s"),
        "t-loopformer/loopformer peak_mem": ratio("t-loopformer", "loopformer", "alloc_peak_gb"),
        "compact/dense tokens_per_s": ratio("t-loopformer", "t-loopformer dense", "tokens_per_s"),
        "compact/dense peak_mem": ratio("t-loopformer", "t-loopformer dense", "alloc_peak_gb"),
        "ckpt loop/none peak_mem (t-loopformer)": ratio("t-loopformer ckpt=loop", "t-loopformer", "alloc_peak_gb"),
        "ckpt loop/none tokens_per_s (t-loopformer)": ratio("t-loopformer ckpt=loop", "t-loopformer", "tokens_per_s"),
        "ckpt layer/none peak_mem (t-loopformer)": ratio("t-loopformer ckpt=layer", "t-loopformer", "alloc_peak_gb"),
        "ckpt loop/none peak_mem (loopformer)": ratio("loopformer ckpt=loop", "loopformer", "alloc_peak_gb"),
        "compile on/off tokens_per_s (t-loopformer)": ratio("t-loopformer compile", "t-loopformer", "tokens_per_s"),
        "compile on/off tokens_per_s (loopformer)": ratio("loopformer compile", "loopformer", "tokens_per_s"),
    }
    print()
    for k, v in summary.items():
        if v is not None:
            print(f"{k:<44} {v:6.2f}")
    per = strategy_figures(results, list(strategies()), default)
    if per:
        print(f"\n{'strategy':<10} {'tok/s':>9} {'MFU %':>7} {'peak GiB':>9} {'time/FLOPs':>10} {'rounds':>13}")
        for k, f in per.items():
            tf = f["time_over_flops"]
            rounds = "" if tf is None else f"{f['time_over_flops_rounds'][0]:.3f}-{f['time_over_flops_rounds'][1]:.3f}"
            print(
                f"{k:<10} {f['tokens_per_s']:9.0f} {100 * f['mfu']:7.3f} {f['peak_gib']:9.3f} "
                f"{'' if tf is None else f'{tf:10.3f}'} {rounds:>13}"
            )
    out = {
        "settings": {**common, "steps": a.steps, "peak_flops": peak, "strategies": strats},
        "results": results,
        "summary": summary,
        "strategies": per,
        "targets": {k: {"value": v, "target": tgt} for k, (v, tgt) in targets.items()},
    }
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
