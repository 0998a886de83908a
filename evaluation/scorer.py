"""Batched log-likelihood scoring with a LoopedLM at loop budget M, and the zero-shot metrics.

Requests are (context tokens, continuation tokens) pairs, encoded as lm-evaluation-harness's HF model does
(`encode_pair`: trailing spaces of the context move to the continuation; the continuation's tokens are
those of `tok(context + continuation)` after `tok(context)`; an empty context becomes the EOT token). A
request longer than the model's context keeps its last block_size + 1 tokens (left truncation).

Scoring shares contexts (`Scorer`, tree packing): the choices of a question run their common context once,
in one row with the trie of the choices' continuations after it, each continuation attending to the context
and to itself only. Rows are sorted by length (longest first) and packed `batch_size` per forward, right-padded (a
row's padding comes after all its real tokens, which never attend to it). The LM head and log_softmax (fp32)
run only where logits are read. `Scorer(share_context=False)` is the earlier path (one causal row per distinct
input), kept as the benchmark's baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from evaluation.forward import hidden_states, logits_at
from evaluation.tasks import TaskData
from data_prep.tokenizer import EOT, encode


def encode_pair(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) exactly as the harness's HFLM._encode_pair."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if context == "":
        return [EOT], encode(continuation)
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx) :]


@dataclass
class Scored:
    logprob: float  # sum of log p(continuation token)
    greedy: bool  # every continuation token is the argmax
    n_tokens: int


def window(ctx: list[int], cont: list[int], T: int) -> tuple[tuple[int, ...], list[int]]:
    """(model input, targets) of one request: the last T + 1 tokens of context + continuation (left
    truncation), the input all but the last; the targets are the last n = min(len(cont), len(input)) tokens,
    predicted at the input's last n positions."""
    if not cont:
        raise ValueError("empty continuation")
    if not ctx:
        raise ValueError("empty context: give at least one token (encode_pair turns an empty context text into EOT)")
    seq = (list(ctx) + list(cont))[-(T + 1) :]
    n = min(len(cont), len(seq) - 1)
    return tuple(seq[:-1]), seq[-n:]


@dataclass
class _Batch:
    """One forward: tokens (B, P), positions and mask (None: 0..P-1, causal) and, per request scored in it,
    its (row, position) of each target's prediction and the targets."""

    idx: torch.Tensor
    positions: torch.Tensor | None
    mask: torch.Tensor | None
    reads: list[tuple[int, list[tuple[int, int]], list[int]]]  # (request, [(row, pos)], targets)


@dataclass
class _Trie:
    """One packed row: a prefix, then the trie of its branches (a token shared by the leading tokens of several
    branches is one node). Node k: tokens[k], parents[k] (-1: the prefix's last token), depths[k] (0 right after
    the prefix); paths: branch -> its node ids."""

    prefix: tuple
    tokens: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    depths: list = field(default_factory=list)
    paths: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.prefix) + len(self.tokens)


def _in_trie(kids: dict, br: tuple) -> int:
    """How many leading tokens of branch br the trie (kids: (parent, token) -> node) already holds."""
    node, k = -1, 0
    while k < len(br) and (node, br[k]) in kids:
        node, k = kids[(node, br[k])], k + 1
    return k


def _tries(prefix: tuple, branches, limit: int) -> list[_Trie]:
    """Rows for one prefix: branches (sorted, so shared leading tokens meet) inserted into a trie; a branch that
    would take a row past `limit` nodes starts another row (a row always takes its first branch)."""
    rows, kids = [_Trie(prefix)], {}
    for br in sorted(branches):
        tr, node, path = rows[-1], -1, []
        if tr.tokens and len(tr.tokens) + len(br) - _in_trie(kids, br) > limit:
            tr = _Trie(prefix)
            rows.append(tr)
            kids = {}
        for d, t in enumerate(br):
            nxt = kids.get((node, t))
            if nxt is None:
                nxt = kids[(node, t)] = len(tr.tokens)
                tr.tokens.append(t)
                tr.parents.append(node)
                tr.depths.append(d)
            node = nxt
            path.append(node)
        tr.paths[br] = path
    return rows


