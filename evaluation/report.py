"""Results of one evaluation as text (the Table-1 markdown) and their MLflow logging; the schema, the file and
the metric keys are `evaluation/results.py`'s."""

from __future__ import annotations

import math
import time
from pathlib import Path

from data_prep import valsplit
from evaluation.results import (
    ARTIFACT_DIR,
    RESULTS_FILE,
    TASK_LABELS,
    Results,
    average_accuracy,
    budget_accuracies,
    budget_ppl,
    flatten,
)
from pipeline import tracking

# every evaluation logged to a run also keeps its results.json under eval/history/<time>/ (eval/results.json is the
# newest one), so that `tlf compare` finds each budget of every evaluation of a checkpoint
HISTORY_DIR = f"{ARTIFACT_DIR}/history"


def _fmt(x, pct: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.2f}" if pct else f"{x:.2f}"


def variant_label(variant: str) -> str:
    return {
        "base": "Base",
        "base-loop": "Base-Loop",
        "tmlt": "TMLT",
        "naive-loop-ee": "Naive-Loop-EE",
        "base-loop-ee-align": "Base-Loop-EE-Align",
        "tmlt-ee": "TMLT-EE",
        "loopformer": "LoopFormer",
        "t-loopformer": "T-LoopFormer",
        "base-loop-router": "Base-Loop-Router",
    }.get(variant, variant)


