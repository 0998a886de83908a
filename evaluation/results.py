"""The evaluation results schema: `tlf eval` writes it, MLflow carries it flattened, `tlf compare` reads it back.

One structure (`Results`, below) is the file `results.json`; `flatten()` turns its measured numbers into the
MLflow metric keys (`eval/M{M}/{task}/{k}`, `eval/M{M}/avg_acc`, `eval/M{M}/ppl/{set}/{ppl,mean_nll,tokens}`,
`eval/M{M}/depth/{mean,share_i}`, `eval/M{M}/latency/{ttft_ms_P{P},tpot_ms_B{B},decode_mean_depth}`) and
`from_metrics()` turns those keys back into the same structure, so a reader never parses key names itself.
`load_run()` prefers a run's `eval/results.json` artifact and falls back to its metrics.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TypedDict

from data_prep.files import FileFormatError, json_kind, read_json, write_json
from evaluation.tasks import TASK_ORDER, TASKS

TASK_LABELS = {t: TASKS[t].label for t in TASK_ORDER}  # the Table-1 column of each task, in the paper's order
RESULTS_FILE = "results.json"
LATENCY_SIZE = {"ttft_ms": "P", "tpot_ms": "B"}  # latency key -> the letter of the size it is measured at
ARTIFACT_DIR = "eval"  # results.json, table1.md and the depth charts of a run live under this artifact path


# ------------------------------------------------------------------------------------------ schema
class TaskResult(TypedDict, total=False):
    acc: float
    acc_norm: float  # tasks that have it
    perplexity: float  # lambada
    n: int
    split: str
    source: str
    note: str


class Perplexity(TypedDict, total=False):
    set: str
    ppl: float
    mean_nll: float
    tokens: int
    dir: str
    split: str
    context: int
    stride: int
    protocol: str


class Depth(TypedDict, total=False):
    mean: float
    share: list[float]  # share of tokens that ran 1..M loops
    ppl: list  # per-depth perplexity (None where no token stopped there)
    set: str
    chart: str


class Latency(TypedDict, total=False):
    ttft_ms: dict[str, float]  # prompt length P -> ms
    tpot_ms: dict[str, float]  # batch size B -> ms per token
    decode_mean_depth: float
    protocol: str


class Levels(TypedDict, total=False):  # evaluation/levels.py on a depth-task (fold) data.dir
    accuracy: float  # over all scored targets
    accuracy_by_level: dict  # level k -> accuracy
    level_depth: list  # [level-1][depth-1] counts of executed depth
    depth_ge_level: dict  # level k -> share of level-k targets run at depth >= k
    mean_depth: float  # executed loops of the scored (predicting) positions
    work: float  # executed loops per token over every token (the compute)
    spearman: float | None  # rho(executed depth, level); None when either is constant
    targets: int
    loops: int


class Budget(TypedDict, total=False):
    loops: int  # the requested budget M
    effective_loops: int  # what ran (1 for the non-looped base model)
    tasks: dict[str, TaskResult]
    avg_acc: float | None  # mean Table-1 accuracy over the tasks present, with Results.table_metric
    avg_acc_tasks: int
    perplexity: list[Perplexity]
    depth: Depth
    latency: Latency
    levels: Levels
    timing_s: dict


class Results(TypedDict, total=False):
    model: dict  # variant, n_layers, loops, router, block_size, params (+ trained_as for naive-loop-ee)
    table_metric: str  # acc, or acc_norm where a task has it
    budgets: list[Budget]
    ppl_sets: list[str]
    checkpoint: str  # as given to tlf eval
    export: str  # the absolute directory the model was loaded from (`tlf export` matches evaluations by it)
    train_run_id: str  # the checkpoint's training run (its run.json), when recorded
    step: int  # the checkpoint's training step (its run.json)
    config_name: str
    device: str
    limit: int
    source: str
    note: str
    wall_s: float
    files: dict
    mlflow_run_id: str
    mlflow_run: str
    mlflow_note: str
    skipped_tasks: dict[str, str]  # task -> why it was not run (its data unreachable; eval.strict=false)


# ------------------------------------------------------------------------------------------ accuracy
def table_accuracy(res: TaskResult, metric: str) -> float | None:
    """The Table-1 cell of a task: `acc`, or with metric='acc_norm' acc_norm where the task has it."""
    if metric == "acc_norm" and "acc_norm" in res:
        return res["acc_norm"]
    return res.get("acc")


def budget_accuracies(b: Budget, metric: str) -> list[float | None]:
    """The budget's Table-1 accuracy of every task in the paper's order (TASK_LABELS), None where not run."""
    tasks = b.get("tasks", {})
    return [table_accuracy(tasks[t], metric) if t in tasks else None for t in TASK_LABELS]


def budget_ppl(b: Budget, name: str) -> float | None:
    """The budget's perplexity on the set called `name` (compared as `ppl_key`s), None where not measured."""
    return next((p.get("ppl") for p in b.get("perplexity", []) if ppl_key(p["set"]) == ppl_key(name)), None)