class Scorer:
    """Scores (context ids, continuation ids) requests with `model` at budget `loops`.

    share_context=True (default): tree packing. A request's input splits into a prefix (up to the position
    that predicts its first target: the context when nothing is truncated) and a branch (its other n - 1
    continuation tokens). Requests with the same prefix share one row: the prefix once, then the trie of their
    branches (leading tokens common to several branches are one node), each node at the position continuing
    its path and attending to the prefix and to its own ancestors only (`LoopedLM.hidden_states` with
    positions and a mask). The router reads only h0 = token + position embedding, so every token's depth is the
    one it has in its own unpacked row, and the scores equal share_context=False's up to fp32 rounding
    (tested). Truncated requests share when their truncated prefixes are equal (same continuation length);
    otherwise their row is their own input, as without sharing. A row holds at most block_size trie nodes
    (more branches: another row with the prefix again).
    share_context=False: one row per distinct input (identical inputs computed once), causal.
    Both: rows longest first, `batch_size` per forward, right-padded; the LM head + log_softmax (fp32) only at
    the distinct (row, position) pairs whose logits are read."""

    def __init__(self, model, batch_size: int = 16, device: str | torch.device = "cpu", share_context: bool = True):
        self.model = model
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device)
        self.block_size = model.cfg.block_size
        self.share_context = share_context

    @torch.no_grad()
    def score(self, requests: list[tuple[list[int], list[int]]], loops: int, progress=None) -> list[Scored]:
        """progress(n): called after each batch with the number of requests it scored (tlf eval's bar)."""
        plan = [window(ctx, cont, self.block_size) for ctx, cont in requests]
        out: list[Scored | None] = [None] * len(plan)
        batches = self._tree_batches(plan) if self.share_context else self._row_batches(plan)
        for b in batches:
            self._run(b, loops, out)
            if progress:
                progress(len(b.reads))
        return out  # type: ignore[return-value]

    def _row_batches(self, plan):
        inputs: dict[tuple, list[int]] = {}  # distinct input -> its requests
        for r, (inp, _tg) in enumerate(plan):
            inputs.setdefault(inp, []).append(r)
        uniq = sorted(inputs, key=lambda inp: -len(inp))
        for b0 in range(0, len(uniq), self.batch_size):
            chunk = uniq[b0 : b0 + self.batch_size]
            idx = torch.zeros(len(chunk), len(chunk[0]), dtype=torch.long)  # (B, P) right-padded
            reads = []
            for row, inp in enumerate(chunk):
                idx[row, : len(inp)] = torch.tensor(inp, dtype=torch.long)
                for r in inputs[inp]:
                    tg = plan[r][1]
                    reads.append((r, [(row, p) for p in range(len(inp) - len(tg), len(inp))], tg))
            yield _Batch(idx, None, None, reads)

    def _tree_batches(self, plan):
        T = self.block_size
        groups: dict[tuple, dict[tuple, list[int]]] = {}  # prefix -> branch -> its requests
        for r, (inp, tg) in enumerate(plan):
            cut = len(inp) - len(tg) + 1
            groups.setdefault(inp[:cut], {}).setdefault(inp[cut:], []).append(r)
        rows = [row for prefix, branches in groups.items() for row in _tries(prefix, branches, T)]
        rows.sort(key=lambda tr: -tr.size)
        for b0 in range(0, len(rows), self.batch_size):
            chunk = rows[b0 : b0 + self.batch_size]
            B, P = len(chunk), chunk[0].size
            idx = np.zeros((B, P), dtype=np.int64)  # (B, P) right-padded
            pos = np.zeros((B, P), dtype=np.int64)  # (B, P)
            mask = np.zeros((B, P, P), dtype=bool)  # (B, P, P) key is an ancestor of the query, or itself
            mask[:, np.arange(P), np.arange(P)] = True  # padding attends to itself only
            reads = []
            for row, tr in enumerate(chunk):
                p, n = len(tr.prefix), tr.size
                idx[row, :p], idx[row, p:n] = tr.prefix, tr.tokens
                pos[row, :p], pos[row, p:n] = np.arange(p), p + np.asarray(tr.depths, dtype=np.int64)
                mask[row, :p, :p] = np.tri(p, dtype=bool)
                for q, par in enumerate(tr.parents, p):  # parents come first: each row copies its parent's
                    mask[row, q, :q] = mask[row, p - 1 if par < 0 else p + par, :q]
                for br, path in tr.paths.items():
                    for r in groups[tr.prefix][br]:
                        reads.append((r, [(row, p - 1)] + [(row, p + k) for k in path], plan[r][1]))
            yield _Batch(torch.from_numpy(idx), torch.from_numpy(pos), torch.from_numpy(mask), reads)

    def _run(self, b: _Batch, loops: int, out: list) -> None:
        dev = self.device
        to = lambda x: None if x is None else x.to(dev)
        h, _ = hidden_states(self.model, b.idx.to(dev), loops, to(b.positions), to(b.mask))  # (B, P, d)
        at: dict[tuple[int, int], int] = {}  # distinct (row, pos) -> row of the logits
        for _r, rp, _tg in b.reads:
            for x in rp:
                at.setdefault(x, len(at))
        rows, pos = zip(*at)
        hu = h[torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)]  # (U, d)
        lg = logits_at(self.model, hu).log_softmax(-1)  # (U, V)
        sel = torch.tensor([at[x] for _r, rp, _tg in b.reads for x in rp])  # (N,) logits row of each target
        tgt = torch.tensor([t for _r, _rp, tg in b.reads for t in tg], dtype=torch.long)  # (N,)
        sel, tgt = sel.to(dev), tgt.to(dev)
        lpt = lg[sel, tgt]  # (N,) fp32
        top = lpt == lg.amax(-1)[sel]  # (N,) the target reaches the maximum (amax: one cheap pass over V)
        hit = top.clone()
        hit[top] = lg[sel[top]].argmax(-1) == tgt[top]  # argmax (slow) on those rows only: ties go to the first
        lp, hit = lpt.double().cpu(), hit.cpu()
        p0 = 0
        for r, rp, _tg in b.reads:
            n = len(rp)
            out[r] = Scored(float(lp[p0 : p0 + n].sum()), bool(hit[p0 : p0 + n].all()), n)
            p0 += n