def table1_markdown(result: Results) -> str:
    """The paper's Table 1 layout: one row per budget M; ppl on the two sets, ten accuracies, average."""
    model = result["model"]
    sets = result.get("ppl_sets", [])
    metric = result.get("table_metric", "acc")
    skipped = result.get("skipped_tasks", {})
    head = ["Model", "FLOPs (executed)"] + [f"PPL {s}" for s in sets] + list(TASK_LABELS.values()) + ["Avg Acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for b in result["budgets"]:
        J = model["n_layers"]
        name = f"{variant_label(model['variant'])} ({J} ⊗ {b['effective_loops']})"
        row = [name, executed_flops(J, b)]
        row += [_fmt(budget_ppl(b, s), pct=False) for s in sets]
        row += ["skipped" if t in skipped else _fmt(a) for t, a in zip(TASK_LABELS, budget_accuracies(b, metric))]
        avg, n = average_accuracy(b.get("tasks", {}), metric)
        row.append(_fmt(avg) + ("" if n in (0, len(TASK_LABELS)) else f" ({n} tasks)"))
        lines.append("| " + " | ".join(row) + " |")
    notes = [
        "FLOPs (executed): layer applications per token, J × the mean depth measured on the first "
        "perplexity set (J × M, marked *, where no depth was measured); the Model column's J ⊗ M is the nominal "
        "budget",
        f"Accuracy: {metric} ×100"
        + (" (acc_norm where the task has it, else acc)" if metric == "acc_norm" else "")
        + f"; limit {result.get('limit') or 'none'}.",
    ]
    first = result["budgets"][0] if result["budgets"] else {}
    for t, label in TASK_LABELS.items():
        r = first.get("tasks", {}).get(t)
        if r:
            notes.append(
                f"{label}: {t}, split {r['split']}, n={r['n']}, source {r['source']}"
                + (f" — {r['note']}" if r.get("note") else "")
            )
        elif t in skipped:
            notes.append(f"{label}: {t} skipped (unavailable; eval.strict=false) — {skipped[t]}")
    text_task = not first.get("levels")  # (the fold task's short documents are not judged by their tokens)
    for p in first.get("perplexity", []):
        note = valsplit.short_note(p["tokens"]) if text_task else None
        notes.append(
            f"PPL {p['set']}: {p['dir']} ({p['split']}), {p['tokens']:,} tokens, context {p['context']}, "
            f"{p['protocol']} (stride {p['stride']})" + (f" — **warning**: it {note}" if note else "")
        )
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return text + latency_markdown(result) + depth_markdown(result)


def executed_flops(J: int, b: dict) -> str:
    """The FLOPs cell of a budget: J × its measured mean depth (what ran), else the nominal J × M marked *."""
    depth = b.get("depth", {}).get("mean")
    if depth is None:
        return f"{J * b['effective_loops']}x*"
    return f"{J * depth:.2f}x"


def latency_markdown(result: dict) -> str:
    rows = [b for b in result["budgets"] if b.get("latency")]
    if not rows:
        return f"\nLatency: {result['latency_note']}\n" if result.get("latency_note") else ""
    ps = list(rows[0]["latency"]["ttft_ms"])
    bs = list(rows[0]["latency"]["tpot_ms"])
    head = ["M"] + [f"TTFT ms (P={p})" for p in ps] + [f"TPOT ms (B={b})" for b in bs] + ["decode mean depth"]
    out = ["", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for b in rows:
        lat = b["latency"]
        out.append(
            "| "
            + " | ".join(
                [str(b["loops"])]
                + [f"{lat['ttft_ms'][p]:.2f}" for p in ps]
                + [f"{lat['tpot_ms'][x]:.3f}" for x in bs]
                + [f"{lat['decode_mean_depth']:.2f}"]
            )
            + " |"
        )
    out.append(f"\n- Latency protocol: {rows[0]['latency']['protocol']}")
    return "\n".join(out) + "\n"


def depth_markdown(result: dict) -> str:
    rows = [b for b in result["budgets"] if b.get("depth")]
    if not rows:
        return ""
    out = ["", "| M | mean depth | share per depth 1..M (%) | ppl per depth |", "|---|---|---|---|"]
    for b in rows:
        d = b["depth"]
        share = " / ".join(f"{100 * x:.1f}" for x in d["share"])
        ppl = " / ".join("–" if p is None else f"{p:.2f}" for p in d["ppl"])
        out.append(f"| {b['loops']} | {d['mean']:.3f} | {share} | {ppl} |")
    out.append(
        f"\n- Depth on {rows[0]['depth']['set']} (validation); charts: "
        + ", ".join(Path(b["depth"]["chart"]).name for b in rows if b["depth"].get("chart"))
    )
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------- MLflow
def log_mlflow(
    result: Results,
    files: list[Path],
    tracking_uri: str,
    experiment: str,
    run_id: str | None,
    tags: dict[str, str],
    step: int = 0,
) -> str:
    """Logs every metric in batches (1000 per call) and the files as artifacts (results.json also under
    HISTORY_DIR/<time>/, one per evaluation); returns the run id."""
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    uri = tracking.tracking_uri(tracking_uri)
    client = tracking.checked_client(uri)
    if run_id is not None:
        try:
            client.get_run(run_id)
        except MlflowException:  # recorded by the trainer in another tracking store: link it from a new run
            tags = {**tags, "train_run_id": run_id}
            result["mlflow_note"] = (
                f"the checkpoint's run {run_id} is not in {uri}; logged to a new run tagged train_run_id"
            )
            run_id = None
    if run_id is None:
        run = client.create_run(
            tracking.experiment_id(client, experiment), tags={**tags, "mlflow.runName": tags.get("run_name", "eval")}
        )
        run_id = run.info.run_id
        created = True
    else:
        for k, v in tags.items():
            client.set_tag(run_id, f"eval.{k}" if not k.startswith("eval") else k, v)
        created = False
    now = int(time.time() * 1000)
    tracking.log_metrics(client, run_id, [Metric(k, v, now, step) for k, v in flatten(result).items()])
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path=ARTIFACT_DIR)
        if Path(f).name == RESULTS_FILE:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{time.time_ns() % 10**9:09d}"
            client.log_artifact(run_id, str(f), artifact_path=f"{HISTORY_DIR}/{stamp}")
    if created:
        client.set_terminated(run_id)
    return run_id
