"""Perplexity on validation shards at a loop budget M, with the per-token depth histogram.

Protocol. The split's shards are read as one token stream (documents separated by EOT, as written by
prep-data); the first `max_tokens + 1` tokens are used (all when 0). Every token after the first is a target
exactly once:
  * non-overlapping (stride = 0 or = context): windows [s, s + T) at s = 0, T, 2T, ...; each window predicts
    its T next tokens, so a target sees between 0 and T - 1 tokens of context (the nanoGPT/llm.c val loss);
  * sliding (0 < stride < T): windows start every `stride` tokens and score only the targets the previous
    window did not, so after the first window every target sees at least T - stride tokens of context.
Token-level mean NLL = sum of -log p(target) / number of targets; ppl = exp(mean NLL). Windows cross
document boundaries (EOT is an ordinary token here). The depth of a target is the depth the router gave the
token that predicts it (non-router variants: M for all); per-depth ppl is exp(mean NLL) over those targets.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.shards import ShardSet
from evaluation.forward import hidden_states, nll_at


@dataclass
class Windows:
    """Window starts, lengths and the first scored input position within each window."""

    starts: list[int]
    lengths: list[int]
    first_scored: list[int]


def make_windows(n_tokens: int, context: int, stride: int = 0) -> Windows:
    """Windows over a stream of n_tokens (n_tokens - 1 targets); see the module doc."""
    T = int(context)
    S = T if stride <= 0 or stride >= T else int(stride)
    n_inputs = n_tokens - 1  # input positions 0..n_tokens-2 each predict the next token
    w = Windows([], [], [])
    s, covered = 0, 0
    while covered < n_inputs:
        e = min(s + T, n_inputs)
        w.starts.append(s)
        w.lengths.append(e - s)
        w.first_scored.append(covered - s)
        covered = e
        s += S
    return w


def set_name(directory: str | Path) -> str:
    """The set's name: the manifest's `source`/`name` when recorded, else the directory name."""
    d = Path(directory)
    m = d / "manifest.json"
    if m.is_file():
        try:
            meta = json.loads(m.read_text())
            for k in ("name", "source", "dataset"):
                v = meta.get(k)
                if isinstance(v, str) and v:
                    return v
                if isinstance(v, dict) and isinstance(v.get("name"), str):
                    return v["name"]
        except (json.JSONDecodeError, AttributeError):
            pass
    return d.name


class TokenStream:
    """The first `max_tokens + 1` tokens of a split (memory-mapped shards, read per window), opened once and
    reused for every budget."""

    def __init__(self, directory: str | Path, split: str = "val", max_tokens: int = 0):
        self.dir = Path(directory)
        self.split = split
        self.shards = ShardSet(directory, split)
        n = self.shards.num_tokens if max_tokens <= 0 else min(self.shards.num_tokens, max_tokens + 1)
        if n < 2:
            raise ValueError(f"{self.dir} '{split}': {self.shards.num_tokens} tokens; perplexity needs at least 2")
        self.num_tokens = n
        self.name = set_name(directory)

    def read(self, start: int, n: int) -> torch.Tensor:
        return torch.from_numpy(self.shards.read(start, n).astype(np.int64))


@torch.no_grad()
def perplexity(
    model,
    stream: TokenStream,
    loops: int,
    context: int = 0,
    stride: int = 0,
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    router: bool = True,
    threshold: float | None = None,
    progress=None,
) -> dict:
    """Mean NLL, ppl, tokens counted and the depth statistics of `stream` at budget `loops` (router and
    threshold: the ablations' switches, as `LoopedLM.forward` takes them; progress(n): called after each batch
    with its number of windows)."""
    T = min(context or model.cfg.block_size, model.cfg.block_size)
    M = int(loops)
    win = make_windows(stream.num_tokens, T, stride)
    nll_sum = 0.0
    count = 0
    d_nll = np.zeros(M + 1)
    d_cnt = np.zeros(M + 1, dtype=np.int64)
    order = range(len(win.starts))
    for b0 in range(0, len(win.starts), batch_size):
        ids = list(order[b0 : b0 + batch_size])
        L = max(win.lengths[i] for i in ids)
        idx = torch.zeros(len(ids), L, dtype=torch.long)
        rows, pos, tgt = [], [], []
        for r, i in enumerate(ids):
            s, ln, f = win.starts[i], win.lengths[i], win.first_scored[i]
            toks = stream.read(s, ln + 1)
            idx[r, :ln] = toks[:ln]
            rows += [r] * (ln - f)
            pos += range(f, ln)
            tgt.append(toks[1 + f :])
        h, depth = hidden_states(model, idx.to(device), M, router=router, threshold=threshold)
        rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
        nll = nll_at(model, h[rows_t, pos_t], torch.cat(tgt).to(h.device)).double().cpu().numpy()  # (P,)
        dep = depth[rows_t, pos_t].cpu().numpy()
        nll_sum += float(nll.sum())
        count += nll.size
        np.add.at(d_nll, dep, nll)
        np.add.at(d_cnt, dep, 1)
        if progress:
            progress(len(ids))
    mean = nll_sum / count
    share = (d_cnt[1:] / count).tolist()
    per_depth_ppl = [float(math.exp(d_nll[d] / d_cnt[d])) if d_cnt[d] else None for d in range(1, M + 1)]
    return {
        "set": stream.name,
        "dir": str(stream.dir),
        "split": stream.split,
        "loops": M,
        "context": T,
        "stride": T if stride <= 0 or stride >= T else int(stride),
        "protocol": "non-overlapping" if stride <= 0 or stride >= T else "sliding",
        "tokens": int(count),
        "mean_nll": float(mean),
        "ppl": float(math.exp(mean)),
        "depth": {
            "share": share,
            "counts": d_cnt[1:].tolist(),
            "mean": float((np.arange(1, M + 1) * d_cnt[1:]).sum() / count),
            "ppl": per_depth_ppl,
        },
    }
