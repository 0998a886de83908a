"""TTFT and TPOT of a checkpoint at a loop budget, with the inference benchmark's own code and protocol.

`pipeline.inference.timing` (the code behind `bench/decode.py`) gives `ttft()` (one prompt through the
gather-scatter prefill to its first logits) and `tpot()` (mean seconds per decode step with the
recursion-wise KV cache after an untimed prefill). We run them on the checkpoint's model: one warm-up round,
then the median of `repeats`, random prompts (seeded) of lengths that fit the model's context.
"""

from __future__ import annotations

import statistics
import time

import torch

from data_prep.tokenizer import GPT2_VOCAB
from pipeline.inference import timing


def prompt_lengths(block_size: int, steps: int) -> list[int]:
    """The benchmark's TTFT lengths (128, 512, 1024, 2048) that fit; else half the context."""
    fit = [p for p in (128, 512, 1024, 2048) if p + steps <= block_size]
    return fit or [max(1, (block_size - steps) // 2)]


def _inputs(model, device, steps: int, batches: tuple[int, ...], seed: int) -> tuple[int, int, dict, dict]:
    """(decode steps, TPOT prompt length, TTFT prompts by length P, (prompts, feed) by batch size B): the random
    inputs of the protocol, fitted to the model's context."""
    dev = torch.device(device)
    T = model.cfg.block_size
    steps = max(1, min(steps, T // 4))
    tpot_prompt = min(128, T - steps - 1)
    vocab = min(model.cfg.vocab_size, GPT2_VOCAB)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randint(0, vocab, s, generator=g).to(dev)
    ttft_in = {P: rand(1, P) for P in prompt_lengths(T, steps)}
    tpot_in = {B: (rand(B, tpot_prompt), rand(B, steps)) for B in batches}
    return steps, tpot_prompt, ttft_in, tpot_in


@torch.no_grad()
def measure_latency(
    model,
    loops: int,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    steps: int = 16,
    batches: tuple[int, ...] = (1, 32),
    seed: int = 1,
) -> dict:
    """{"ttft_ms": {P: ms}, "tpot_ms": {B: ms}, ...} at budget `loops` (medians over `repeats`)."""
    steps, tpot_prompt, ttft_in, tpot_in = _inputs(model, device, steps, batches, seed)
    tt = {P: [] for P in ttft_in}
    tp = {B: [] for B in batches}
    depth_sum, depth_n = 0.0, 0
    for r in range(repeats + 1):  # round 0 warms up
        for P, prompt in ttft_in.items():
            sec, _ = timing.ttft(model, loops, prompt)
            if r:
                tt[P].append(sec)
        for B in batches:
            sec, depth, _mem = timing.tpot(model, loops, tpot_in[B][0], tpot_in[B][1])
            if r:
                tp[B].append(sec)
                depth_sum += float(depth.float().sum())
                depth_n += depth.numel()
    return {
        "ttft_ms": {str(P): 1e3 * statistics.median(v) for P, v in tt.items()},
        "tpot_ms": {str(B): 1e3 * statistics.median(v) for B, v in tp.items()},
        "decode_mean_depth": depth_sum / max(depth_n, 1),
        "protocol": f"pipeline.inference.timing ttft()/tpot() (bench/decode.py's code): median of {repeats} after 1 warm-up; TPOT after a "
        f"{tpot_prompt}-token prefill, {steps} decode steps; random prompts (seed {seed})",
    }


@torch.no_grad()
def latency_seconds(
    model,
    loops: int,
    device: str | torch.device = "cpu",
    repeats: int = 3,
    steps: int = 16,
    batches: tuple[int, ...] = (1, 32),
    seed: int = 1,
    sampled: int = 2,
) -> float:
    """About how long `measure_latency` takes at budget `loops`, from a sample of its own work: each TTFT prompt
    once, and for each batch size its prefill and `sampled` decode steps (the other steps at the sampled steps'
    rate), times the repeats + 1 rounds it runs."""
    steps, _, ttft_in, tpot_in = _inputs(model, device, steps, batches, seed)
    one = sum(timing.ttft(model, loops, prompt)[0] for prompt in ttft_in.values())
    n = min(sampled, steps)
    for prompts, feed in tpot_in.values():
        t0 = time.perf_counter()
        per_step, _, _ = timing.tpot(model, loops, prompts, feed[:, :n])
        whole = time.perf_counter() - t0
        one += max(whole - n * per_step, 0.0) + steps * per_step  # the untimed prefill, then every step
    return (repeats + 1) * one