def average_accuracy(tasks: dict[str, TaskResult], metric: str) -> tuple[float | None, int]:
    """(mean Table-1 accuracy over the tasks present, how many): what eval stores as avg_acc."""
    vals = [table_accuracy(tasks[t], metric) for t in TASK_ORDER if t in tasks]
    vals = [v for v in vals if v is not None]
    return (sum(vals) / len(vals) if vals else None), len(vals)


def budget_average(results: Results, b: Budget, metric: str) -> float | None:
    """The budget's stored average when it was taken with `metric`, else the average with `metric`."""
    if b.get("avg_acc") is not None and results.get("table_metric", "acc") == metric:
        return b["avg_acc"]
    return average_accuracy(b.get("tasks", {}), metric)[0]


# ------------------------------------------------------------------------------------------ file
def write(path: Path, results: Results) -> Path:
    """results.json, atomically (a reader never sees half a file): the one JSON writer, data_prep.files."""
    return write_json(path, results)


def read(path: Path) -> Results:
    """A results.json; a missing file, text that is not UTF-8, invalid JSON or another shape is a FileFormatError
    (a ValueError) naming the file on one line."""
    res = read_json(path)
    if not isinstance(res, dict) or not isinstance(res.get("budgets"), list):
        what = "no 'budgets' list" if isinstance(res, dict) else f"a JSON {json_kind(res)}, not an object"
        raise FileFormatError(f"{path}: not a tlf results file ({what})")
    return res


