"""Results of one evaluation: the JSON file, the Table-1 markdown and the MLflow logging."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from evaluation.tasks import TASK_ORDER, TASKS
from pipeline import tracking


def table_accuracy(task: str, res: dict, metric: str) -> float | None:
    """The Table-1 cell of a task: `acc`, or with metric='acc_norm' acc_norm where the task has it."""
    if metric == "acc_norm" and "acc_norm" in res:
        return res["acc_norm"]
    return res.get("acc")


def average_accuracy(tasks: dict, metric: str) -> tuple[float | None, int]:
    vals = [table_accuracy(t, tasks[t], metric) for t in TASK_ORDER if t in tasks]
    vals = [v for v in vals if v is not None]
    return (sum(vals) / len(vals) if vals else None), len(vals)


def _fmt(x, pct: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.2f}" if pct else f"{x:.2f}"


def variant_label(variant: str) -> str:
    return {"base": "Base", "base-loop": "Base-Loop", "tmlt": "TMLT", "naive-loop-ee": "Naive-Loop-EE",
            "base-loop-ee-align": "Base-Loop-EE-Align", "tmlt-ee": "TMLT-EE", "loopformer": "LoopFormer",
            "t-loopformer": "T-LoopFormer"}.get(variant, variant)


def table1_markdown(result: dict) -> str:
    """The paper's Table 1 layout: one row per budget M; ppl on the two sets, ten accuracies, average."""
    model = result["model"]
    sets = result.get("ppl_sets", [])
    metric = result.get("table_metric", "acc")
    head = ["Model", "FLOPs"] + [f"PPL {s}" for s in sets] + [TASKS[t].label for t in TASK_ORDER] + ["Avg Acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for b in result["budgets"]:
        J = model["n_layers"]
        name = f"{variant_label(model['variant'])} ({J} ⊗ {b['effective_loops']})"
        row = [name, f"{J * b['effective_loops']}x"]
        for s in sets:
            p = next((x for x in b.get("perplexity", []) if x["set"] == s), None)
            row.append(_fmt(p["ppl"], pct=False) if p else "–")
        for t in TASK_ORDER:
            row.append(_fmt(table_accuracy(t, b["tasks"][t], metric)) if t in b.get("tasks", {}) else "–")
        avg, n = average_accuracy(b.get("tasks", {}), metric)
        row.append(_fmt(avg) + ("" if n in (0, len(TASK_ORDER)) else f" ({n} tasks)"))
        lines.append("| " + " | ".join(row) + " |")
    notes = [f"Accuracy: {metric} ×100" + (" (acc_norm where the task has it, else acc)" if metric == "acc_norm" else "")
             + f"; limit {result.get('limit') or 'none'}."]
    first = result["budgets"][0] if result["budgets"] else {}
    for t in TASK_ORDER:
        r = first.get("tasks", {}).get(t)
        if r:
            notes.append(f"{TASKS[t].label}: {t}, split {r['split']}, n={r['n']}, source {r['source']}"
                         + (f" — {r['note']}" if r.get("note") else ""))
    for p in first.get("perplexity", []):
        notes.append(f"PPL {p['set']}: {p['dir']} ({p['split']}), {p['tokens']} tokens, context {p['context']}, "
                     f"{p['protocol']} (stride {p['stride']})")
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return text + latency_markdown(result) + depth_markdown(result)


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
        out.append("| " + " | ".join([str(b["loops"])] + [f"{lat['ttft_ms'][p]:.2f}" for p in ps]
                                      + [f"{lat['tpot_ms'][x]:.3f}" for x in bs]
                                      + [f"{lat['decode_mean_depth']:.2f}"]) + " |")
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
    out.append(f"\n- Depth on {rows[0]['depth']['set']} (validation); charts: "
               + ", ".join(Path(b["depth"]["chart"]).name for b in rows if b["depth"].get("chart")))
    return "\n".join(out) + "\n"


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default))
    os.replace(tmp, path)
    return path


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


