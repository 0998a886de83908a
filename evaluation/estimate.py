"""What an evaluation will cost, said before it starts (`tlf eval`'s first lines): the examples and perplexity
windows times the budgets, and a time from one short timed forward of the model on the evaluation device.

The forward runs min(block_size, 128) tokens at the largest budget (batch 1 on a CPU, eval.batch_size rows on a
GPU, which is idle at batch 1), once to warm up and twice timed (the faster counts). The time per budget M is the tokens the scorer
reads (every request's context and continuation, the perplexity windows) at that rate, scaled by M / the timed
budget: loops dominate a forward's work. Shared contexts (tree packing) make the scorer read fewer tokens than
counted, and latency (eval.latency) is not counted, so it is a rough figure, not a promise.
"""

from __future__ import annotations

import time

import torch

from pipeline.train.logger import fmt_duration

WARMUP_TOKENS = 128


def tokens_per_budget(inp, block_size: int) -> int:
    """Tokens the model reads at one budget: each task request (left-truncated to block_size) and each
    perplexity window (block_size at most)."""
    tasks = sum(min(len(c) + len(x) - 1, block_size) for reqs, _ in inp.requests.values() for c, x in reqs)
    return tasks + sum(n * block_size for n in inp.windows)


@torch.inference_mode()
def tokens_per_second(model, loops: int, device: str, batch_size: int) -> float:
    """Tokens per second of one forward of min(block_size, WARMUP_TOKENS) tokens at budget `loops`."""
    rows = batch_size if str(device).startswith("cuda") else 1
    idx = torch.zeros(rows, min(model.cfg.block_size, WARMUP_TOKENS), dtype=torch.long, device=device)
    times = []
    for _ in range(3):  # the first warms up (allocations, kernel selection); the faster of the other two counts
        t0 = time.perf_counter()
        model(idx, loops=loops)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return idx.numel() / max(min(times[1:]), 1e-9)


def estimate_line(model, cfg, inp, budgets: list[tuple[int, int]], device: str) -> str:
    """One line: the work (examples and windows x budgets), the time it should take, how to cut it ("" when
    there are neither task examples nor perplexity windows)."""
    examples = sum(len(td.examples) for td in inp.tasks.values())
    tokens = tokens_per_budget(inp, cfg.model.block_size)
    if not tokens:
        return ""
    effective = sorted({m for _, m in budgets})
    top = effective[-1]
    rate = tokens_per_second(model, top, device, cfg.eval.batch_size)
    seconds = sum(tokens * m / top for m in effective) / rate
    return (
        f"eval: {examples:,} examples ({len(inp.tasks)} tasks) + {sum(inp.windows):,} perplexity windows x "
        f"{len(effective)} budgets {[m for m, _ in budgets]} on {device}: about {fmt_duration(seconds)} "
        f"({tokens:,} tokens per budget at {rate:,.0f} tokens/s, measured at M={top}"
        f"{'; latency not counted' if cfg.eval.latency else ''}). To cut it: --limit N (eval.limit: examples per "
        "task), --tasks a,b, --loops M, --no-ppl"
    )