# ------------------------------------------------------------------------------------------ MLflow
def ppl_key(name: str) -> str:
    """A perplexity set's name as it appears in metric keys and compare's columns."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def flatten(results: Results) -> dict[str, float]:
    """The MLflow metrics of a result: every measured number under `eval/M{M}/...`."""
    out: dict[str, float] = {}
    for b in results["budgets"]:
        pre = f"eval/M{b['loops']}"
        for t, r in b.get("tasks", {}).items():
            out.update({f"{pre}/{t}/{k}": float(v) for k, v in r.items() if _number(v)})
        if b.get("avg_acc") is not None:
            out[f"{pre}/avg_acc"] = float(b["avg_acc"])
        for p in b.get("perplexity", []):
            for k in ("ppl", "mean_nll", "tokens"):
                out[f"{pre}/ppl/{ppl_key(p['set'])}/{k}"] = float(p[k])
        if b.get("depth"):
            out[f"{pre}/depth/mean"] = float(b["depth"]["mean"])
            out.update({f"{pre}/depth/share_{i}": float(s) for i, s in enumerate(b["depth"]["share"], start=1)})
        lv = b.get("levels") or {}
        out.update(
            {
                f"{pre}/levels/{k}": float(lv[k])
                for k in ("accuracy", "mean_depth", "work", "spearman", "targets")
                if _number(lv.get(k))
            }
        )
        out.update(
            {f"{pre}/levels/acc_L{k}": float(v) for k, v in (lv.get("accuracy_by_level") or {}).items() if _number(v)}
        )
        lat = b.get("latency") or {}
        for k, size in LATENCY_SIZE.items():
            out.update({f"{pre}/latency/{k}_{size}{n}": float(v) for n, v in (lat.get(k) or {}).items()})
        if "decode_mean_depth" in lat:
            out[f"{pre}/latency/decode_mean_depth"] = float(lat["decode_mean_depth"])
    return out


_KEY = re.compile(r"^eval/M(\d+)/(.+)$")
_LAT = re.compile(r"^(" + "|".join(LATENCY_SIZE) + r")_[" + "".join(LATENCY_SIZE.values()) + r"](\d+)$")


def from_metrics(metrics: dict[str, float], variant: str = "", table_metric: str = "acc") -> Results:
    """The inverse of `flatten`: the measured part of a Results from a run's `eval/M{M}/...` metrics."""
    budgets: dict[int, Budget] = {}
    for key, v in metrics.items():
        m = _KEY.match(key)
        if not m:
            continue
        b = budgets.setdefault(int(m.group(1)), {"loops": int(m.group(1)), "tasks": {}, "perplexity": []})
        head, _, rest = m.group(2).partition("/")
        if head == "avg_acc":
            b["avg_acc"] = v
        elif head == "ppl":
            name, _, k = rest.rpartition("/")
            p = next((x for x in b["perplexity"] if x["set"] == name), None)
            if p is None:
                b["perplexity"].append(p := {"set": name})
            p[k] = int(v) if k == "tokens" else v
        elif head == "depth":
            d = b.setdefault("depth", {"mean": float("nan"), "share": []})
            if rest == "mean":
                d["mean"] = v
            else:
                i = int(rest.removeprefix("share_"))
                d["share"] += [0.0] * (i - len(d["share"]))
                d["share"][i - 1] = v
        elif head == "levels":
            lv = b.setdefault("levels", {})
            if rest.startswith("acc_L"):
                lv.setdefault("accuracy_by_level", {})[int(rest[5:])] = v
            else:
                lv[rest] = int(v) if rest == "targets" else v
        elif head == "latency":
            lat = b.setdefault("latency", {})
            if rest == "decode_mean_depth":
                lat[rest] = v
            elif lm := _LAT.match(rest):
                lat.setdefault(lm.group(1), {})[lm.group(2)] = v
        else:  # a task's metric
            b["tasks"].setdefault(head, {})[rest] = v
    for b in budgets.values():  # the writer's order: perplexity sets as first seen, latency sizes ascending
        for k in LATENCY_SIZE:
            if k in b.get("latency", {}):
                b["latency"][k] = dict(sorted(b["latency"][k].items(), key=lambda kv: int(kv[0])))
    return {
        "model": {"variant": variant},
        "table_metric": table_metric,
        "budgets": [budgets[M] for M in sorted(budgets)],
    }


def has_eval(metrics: dict[str, float]) -> bool:
    """Whether a run's metrics hold an evaluation."""
    return any(_KEY.match(k) for k in metrics)


def load_run(client, run_id: str, tags: dict[str, str], metrics: dict[str, float]) -> Results:
    """A run's results: its `eval/results.json` artifact when it has one, else rebuilt from its metrics. The
    run's `variant` tag names its rows."""
    import tempfile

    from mlflow.exceptions import MlflowException

    variant = tags.get("variant", "?")
    metric = tags.get("table_metric") or tags.get("eval.table_metric") or "acc"  # eval. when logged into a train run
    want = f"{ARTIFACT_DIR}/{RESULTS_FILE}"
    if want not in {a.path for a in client.list_artifacts(run_id, ARTIFACT_DIR)}:
        return from_metrics(metrics, variant, metric)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run_id, want, tmp)
            res = read(Path(path))
        except (MlflowException, OSError, ValueError):
            return from_metrics(metrics, variant, metric)
    res.setdefault("model", {})["variant"] = variant  # the run's tag decides its row (one variant per run)
    return res
