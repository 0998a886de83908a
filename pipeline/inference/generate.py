"""`generate(model, prompts, ...)`: batched sampling with the recursion-wise KV cache (the API evaluation uses).

Depth reported per generated token = the loops run by the position whose logits produced it (the
previous token's router depth, or the last prompt token's for the first generated token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pipeline.inference.decode import Decoder

# What `tlf generate` and an HF export's generation_config.json sample with unless told otherwise: a small model's
# whole-vocabulary sample reads as word salad, its 50 most likely tokens' like its corpus (docs/inference.md)
SAMPLING = {"temperature": 1.0, "top_k": 50}


@dataclass
class Generation:
    tokens: list[list[int]]  # generated tokens per row (the stop token included when hit)
    depths: list[list[int]]  # loops that produced each generated token
    prompt_depths: list[list[int]]  # router depth of every prompt token
    cache: dict = field(default_factory=dict)  # RecursionKVCache.memory() at the end


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> tokens (B,). temperature 0 = greedy; top_k 0 and top_p 1 disable those filters."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = logits.sort(dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= top_p  # tokens after the nucleus (the first token always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def check_lengths(lengths: list[int], max_new_tokens: int, block_size: int) -> None:
    """ValueError unless every prompt plus max_new_tokens - 1 fits the context (the last token is not fed back)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    longest = max(lengths)
    if longest + max_new_tokens - 1 > block_size:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context "
            f"model.block_size={block_size}"
        )


@torch.no_grad()
def generate(
    model,
    prompts,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    loops: int | None = None,
    threshold: float | None = None,
    stop_token: int | None = None,
    vocab_limit: int | None = None,
    callback: Callable[[int, list, list], None] | None = None,
    decoder: Decoder | None = None,
    router: bool = True,
) -> Generation:
    """Generates up to max_new_tokens per prompt (list of token-id lists, any lengths).

    loops: budget M <= L (default L; schedule uniform 1/M, router depth clipped at M); threshold: router
    theta (default the config's); router=False: every token runs the whole budget. stop_token: a row that samples it stops (no further compute).
    vocab_limit: sample only ids < vocab_limit (e.g. 50257 to skip the padded vocabulary).
    callback(step, tokens, depths): called after every sampled step with per-row lists (None for rows
    that had already stopped): the streaming hook. seed: makes sampling reproducible."""
    check_lengths([len(p) for p in prompts], max_new_tokens, model.cfg.block_size)
    was_training = model.training
    model.eval()
    dec = decoder or Decoder(model, loops=loops, threshold=threshold, router=router)
    dev = model.wte.weight.device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev).manual_seed(seed)
    logits, pdepth = dec.prefill(prompts, reserve=max_new_tokens)
    B = logits.shape[0]
    lengths = np.array([len(p) for p in prompts])
    pd = pdepth.cpu().numpy()
    depth = pd[np.arange(B), lengths - 1]  # (B,) depth of the position that produced the next token
    live = np.ones(B, dtype=bool)
    out_t: list[list[int]] = [[] for _ in range(B)]
    out_d: list[list[int]] = [[] for _ in range(B)]
    for s in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        tok = sample(logits, temperature, top_k, top_p, gen)  # (B,)
        th = tok.cpu().numpy()
        step_t, step_d = [None] * B, [None] * B
        for b in np.flatnonzero(live):  # bookkeeping of Python lists (the results), not model compute
            out_t[b].append(int(th[b]))
            out_d[b].append(int(depth[b]))
            step_t[b], step_d[b] = int(th[b]), int(depth[b])
        if callback is not None:
            callback(s, step_t, step_d)
        if stop_token is not None:
            live &= th != stop_token
        if s == max_new_tokens - 1 or not live.any():
            break
        logits, d = dec.step(tok, live)
        depth = d.cpu().numpy()
    if was_training:
        model.train()
    return Generation(out_t, out_d, [pd[b, : lengths[b]].tolist() for b in range(B)], dec.cache.memory())
