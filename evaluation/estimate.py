"""What an evaluation will cost, said before it starts (`tlf eval`'s first lines): the examples and perplexity
windows times the budgets, and a time from a short measured sample of the work itself.

The sample is the scorer's own path at the largest budget on the first eval.batch_size examples of the task with
the most tokens to read (one forward's worth of rows, after one request alone to warm up); without tasks, one
forward of min(block_size, 256) tokens (a perplexity window's work). The time per budget M is the tokens the
evaluation reads (every request's context and continuation, the perplexity windows) at the sample's rate, scaled
by M / the sampled budget: loops dominate a forward's work. With eval.latency the latency protocol's own time is
added, from a sample of its work at the largest budget (`latency.latency_seconds`: each prefill once and two decode
steps per batch size), scaled the same way. Tasks whose requests share context differently take another time per
token: a rough figure, not a promise.
"""

from __future__ import annotations

import time

import torch

from evaluation.latency import latency_seconds
from evaluation.scorer import Scorer
from pipeline.train.logger import fmt_duration

PPL_SAMPLE_TOKENS = 256


def request_tokens(reqs, block_size: int) -> int:
    """Tokens the model reads for these requests (each left-truncated to block_size)."""
    return sum(min(len(c) + len(x) - 1, block_size) for c, x in reqs)


def tokens_per_budget(inp, block_size: int) -> int:
    """Tokens the model reads at one budget: every task request and every perplexity window."""
    return sum(request_tokens(reqs, block_size) for reqs, _ in inp.requests.values()) + sum(
        n * block_size for n in inp.windows
    )


def _timed(f, device) -> float:
    t0 = time.perf_counter()
    f()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return max(time.perf_counter() - t0, 1e-9)


@torch.inference_mode()
def tokens_per_second(model, inp, loops: int, device: str, batch_size: int) -> float:
    """Tokens per second of a sample of the evaluation's own work at budget `loops` (see the module doc)."""
    T = model.cfg.block_size
    sizes = {n: request_tokens(reqs, T) for n, (reqs, _) in inp.requests.items() if reqs}
    name = max(sizes, key=sizes.get, default=None)  # the task with the most work stands for the rest
    if name is None:
        idx = torch.zeros(1, min(T, PPL_SAMPLE_TOKENS), dtype=torch.long, device=device)
        _timed(lambda: model(idx, loops=loops), device)  # warm-up: allocations, kernel selection
        return idx.numel() / _timed(lambda: model(idx, loops=loops), device)
    reqs = inp.requests[name][0]
    sample = reqs[: max(1, round(batch_size * len(reqs) / max(len(inp.tasks[name].examples), 1)))]
    scorer = Scorer(model, batch_size, device)
    _timed(lambda: scorer.score(sample[:1], loops), device)  # warm-up
    return request_tokens(sample, T) / _timed(lambda: scorer.score(sample, loops), device)


def estimate_line(model, cfg, inp, budgets: list[tuple[int, int]], device: str) -> str:
    """One line: the work (examples and windows x budgets), the time it should take, how to cut it ("" when
    there are neither task examples nor perplexity windows)."""
    examples = sum(len(td.examples) for td in inp.tasks.values())
    tokens = tokens_per_budget(inp, cfg.model.block_size)
    if not tokens:
        return ""
    effective = sorted({m for _, m in budgets})
    top = effective[-1]
    rate = tokens_per_second(model, inp, top, device, cfg.eval.batch_size)
    seconds = sum(tokens * m / top for m in effective) / rate
    latency = sum(m / top for m in effective) * latency_seconds(model, top, device) if cfg.eval.latency else 0.0
    return (
        f"eval: {examples:,} examples ({len(inp.tasks)} tasks) + {sum(inp.windows):,} perplexity windows x "
        f"{len(effective)} budgets {[m for m, _ in budgets]} on {device}: about {fmt_duration(seconds + latency)} "
        f"({tokens:,} tokens per budget at {rate:,.0f} tokens/s, measured at M={top}"
        + (f"; latency {fmt_duration(latency)} of it" if cfg.eval.latency else "")
        + "). To cut it: --limit N (eval.limit: examples per task), --tasks a,b, --loops M, --no-ppl"
        + (", --no-latency" if cfg.eval.latency else "")
    )