# ------------------------------------------------------------------------------------------- metrics
def mean_stderr(x) -> float:
    """The harness's stderr of a mean: sample std (ddof 1) / sqrt(n)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size < 2:
        return float("nan")
    return float(np.std(x, ddof=1) / math.sqrt(x.size))


def task_requests(td: TaskData) -> tuple[list[tuple[list[int], list[int]]], list[tuple[int, int]]]:
    """All requests of a task (one per choice) and, per example, its [start, end) slice of them."""
    reqs, spans = [], []
    for ex in td.examples:
        s = len(reqs)
        for c in ex.choices:
            reqs.append(encode_pair(ex.context, " " + c))
        spans.append((s, len(reqs)))
    return reqs, spans


def example_outcomes(td: TaskData, kind: str, scored: list[Scored], spans: list[tuple[int, int]]) -> np.ndarray:
    """(2, n) float64, one column per example: [acc hit, acc_norm hit] (0/1) for multiple choice, [log-likelihood,
    greedy (0/1)] for LAMBADA. What `outcome_metrics` summarises; the zero-shot tasks during training
    (evaluation/in_training.py) sum each rank's columns over the ranks, zeros elsewhere."""
    out = np.zeros((2, len(td.examples)), dtype=np.float64)
    for i, (ex, (s, e)) in enumerate(zip(td.examples, spans)):
        if kind == "lambada":
            out[0, i], out[1, i] = scored[s].logprob, float(scored[s].greedy)
            continue
        lls = np.array([scored[j].logprob for j in range(s, e)])
        lens = np.array([float(len(c)) for c in ex.choices])
        out[0, i] = float(int(np.argmax(lls)) == ex.gold)
        out[1, i] = float(int(np.argmax(lls / lens)) == ex.gold)
    return out


def outcome_metrics(td: TaskData, kind: str, metrics: tuple[str, ...], outcomes: np.ndarray) -> dict:
    """acc / acc_norm (+ stderr) for multiple choice; acc (greedy) and perplexity for LAMBADA, from the (2, n)
    `example_outcomes` of td's examples."""
    res: dict = {"n": len(td.examples), "split": td.split, "source": td.source}
    if td.note:
        res["note"] = td.note
    if not td.examples:
        return res
    first, second = np.ascontiguousarray(outcomes[0]), np.ascontiguousarray(outcomes[1])
    if kind == "lambada":
        ll, acc = first, second
        res["acc"], res["acc_stderr"] = float(acc.mean()), mean_stderr(acc)
        ppl = float(np.exp(-ll.mean()))
        res["perplexity"] = ppl
        res["perplexity_stderr"] = ppl * mean_stderr(-ll)  # delta method on exp(mean NLL)
        return res
    res["acc"], res["acc_stderr"] = float(np.mean(first)), mean_stderr(first)
    if "acc_norm" in metrics:
        res["acc_norm"], res["acc_norm_stderr"] = float(np.mean(second)), mean_stderr(second)
    return res


def task_metrics(
    td: TaskData, kind: str, metrics: tuple[str, ...], scored: list[Scored], spans: list[tuple[int, int]]
) -> dict:
    """acc / acc_norm (+ stderr) for multiple choice; acc (greedy) and perplexity for LAMBADA."""
    return outcome_metrics(td, kind, metrics, example_outcomes(td, kind, scored, spans))
