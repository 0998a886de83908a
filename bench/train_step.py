"""Training-step throughput and peak memory of every variant, side by side in one run: the whole step of
`tlf train` (DeepSpeed engine at world size 1, ZeRO-0, AdamW + schedule + clipping; forward of the full
objective, backward, optimizer step), with t-loopformer vs loopformer, gather-scatter on/off and activation
checkpointing none/loop/layer.

    python bench/train_step.py                                   # small scale, vocab 8192, CPU
    python bench/train_step.py --scale paper --device cuda --micro-batch 6 --set model.vocab_size=50304

Each case runs in a process of its own (peak memory is its own: CUDA max allocated, or on CPU the growth of the
process's peak RSS over the steps, i.e. gradients + optimizer state + activations), and the timed steps of all
cases are interleaved round-robin so machine load hits every case alike; the median step time is reported.
Before each step every case reseeds torch with the step number, so all cases draw the same shortcut schedules.
By default the router's weights are spread so token depths cover 1..L as a trained router's do (`--router init`
keeps the initialisation, near-uniform pi, every token about L/2 deep); the mean depth is printed.
MFU = tokens/s x model.flops_per_token(executed loops) / --peak-flops. Writes JSON (bench/results/train_step.json).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from interleave import run_cases, write_json  # noqa: E402  (bench/ is the script's own directory)


def _worker(spec: dict, conn) -> None:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if spec["device"] == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch

    from pipeline.config import load_config
    from pipeline.memory import region_peak_mib, region_start
    from pipeline.model import LoopedLM
    from pipeline.train import ds

    torch.set_num_threads(spec["threads"])
    cfg = load_config(f"{spec['scale']}/{spec['variant']}", spec["overrides"] + spec["extra"] + [
        f"train.micro_batch_size={spec['batch']}", "train.grad_accum_steps=1",
        f"train.global_batch_size={spec['batch']}", "train.zero_stage=0", f"train.device={spec['device']}",
        f"train.precision={'bf16' if spec['bf16'] else 'fp32'}"])
    ds.init_distributed(spec["device"])
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    if model.router is not None and spec["router"] == "spread":  # depths over 1..L, as a trained router gives
        with torch.no_grad():  # (same recipe as bench/model_step.py)
            model.router.fc1.weight.normal_(0, 5.0 / cfg.model.d_model ** 0.5 / cfg.model.init_std)
            model.router.fc2.weight.normal_(0, 1.0)
            model.router.fc2.bias.copy_(torch.linspace(1.0, -1.0, cfg.model.loops))
    model.activation_checkpointing = cfg.train.activation_checkpointing
    opt, sched = ds.build_optimizer(cfg, model)
    engine = ds.initialize(model, opt, sched, ds.build_ds_config(cfg, 1, "bf16" if spec["bf16"] else "fp32"))
    dev = engine.device
    B, T = spec["batch"], cfg.model.block_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g).to(dev)
    y = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g).to(dev)
    cuda = str(dev).startswith("cuda")
    base = region_start(dev)  # the steps' own peak (optimizer state included), not start-up's
    state = {"n": 0, "loops": [], "heads": 1}

    def step():
        torch.manual_seed(state["n"])
        state["n"] += 1
        out = engine(x, y)
        engine.backward(out.loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        state["loops"].append(float(out.stats["full/mean_depth"]) + float(out.stats.get("short/mean_depth", 0.0)))
        state["heads"] = 2 if "short/loops" in out.stats else 1
        state["depth"] = float(out.stats["full/mean_depth"])

    for _ in range(spec["warmup"]):
        step()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "step":
            t0 = time.perf_counter()
            step()
            conn.send(time.perf_counter() - t0)
        elif cmd == "stats":
            loops = sum(state["loops"]) / len(state["loops"])
            peak = region_peak_mib(dev, base) / 1024
            conn.send({"peak_mem_gb": peak, "mean_depth": state["depth"], "loops_executed": loops,
                       "flops_per_token": model.flops_per_token(loops, T, state["heads"]),
                       "params": model.num_params(), "tokens_per_step": B * T})
        else:
            return


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="small", help="preset scale: tiny, small or paper")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--micro-batch", dest="batch", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=None,
                    help="config override for every case (repeatable); default model.vocab_size=8192 so the loops, "
                         "not the LM head, dominate")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (each case one step per round)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--router", choices=["spread", "init"], default="spread",
                    help="spread: router weights set so depths cover 1..L (like a trained router); init: as initialised "
                         "(near-uniform pi, every token about L/2 deep)")
    ap.add_argument("--peak-flops", type=float, default=None, help="for MFU; default: logging.peak_flops")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "train_step.json"))
    a = ap.parse_args(argv)
    from pipeline.config import VARIANTS, load_config

    overrides = a.overrides if a.overrides is not None else ["model.vocab_size=8192"]
    peak = a.peak_flops or load_config(f"{a.scale}/t-loopformer").logging.peak_flops
    variants = list(VARIANTS) if a.variants == "all" else a.variants.split(",")
    common = {"scale": a.scale, "device": a.device, "bf16": a.bf16, "batch": a.batch, "overrides": overrides,
              "warmup": a.warmup, "threads": a.threads, "router": a.router}
    specs = {v: {**common, "variant": v, "extra": []} for v in variants}
    ablations = {"t-loopformer gs=off": ("t-loopformer", ["model.gather_scatter=false"]),
                 "t-loopformer ckpt=loop": ("t-loopformer", ["train.activation_checkpointing=loop"]),
                 "t-loopformer ckpt=layer": ("t-loopformer", ["train.activation_checkpointing=layer"]),
                 "loopformer ckpt=loop": ("loopformer", ["train.activation_checkpointing=loop"])}
    for label, (v, extra) in ablations.items():
        if v in variants:
            specs[label] = {**common, "variant": v, "extra": extra}
    results = run_cases(_worker, specs, a.steps)
    for r in results.values():
        r["tokens_per_s"] = r["tokens_per_step"] / r["time_s"]
        r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / peak

    cfg = load_config(f"{a.scale}/t-loopformer", overrides)
    m = cfg.model
    print(f"\ntrain_step: one optimizer step (DeepSpeed ZeRO-0, AdamW), micro-batch {a.batch} x T={m.block_size}, "
          f"d={m.d_model}, J={m.n_layers} L={m.loops}, vocab {m.vocab_size}, on {a.device}"
          f"{' bf16' if a.bf16 else ' fp32'}, {a.threads} threads, router {a.router}")
    ref = results.get("t-loopformer", next(iter(results.values())))
    print(f"{'case':<26} {'ms/step':>9} {'tok/s':>9} {'x t-loopf':>9} {'peak GB':>8} {'depth':>6} {'MFU %':>7}")
    for label, r in results.items():
        print(f"{label:<26} {r['time_s'] * 1e3:9.1f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / ref['tokens_per_s']:9.2f} "
              f"{r['peak_mem_gb']:8.3f} {r['mean_depth']:6.2f} {100 * r['mfu']:7.3f}")

    def ratio(a_, b_, key):
        return results[a_][key] / results[b_][key] if a_ in results and b_ in results and results[b_][key] else None

    summary = {
        "t-loopformer/loopformer tokens_per_s": ratio("t-loopformer", "loopformer", "tokens_per_s"),
        "t-loopformer/loopformer peak_mem": ratio("t-loopformer", "loopformer", "peak_mem_gb"),
        "gather_scatter on/off tokens_per_s": ratio("t-loopformer", "t-loopformer gs=off", "tokens_per_s"),
        "gather_scatter on/off peak_mem": ratio("t-loopformer", "t-loopformer gs=off", "peak_mem_gb"),
        "ckpt loop/none peak_mem (t-loopformer)": ratio("t-loopformer ckpt=loop", "t-loopformer", "peak_mem_gb"),
        "ckpt loop/none tokens_per_s (t-loopformer)": ratio("t-loopformer ckpt=loop", "t-loopformer", "tokens_per_s"),
        "ckpt layer/none peak_mem (t-loopformer)": ratio("t-loopformer ckpt=layer", "t-loopformer", "peak_mem_gb"),
        "ckpt loop/none peak_mem (loopformer)": ratio("loopformer ckpt=loop", "loopformer", "peak_mem_gb"),
    }
    print()
    for k, v in summary.items():
        if v is not None:
            print(f"{k:<44} {v:6.2f}")
    out = {"settings": {**common, "steps": a.steps, "peak_flops": peak}, "results": results, "summary": summary}
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
