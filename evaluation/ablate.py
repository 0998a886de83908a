"""`tlf ablate CHECKPOINT`: the paper's ablations (Figures 3 and 4) for one checkpoint, each a PNG plus
the numbers behind it (`ablate.json`).

- router on/off x recursion-wise cache on/off: validation perplexity and TPOT (batch 1). Router off gives
  every token depth M (with the same weights this is exactly loopformer, docs/design.md §1); cache off recomputes
  the whole sequence for every new token.
- gather-scatter on/off: peak memory of one training step (forward + backward of the full objective, each
  mode in a fresh process: `pipeline.memory`, CUDA max allocated or the peak-RSS growth on CPU) and the prefill latency of a
  full-context forward (the dense path computes every token in every loop, masked).
- router threshold sweep: perplexity and mean depth against theta (the U-curve of Figure 3).
- TTFT against prompt length (128/512/1024/2048, those that fit the context), router on and off.

All timings use `pipeline.inference.timing`, the code of `bench/decode.py` and `tlf eval`.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import click

from evaluation.figures import pyplot, save
import torch

from pipeline.inference import timing
from data_prep.clitypes import CommaList, Device, Finite
from data_prep.files import check_writable, write_json
from data_prep.tokenizer import GPT2_VOCAB
from evaluation.cli import PPL_TOKENS
from pipeline.cliopts import check_loops, stored_config
from pipeline.device import DEVICE_HELP, resolve_device
from pipeline.memory import region_peak_mib, region_start
from pipeline.model.io import find_export, load_model

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PROMPT_LENS = (128, 512, 1024, 2048)


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def _step_memory_worker(export: str, execution: str, batch: int, seq: int, q) -> None:
    torch.manual_seed(0)
    model, cfg = load_model(export, resolve_device("auto"))
    model.train()
    dev = model.wte.weight.device
    idx = torch.randint(0, min(cfg.model.vocab_size, GPT2_VOCAB), (batch, seq), device=dev)
    base = region_start(dev)
    from pipeline.train.objective import Objective

    Objective(model, cfg.objective)(idx, idx, execution=execution).loss.backward()
    q.put(region_peak_mib(dev, base))


def step_memory_mb(export: str, execution: str, batch: int, seq: int) -> float:
    """Peak memory (MiB) of one training step of the export's model, measured in a fresh process."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_step_memory_worker, args=(export, execution, batch, seq, q))
    p.start()
    val = q.get()
    p.join()
    return float(val)


@dataclass
class _Ablation:
    """What every measurement of `run` shares: the model at budget M, its export, the validation stream, the
    generator drawing the random prompts (in a fixed order), the timing repeats and the log."""

    model: torch.nn.Module
    export: str
    M: int
    stream: object
    g: torch.Generator
    vocab: int
    repeats: int
    log: object

    @property
    def dev(self):
        return self.model.wte.weight.device

    @property
    def T(self) -> int:
        return self.model.cfg.block_size

    @property
    def routers(self) -> tuple[bool, ...]:
        return (True, False) if self.model.router is not None else (False,)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, n), generator=self.g).to(self.dev)


def run(
    checkpoint: str,
    out: str | Path,
    loops: int = 0,
    ppl_dir: str = "",
    ppl_tokens: int = 8192,
    thresholds=THRESHOLDS,
    prompt_lens=PROMPT_LENS,
    tpot_steps: int = 16,
    repeats: int = 3,
    train_batch: int = 2,
    device: str = "cpu",
    log=print,
) -> dict:
    from evaluation.perplexity import TokenStream

    export = str(find_export(checkpoint))
    model, cfg = load_model(export, device)
    outd = Path(out)
    outd.mkdir(parents=True, exist_ok=True)
    stream = TokenStream(ppl_dir or cfg.data.sources()[0], cfg.data.val_split, ppl_tokens, cfg.model.vocab_size)
    vocab = min(cfg.model.vocab_size, GPT2_VOCAB)
    a = _Ablation(
        model, export, loops or cfg.model.loops, stream, torch.Generator().manual_seed(0), vocab, repeats, log
    )
    res: dict = {
        "checkpoint": export,
        "variant": cfg.model.variant,
        "loops": a.M,
        "ppl_set": stream.name,
        "ppl_tokens": stream.num_tokens - 1,
        "device": str(a.dev),
    }
    res["router_cache"] = _router_cache(a, tpot_steps)
    res["execution"] = _execution(a, train_batch)
    res["threshold_sweep"] = _threshold_sweep(a, thresholds)
    res["ttft_ms"] = _ttft(a, prompt_lens)
    res["figures"] = [str(p) for p in _plot(res, outd)]
    write_json(outd / "ablate.json", res)
    log(f"wrote {outd / 'ablate.json'} and {len(res['figures'])} figures")
    return res


