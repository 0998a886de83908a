"""Batched log-likelihood scoring with a LoopedLM at loop budget M, and the zero-shot metrics.

Requests are (context tokens, continuation tokens) pairs, encoded as lm-evaluation-harness's HF model does
(`encode_pair`: trailing spaces of the context move to the continuation; the continuation's tokens are
those of `tok(context + continuation)` after `tok(context)`; an empty context becomes the EOT token). A
request longer than the model's context keeps its last block_size + 1 tokens (left truncation).

Scoring: identical model inputs are computed once (so the choices of an example whose continuations are
single tokens share one forward of the context), inputs are sorted by length (longest first) and packed
`batch_size` per forward, right-padded: the model is causal, so padding after a row's last real token
cannot change its logits. The LM head and log_softmax (fp32) run only at the continuation positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    return ctx, whole[len(ctx):]


@dataclass
class Scored:
    logprob: float  # sum of log p(continuation token)
    greedy: bool  # every continuation token is the argmax
    n_tokens: int


class Scorer:
    """Scores (context ids, continuation ids) requests with `model` at budget `loops`."""

    def __init__(self, model, batch_size: int = 16, device: str | torch.device = "cpu"):
        self.model = model
        self.batch_size = max(1, int(batch_size))
        self.device = torch.device(device)
        self.block_size = model.cfg.block_size
        self.forwards = 0  # model calls made (for benchmarks)

    @torch.no_grad()
    def score(self, requests: list[tuple[list[int], list[int]]], loops: int) -> list[Scored]:
        T = self.block_size
        inputs: dict[tuple, int] = {}
        plan = []  # per request: (input index, input length, continuation ids)
        for ctx, cont in requests:
            if not cont:
                raise ValueError("empty continuation")
            seq = (list(ctx) + list(cont))[-(T + 1):]
            inp = tuple(seq[:-1])
            n = min(len(cont), len(inp))
            k = inputs.setdefault(inp, len(inputs))
            plan.append((k, len(inp), seq[-n:]))
        uniq = list(inputs)
        # per unique input: the (start, targets) windows its requests need
        need: dict[int, list[int]] = {}
        for r, (k, _ln, _tg) in enumerate(plan):
            need.setdefault(k, []).append(r)
        order = sorted(range(len(uniq)), key=lambda k: -len(uniq[k]))
        out: list[Scored | None] = [None] * len(plan)
        for b0 in range(0, len(order), self.batch_size):
            ks = order[b0:b0 + self.batch_size]
            L = len(uniq[ks[0]])
            idx = torch.zeros(len(ks), L, dtype=torch.long)
            for row, k in enumerate(ks):
                idx[row, :len(uniq[k])] = torch.tensor(uniq[k], dtype=torch.long)
            h, _ = hidden_states(self.model, idx.to(self.device), loops)
            self.forwards += 1
            rows, pos, tgts, owners = [], [], [], []
            for row, k in enumerate(ks):
                for r in need[k]:
                    _, ln, tg = plan[r]
                    n = len(tg)
                    rows += [row] * n
                    pos += range(ln - n, ln)
                    tgts += tg
                    owners.append((r, n))
            lg = logits_at(self.model, h[torch.tensor(rows), torch.tensor(pos)]).log_softmax(-1)  # (P, V)
            tgt = torch.tensor(tgts, dtype=torch.long, device=lg.device)
            lp = lg.gather(-1, tgt[:, None])[:, 0].double().cpu()
            hit = (lg.argmax(-1) == tgt).cpu()
            p0 = 0
            for r, n in owners:
                out[r] = Scored(float(lp[p0:p0 + n].sum()), bool(hit[p0:p0 + n].all()), n)
                p0 += n
        return out  # type: ignore[return-value]


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


def task_metrics(td: TaskData, kind: str, metrics: tuple[str, ...], scored: list[Scored],
                 spans: list[tuple[int, int]]) -> dict:
    """acc / acc_norm (+ stderr) for multiple choice; acc (greedy) and perplexity for LAMBADA."""
    res: dict = {"n": len(td.examples), "split": td.split, "source": td.source}
    if td.note:
        res["note"] = td.note
    if not td.examples:
        return res
    if kind == "lambada":
        ll = np.array([scored[s].logprob for s, _ in spans])
        acc = np.array([float(scored[s].greedy) for s, _ in spans])
        res["acc"], res["acc_stderr"] = float(acc.mean()), mean_stderr(acc)
        ppl = float(np.exp(-ll.mean()))
        res["perplexity"] = ppl
        res["perplexity_stderr"] = ppl * mean_stderr(-ll)  # delta method on exp(mean NLL)
        return res
    accs, norms, preds = [], [], []
    for ex, (s, e) in zip(td.examples, spans):
        lls = np.array([scored[i].logprob for i in range(s, e)])
        lens = np.array([float(len(c)) for c in ex.choices])
        pred = int(np.argmax(lls))
        preds.append(pred)
        accs.append(float(pred == ex.gold))
        norms.append(float(int(np.argmax(lls / lens)) == ex.gold))
    res["acc"], res["acc_stderr"] = float(np.mean(accs)), mean_stderr(accs)
    if "acc_norm" in metrics:
        res["acc_norm"], res["acc_norm_stderr"] = float(np.mean(norms)), mean_stderr(norms)
    return res


def evaluate_task(scorer: Scorer, td: TaskData, kind: str, metrics: tuple[str, ...], loops: int,
                  requests=None) -> dict:
    reqs, spans = requests if requests is not None else task_requests(td)
    return task_metrics(td, kind, metrics, scorer.score(reqs, loops), spans)