# --------------------------------------------------------------------------------------------- MLflow
def checkpoint_run_id(export_dir: Path) -> tuple[str | None, int]:
    """(the training run's MLflow id recorded beside the checkpoint or None, the checkpoint's step or 0).

    Looked for in the export dir, its checkpoint dir and the run dir: the trainer's plain-JSON `run.json` written
    beside each export (`mlflow_run_id`, `step`), a `mlflow_run_id` file, or a `mlflow_run_id` / `run_id` key in
    another JSON file. Never unpickles the trainer's state file."""
    from pipeline.train.checkpoint import RUN_RECORD

    for d in (export_dir, export_dir.parent, export_dir.parent.parent):
        for sub in (d, d / "model"):
            rec = sub / RUN_RECORD
            if rec.is_file():
                try:
                    meta = json.loads(rec.read_text())
                except (json.JSONDecodeError, OSError, UnicodeDecodeError):
                    meta = None
                if isinstance(meta, dict) and isinstance(meta.get("mlflow_run_id"), str) and meta["mlflow_run_id"]:
                    return meta["mlflow_run_id"], int(meta.get("step", 0) or 0)
        f = d / "mlflow_run_id"
        if f.is_file() and f.read_text().strip():
            return f.read_text().strip(), 0
        for j in sorted(d.glob("*.json")):
            try:
                meta = json.loads(j.read_text())
            except (json.JSONDecodeError, OSError, UnicodeDecodeError):
                continue
            if isinstance(meta, dict):
                for k in ("mlflow_run_id", "run_id"):
                    if isinstance(meta.get(k), str) and meta[k]:
                        return meta[k], int(meta.get("step", 0) or 0)
    return None, 0


def flat_metrics(result: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in result["budgets"]:
        pre = f"eval/M{b['loops']}"
        for t, r in b.get("tasks", {}).items():
            for k, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    out[f"{pre}/{t}/{k}"] = float(v)
        avg = b.get("avg_acc")
        if avg is not None:
            out[f"{pre}/avg_acc"] = float(avg)
        for p in b.get("perplexity", []):
            key = "".join(c if c.isalnum() or c in "-_." else "_" for c in p["set"])
            out[f"{pre}/ppl/{key}/ppl"] = p["ppl"]
            out[f"{pre}/ppl/{key}/mean_nll"] = p["mean_nll"]
            out[f"{pre}/ppl/{key}/tokens"] = float(p["tokens"])
        d = b.get("depth")
        if d:
            out[f"{pre}/depth/mean"] = d["mean"]
            for i, s in enumerate(d["share"], start=1):
                out[f"{pre}/depth/share_{i}"] = s
        lat = b.get("latency") or {}
        for k in ("ttft_ms", "tpot_ms"):
            for size, v in (lat.get(k) or {}).items():
                out[f"{pre}/latency/{k}_{'P' if k == 'ttft_ms' else 'B'}{size}"] = float(v)
        if "decode_mean_depth" in lat:
            out[f"{pre}/latency/decode_mean_depth"] = float(lat["decode_mean_depth"])
    return out


def log_mlflow(result: dict, files: list[Path], tracking_uri: str, experiment: str, run_id: str | None,
               tags: dict[str, str], step: int = 0) -> str:
    """Logs every metric in batches (1000 per call) and the files as artifacts; returns the run id."""
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    uri = tracking.tracking_uri(tracking_uri)
    client = tracking.client(uri)
    if run_id is not None:
        try:
            client.get_run(run_id)
        except MlflowException:  # recorded by the trainer in another tracking store: link it from a new run
            tags = {**tags, "train_run_id": run_id}
            result["mlflow_note"] = (f"the checkpoint's run {run_id} is not in {uri}; logged to a new run tagged "
                                     "train_run_id")
            run_id = None
    if run_id is None:
        run = client.create_run(tracking.experiment_id(client, experiment), tags={**tags, "mlflow.runName": tags.get("run_name", "eval")})
        run_id = run.info.run_id
        created = True
    else:
        for k, v in tags.items():
            client.set_tag(run_id, f"eval.{k}" if not k.startswith("eval") else k, v)
        created = False
    now = int(time.time() * 1000)
    tracking.log_metrics(client, run_id, [Metric(k, v, now, step) for k, v in flat_metrics(result).items()])
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path="eval")
    if created:
        client.set_terminated(run_id)
    return run_id
