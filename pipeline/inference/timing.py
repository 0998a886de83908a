"""TTFT and TPOT measurement, shared by `bench/decode.py`, `tlf eval` (latency) and `tlf ablate`.

    ttft(model, M, prompt)          seconds from a prompt (1, P) to its first-token logits (gather-scatter
                                    prefill filling the recursion-wise cache), and the prompt's depths
    tpot(model, M, prompts, feed)   mean seconds per decode step while feeding `feed` (B, n) after an untimed
                                    prefill of `prompts` (B, P); the per-step depths and the cache memory

`cache=False` recomputes the whole sequence for every new token (ablation (a)); `full_depth=True` makes every
token write every loop's cache (ablation (b)). `clock` is time.perf_counter by default (time.process_time
measures this process's CPU time, steadier on a loaded machine). CUDA is synchronised around each timing.
"""

from __future__ import annotations

import time

import torch

from pipeline.inference.decode import Decoder


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def ttft(
    model,
    M: int,
    prompt: torch.Tensor,
    cache: bool = True,
    full_depth: bool = False,
    clock=time.perf_counter,
    router: bool = True,
) -> tuple[float, torch.Tensor]:
    dec = Decoder(model, loops=M, full_depth=full_depth, router=router)
    _sync(prompt.device)
    t = clock()
    logits, depth = dec.prefill(prompt, use_cache=cache)
    logits.argmax(-1).cpu()
    return clock() - t, depth


@torch.no_grad()
def tpot(
    model,
    M: int,
    prompts: torch.Tensor,
    feed: torch.Tensor,
    cache: bool = True,
    full_depth: bool = False,
    clock=time.perf_counter,
    router: bool = True,
) -> tuple[float, torch.Tensor, dict | None]:
    dec = Decoder(model, loops=M, full_depth=full_depth, router=router)
    n = feed.shape[1]
    if not cache:
        seq = prompts
        _sync(prompts.device)
        t = clock()
        for s in range(n):
            seq = torch.cat([seq, feed[:, s : s + 1]], 1)
            logits, depth = dec.prefill(seq, use_cache=False)
            logits.argmax(-1).cpu()
        return (clock() - t) / n, depth[:, prompts.shape[1] :], None
    dec.prefill(prompts, reserve=n)
    depths = []
    _sync(prompts.device)
    t = clock()
    for s in range(n):
        logits, d = dec.step(feed[:, s])
        logits.argmax(-1).cpu()
        depths.append(d)
    return (clock() - t) / n, torch.stack(depths, 1), dec.cache.memory()
