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

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.files import FileFormatError, read_json
from data_prep.shards import ShardError, ShardSet
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
            meta = read_json(m, dict)
            for k in ("name", "source", "dataset"):
                v = meta.get(k)
                if isinstance(v, str) and v:
                    return v
                if isinstance(v, dict) and isinstance(v.get("name"), str):
                    return v["name"]
        except FileFormatError:  # damaged: ShardSet names the problem
            pass
    return d.name


class TokenStream:
    """The first `max_tokens + 1` tokens of a split (memory-mapped shards, read per window), opened once and
    reused for every budget."""

    def __init__(self, directory: str | Path, split: str = "val", max_tokens: int = 0, vocab_size: int = 0):
        """vocab_size: the model's; a token id at or past it (a text set given to a fold-task model) is a
        ShardError naming the set, before any window is scored."""
        self.dir = Path(directory)
        self.split = split
        self.shards = ShardSet(directory, split)
        n = self.shards.num_tokens if max_tokens <= 0 else min(self.shards.num_tokens, max_tokens + 1)
        if n < 2:
            raise ValueError(f"{self.dir} '{split}': {self.shards.num_tokens} tokens; perplexity needs at least 2")
        self.num_tokens = n
        self.name = set_name(directory)
        if vocab_size:
            self._check_ids(vocab_size)

    def _check_ids(self, vocab_size: int, chunk: int = 1 << 22) -> None:
        top = max(
            int(self.shards.read(s, min(chunk, self.num_tokens - s)).max()) for s in range(0, self.num_tokens, chunk)
        )
        if top >= vocab_size:
            raise ShardError(
                f"{self.dir} '{self.split}': token id {top} >= model.vocab_size ({vocab_size}): these shards were "
                "not made for this model (a text set given to a fold-task model?)"
            )

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
    if T < 1 or stride < 0:
        raise ValueError(f"perplexity windows need a context >= 1 and a stride >= 0, got {context} and {stride}")
    M = int(loops)
    win = make_windows(stream.num_tokens, T, stride)
    tally = DepthTally(M)
    order = range(len(win.starts))
    for b0 in range(0, len(win.starts), batch_size):
        ids = list(order[b0 : b0 + batch_size])
        idx, rows, pos, tgt = window_batch(stream, win, ids)
        h, depth = hidden_states(model, idx.to(device), M, router=router, threshold=threshold)
        rows_t, pos_t = torch.tensor(rows), torch.tensor(pos)
        nll = nll_at(model, h[rows_t, pos_t], torch.cat(tgt).to(h.device)).double().cpu().numpy()  # (P,)
        tally.add(nll, depth[rows_t, pos_t].cpu().numpy())
        if progress:
            progress(len(ids))
    return {
        "set": stream.name,
        "dir": str(stream.dir),
        "split": stream.split,
        "loops": M,
        "context": T,
        "stride": T if stride <= 0 or stride >= T else int(stride),
        "protocol": "non-overlapping" if stride <= 0 or stride >= T else "sliding",
        **tally.summary(),
    }


def window_batch(stream: TokenStream, win: Windows, ids: list[int]):
    """The inputs of windows `ids` (len(ids), L) int64, zero-padded to the longest (L), and each scored target:
    its row, its input position (the token that predicts it) and, per window, the targets (1-D tensors)."""
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
    return idx, rows, pos, tgt


class DepthTally:
    """Sums of the targets' NLL, overall and by the depth (0..M) the router gave the token predicting each."""

    def __init__(self, M: int):
        self.M, self.nll_sum, self.count = M, 0.0, 0
        self.d_nll = np.zeros(M + 1)
        self.d_cnt = np.zeros(M + 1, dtype=np.int64)

    def add(self, nll: np.ndarray, depth: np.ndarray) -> None:
        """nll (P,) float64 and depth (P,) int of P scored targets."""
        self.nll_sum += float(nll.sum())
        self.count += nll.size
        np.add.at(self.d_nll, depth, nll)
        np.add.at(self.d_cnt, depth, 1)

    def summary(self) -> dict:
        """tokens, mean_nll, ppl and depth: the share and count of targets at each depth 1..M, the mean depth and
        the ppl per depth (None where no target had it)."""
        M, count, d_nll, d_cnt = self.M, self.count, self.d_nll, self.d_cnt
        mean = self.nll_sum / count
        return {
            "tokens": int(count),
            "mean_nll": float(mean),
            "ppl": float(math.exp(mean)),
            "depth": {
                "share": (d_cnt[1:] / count).tolist(),
                "counts": d_cnt[1:].tolist(),
                "mean": float((np.arange(1, M + 1) * d_cnt[1:]).sum() / count),
                "ppl": [float(math.exp(d_nll[d] / d_cnt[d])) if d_cnt[d] else None for d in range(1, M + 1)],
            },
        }