def _router_cache(a: _Ablation, tpot_steps: int) -> dict:
    """Router on/off x recursion-wise cache on/off: validation perplexity and mean depth, TPOT at batch 1."""
    from evaluation.perplexity import perplexity

    tp_prompt = a.tokens(min(128, a.T // 2))
    tp_feed = a.tokens(min(tpot_steps, a.T - tp_prompt.shape[1] - 1))
    rc = {}
    for router in a.routers:
        ppl = perplexity(a.model, a.stream, a.M, device=a.dev, router=router)
        for cache in (True, False):
            sec = _median_time(
                lambda: timing.tpot(a.model, a.M, tp_prompt, tp_feed, cache=cache, router=router)[0],  # noqa: B023
                a.repeats,
            )  # (the lambda runs within this iteration)
            rc[f"router_{'on' if router else 'off'}/cache_{'on' if cache else 'off'}"] = {
                "ppl": ppl["ppl"],
                "mean_depth": ppl["depth"]["mean"],
                "tpot_ms": 1e3 * sec,
            }
    a.log("router x cache: " + "; ".join(f"{k}: ppl {v['ppl']:.2f}, TPOT {v['tpot_ms']:.2f} ms" for k, v in rc.items()))
    return rc


def _execution(a: _Ablation, train_batch: int) -> dict:
    """Gather-scatter on and off (model.execution compact and dense): a training step's peak memory (fresh process
    each) and full-context prefill time."""
    gs = {}
    prompt = a.tokens(a.T)
    for ex in ("compact", "dense"):
        sec = _median_time(lambda: _timed_forward(a.model, prompt, a.M, ex), a.repeats)  # noqa: B023  (runs in this iteration)
        mem = step_memory_mb(a.export, ex, train_batch, a.T)
        gs[ex] = {"train_step_peak_mb": mem, "prefill_ms": 1e3 * sec}
    a.log(
        "execution: "
        + "; ".join(
            f"{k}: step memory {v['train_step_peak_mb']:.0f} MB, prefill {v['prefill_ms']:.1f} ms"
            for k, v in gs.items()
        )
    )
    return gs


def _threshold_sweep(a: _Ablation, thresholds) -> list[dict]:
    """Perplexity and mean depth against the router threshold theta (none without a router)."""
    from evaluation.perplexity import perplexity

    if a.model.router is None:
        return []
    sweep = []
    for th in thresholds:
        p = perplexity(a.model, a.stream, a.M, device=a.dev, threshold=th)
        sweep.append({"theta": th, "ppl": p["ppl"], "mean_depth": p["depth"]["mean"]})
    a.log(
        "threshold sweep: "
        + ", ".join(f"θ={s['theta']}: ppl {s['ppl']:.2f} depth {s['mean_depth']:.2f}" for s in sweep)
    )
    return sweep


def _ttft(a: _Ablation, prompt_lens) -> dict:
    """TTFT against prompt length (those that fit the context), router on and off."""
    lens = [P for P in prompt_lens if P <= a.T] or [a.T]
    tt = {}
    for router in a.routers:
        row = {}
        for P in lens:
            pr = a.tokens(P)
            row[str(P)] = 1e3 * _median_time(lambda: timing.ttft(a.model, a.M, pr, router=router)[0], a.repeats)  # noqa: B023  (runs now)
        tt[f"router_{'on' if router else 'off'}"] = row
    a.log(
        "TTFT: " + "; ".join(f"{k}: " + ", ".join(f"P={p} {v:.1f} ms" for p, v in row.items()) for k, row in tt.items())
    )
    return tt


@torch.no_grad()
def _timed_forward(model, idx, M, execution: str) -> float:
    if idx.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    model(idx, loops=M, execution=execution).logits[:, -1].argmax(-1).cpu()
    return time.perf_counter() - t


def _plot(res: dict, out: Path) -> list[Path]:
    plt = pyplot()

    paths = []
    rc = res["router_cache"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    routers = sorted({k.split("/")[0] for k in rc})
    axes[0].bar(routers, [rc[f"{r}/cache_on"]["ppl"] for r in routers], color=["C0", "C1"][: len(routers)])
    axes[0].set_ylabel("validation perplexity"), axes[0].set_title(f"router on/off ({res['ppl_set']})")
    labels = list(rc)
    axes[1].bar([k.replace("/", "\n") for k in labels], [rc[k]["tpot_ms"] for k in labels])
    axes[1].set_ylabel("TPOT (ms, batch 1)"), axes[1].set_title("router x recursion-wise cache")
    paths.append(save(fig, out / "fig3_router_cache.png"))

    gs = res["execution"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    axes[0].bar(list(gs), [gs[k]["train_step_peak_mb"] for k in gs])
    axes[0].set_ylabel("peak memory of a training step (MB)"), axes[0].set_title("compact vs dense: memory")
    axes[1].bar(list(gs), [gs[k]["prefill_ms"] for k in gs])
    axes[1].set_ylabel("full-context prefill (ms)"), axes[1].set_title("compact vs dense: latency")
    paths.append(save(fig, out / "fig4_gather_scatter.png"))

    if res["threshold_sweep"]:
        sw = res["threshold_sweep"]
        fig, ax = plt.subplots(figsize=(6, 4))
        th = [s["theta"] for s in sw]
        ax.plot(th, [s["ppl"] for s in sw], "o-", color="C0")
        ax.set_xlabel("router threshold θ"), ax.set_ylabel("perplexity", color="C0")
        ax2 = ax.twinx()
        ax2.plot(th, [s["mean_depth"] for s in sw], "s--", color="C1")
        ax2.set_ylabel("mean depth", color="C1")
        ax.set_title("threshold sweep")
        paths.append(save(fig, out / "fig3_threshold.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, row in res["ttft_ms"].items():
        ax.plot([int(p) for p in row], list(row.values()), "o-", label=k)
    ax.set_xlabel("prompt length"), ax.set_ylabel("TTFT (ms)"), ax.set_title("TTFT vs prompt length")
    ax.legend(), ax.grid(alpha=0.3)
    paths.append(save(fig, out / "fig4_ttft.png"))
    return paths


@click.command("ablate")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output directory (default out/ablate/<checkpoint name>).",
)
@click.option(
    "--loops", type=click.IntRange(min=1), default=None, help="Loop budget M in 1..L (default: the training L)."
)
@click.option(
    "--ppl-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Validation shard directory (default: the checkpoint's data.dir).",
)
@click.option(
    "--ppl-tokens",
    type=PPL_TOKENS,
    default=8192,
    show_default=True,
    help="Validation tokens scored per setting (0: all; else at least 2, so a perplexity averages over more than "
    "one prediction).",
)
@click.option(
    "--thresholds",
    type=CommaList(Finite(0, 1, min_open=True, max_open=True), "threshold {}", "0.3,0.5"),
    metavar="θ1,θ2,...",
    default=",".join(map(str, THRESHOLDS)),
    show_default=True,
    help="Router thresholds θ, each in (0, 1), distinct.",
)
@click.option(
    "--prompt-lens",
    type=CommaList(click.IntRange(min=1), "prompt length {}", "128,512"),
    metavar="P1,P2,...",
    default=",".join(map(str, PROMPT_LENS)),
    show_default=True,
    help="TTFT prompt lengths, each >= 1, distinct (those longer than the context are left out).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed repeats (median) after a warm-up.",
)
@click.option(
    "--tpot-steps",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Decode steps timed per TPOT measurement.",
)
@click.option("--device", type=Device(), default="auto", show_default=True, help=DEVICE_HELP)
def ablate(checkpoint, out, loops, ppl_dir, ppl_tokens, thresholds, prompt_lens, repeats, tpot_steps, device):
    """The paper's ablations (Figures 3 and 4) for CHECKPOINT: PNGs plus the numbers in ablate.json."""
    name = Path(checkpoint).resolve().name
    out = out or f"out/ablate/{name}"
    check_writable(out, "--out")  # before the model is loaded and measured
    try:
        export, cfg = stored_config(find_export(checkpoint))  # not the weights: a bad --loops is said first
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    check_loops([loops] if loops else [], cfg)
    run(
        str(export),
        out,
        loops or 0,
        ppl_dir or "",
        ppl_tokens,
        thresholds,
        prompt_lens,
        tpot_steps=tpot_steps,
        repeats=repeats,
        device=resolve_device(device, "--device", indexed=True),
        log=click.echo,
    )
