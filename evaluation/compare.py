"""`tlf compare`: the paper's tables and figures from MLflow runs, side by side for the eight variants.

Training runs (`tlf train`) log `loss`, `val/loss`, `tokens_per_s`, `mfu`, `mem/*` and `router/*`; evaluation
runs (`tlf eval`, or eval metrics logged into the training run) log `eval/M{M}/...` and the `eval/results.json`
artifact. Runs are grouped by their `variant` tag; for each variant the newest run that has training metrics is
used, and every evaluation of the variant is read (each run's `eval/history/*/results.json`, else its
`eval/results.json`, else its metrics; budgets the metrics hold that no results file does are an earlier
evaluation's): each budget M's row is the newest evaluation that measured M, so a quick evaluation at one budget
never hides the others. Where the rows differ in what they were evaluated with (limit, tasks, budgets), columns
say so, and the notes under Table 1 list which evaluation gave which rows and how many tokens each perplexity
rests on. Table 3's tokens/s is the run's average, `train_tokens` / `train_time_s` (the optimizer steps alone:
validation and checkpoints excluded), or the last step's rate for a run that did not log them. An evaluation is
read through `evaluation/results.py`, never by parsing key names here. Without MLflow (off,
or its server unreachable), `--run-dir` reads the same metric names from a training run's `metrics.jsonl` and an
evaluation's `results.json` (`local_runs`). naive-loop-ee has
no training run of its own: `tlf sweep` evaluates the base-loop checkpoint under its name. A metric a run
lacks is a blank cell, never an error.

Outputs, in `--out`: `compare.md` (all tables), `table1.csv`, `table2.csv`, `table3.csv`, and PNG plots
`loss_curves.png`, `ppl_vs_loops.png`, `depth_distribution.png`, `throughput.png`; for evaluations on a depth
task (the fold task) also `table4.csv` (accuracy by level against executed loop work, with a fixed-depth
variant's elastic curve at the same work) and `accuracy_vs_work.png`.
"""

from __future__ import annotations

import csv
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from data_prep import valsplit
from data_prep.clitypes import KeyValue
from data_prep.files import FileFormatError, check_writable
from evaluation import results as R
from evaluation.figures import pyplot, save
from evaluation.report import HISTORY_DIR

from pipeline import tracking
from pipeline.config import VARIANTS


@dataclass
class Run:
    run_id: str
    variant: str
    name: str
    start_time: int
    tags: dict
    metrics: dict  # last value of every metric
    results: R.Results | None = None  # the evaluation, loaded for the selected evaluation runs
    history: list[dict] | None = None  # a --run-dir run: its metrics.jsonl lines (MLflow runs: read on demand)

    @property
    def has_train(self) -> bool:
        return "loss" in self.metrics

    @property
    def has_eval(self) -> bool:
        return R.has_eval(self.metrics)

    def budgets(self) -> list[R.Budget]:
        return sorted(self.results["budgets"], key=lambda b: b["loops"]) if self.results else []


def open_store(tracking_uri: str):
    """(resolved URI, MLflow client) of the store compare reads; a usage error for a sqlite store that does not
    exist (the client would create an empty one)."""
    uri = tracking.tracking_uri(tracking_uri)
    db = uri.removeprefix("sqlite:///")
    if db != uri and not Path(db).is_file():
        raise click.UsageError(f"no MLflow store at {db} (nothing was tracked there); pass --tracking-uri or --run-dir")
    try:
        return uri, tracking.checked_client(uri)
    except tracking.TrackingError as e:
        raise click.ClickException(f"{e} (a run's metrics.jsonl is read without a server: --run-dir)") from None


def local_runs(dirs: list[str]) -> list[Run]:
    """Runs read from directories instead of MLflow: a training run's metrics.jsonl (+ tracking.json's tags) and/or
    an evaluation's results.json (the same schema MLflow carries flattened). A malformed line or tracking.json is a
    tracking.MetricsFileError, a results.json that is not one a one-line click error; an incomplete last line
    (a killed run's) is skipped with a warning."""
    runs = []
    warn = lambda msg: click.echo(f"Warning: {msg}", err=True)
    for d in map(Path, dirs):
        rows = tracking.read_metrics(d / tracking.METRICS_FILE, warn)
        res_file = d / R.RESULTS_FILE
        if not rows and not res_file.is_file():
            raise click.UsageError(f"{d}: holds neither {tracking.METRICS_FILE} nor {R.RESULTS_FILE}")
        info = tracking.read_run_file(d)
        tags = {k: str(v) for k, v in (info.get("tags") or {}).items()}
        metrics: dict = {}
        for r in rows:
            metrics.update({k: v for k, v in r.items() if k not in ("step", "time")})
        results = _read_results(res_file, metrics, tags) if res_file.is_file() else None
        newest = max((f.stat().st_mtime for f in (d / tracking.METRICS_FILE, res_file) if f.is_file()), default=0)
        runs.append(
            Run(
                str(d),
                tags.get("variant", "?"),
                str(info.get("name") or d.name),
                int(newest * 1000),
                tags,
                metrics,
                results,
                rows,
            )
        )
    return sorted(runs, key=lambda r: -r.start_time)


def _read_results(f: Path, metrics: dict, tags: dict) -> R.Results:
    """The evaluation in results.json f, its metrics added to `metrics` and its variant to `tags` (unless tagged);
    a file that is not a tlf results file is a one-line error (exit 1)."""
    try:
        res = R.read(f)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    try:
        metrics.update(R.flatten(res))
        tags.setdefault("variant", str((res.get("model") or {}).get("variant", "?")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise click.ClickException(f"{f}: not a tlf results file ({type(e).__name__}: {e})") from None
    return res


def history(client, r: Run, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of a run, by step."""
    if r.history is not None:
        return [(x["step"], x[key]) for x in r.history if key in x]
    return tracking.metric_history(client, r.run_id, key)


def collect_runs(client, uri: str, experiments: list[str], tags: dict[str, str], run_ids: list[str]) -> list[Run]:
    """Runs by id, or every run of the experiments whose tags match; newest first."""
    if run_ids:
        raw = [client.get_run(r) for r in run_ids]
    else:
        ids = []
        for name in experiments:
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise click.UsageError(f"MLflow experiment {name!r} not found at {uri}")
            ids.append(exp.experiment_id)
        flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        raw = client.search_runs(ids, filter_string=flt, max_results=5000, order_by=["attributes.start_time DESC"])
    runs = [
        Run(
            r.info.run_id,
            r.data.tags.get("variant", "?"),
            r.data.tags.get("mlflow.runName", r.info.run_id[:8]),
            r.info.start_time or 0,
            dict(r.data.tags),
            dict(r.data.metrics),
        )
        for r in raw
    ]
    return sorted(runs, key=lambda r: -r.start_time)


@dataclass
class Evaluation:
    """One `tlf eval` of a variant: its results, where they were read, when (seconds since the epoch; 0: unknown,
    older than any) and its label in the tables (E1, E2, ...)."""

    variant: str
    results: R.Results
    where: str
    when: float
    label: str = ""

    def what(self) -> dict[str, str]:
        """What it was evaluated with: limit, tasks, budgets ("?" where its record does not say)."""
        res, budgets = self.results, self.results.get("budgets", [])
        tasks = sorted({t for b in budgets for t in b.get("tasks", {})})
        limit = res.get("limit")
        return {
            "limit": "?" if limit is None else str(limit or "all"),
            "tasks": ", ".join(tasks) if len(tasks) <= 3 else f"{len(tasks)} tasks",
            "budgets": ",".join(str(b["loops"]) for b in sorted(budgets, key=lambda b: b["loops"])),
        }


@dataclass
class Selection:
    train: dict[str, Run] = field(default_factory=dict)  # variant -> newest run with training metrics
    eval: dict[str, Run] = field(default_factory=dict)  # variant -> its budgets, each the newest evaluation's
    origin: dict[tuple[str, int], Evaluation] = field(default_factory=dict)  # (variant, M) -> where its row is from
    evaluations: list[Evaluation] = field(default_factory=list)  # those rows come from, labelled E1, E2, ...
    several: set[str] = field(default_factory=set)  # variants evaluated more than once

    def variants(self) -> list[str]:
        seen = set(self.train) | set(self.eval)
        return [v for v in VARIANTS if v in seen] + sorted(seen - set(VARIANTS))


def _when(res: R.Results, fallback: float) -> float:
    """When an evaluation ran: its `evaluated_at`, else `fallback`."""
    import calendar
    import time

    try:
        return float(calendar.timegm(time.strptime(res["evaluated_at"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError, ValueError):
        return fallback


def _history(client, r: Run) -> list[Evaluation]:
    """Every evaluation a run kept under eval/history/<time>/results.json (tlf eval logs each one there)."""
    import tempfile

    from mlflow.exceptions import MlflowException

    out = []
    try:
        dirs = [a.path for a in client.list_artifacts(r.run_id, HISTORY_DIR) if a.is_dir]
        with tempfile.TemporaryDirectory() as tmp:
            for i, d in enumerate(dirs):
                res = R.read(Path(client.download_artifacts(r.run_id, f"{d}/{R.RESULTS_FILE}", f"{tmp}/{i}")))
                where = f"MLflow run {r.run_id[:8]} {d}"
                out.append(Evaluation(r.variant, res, where, _when(res, r.start_time / 1000)))
    except (MlflowException, OSError, ValueError):  # not readable: the run's newest results or metrics instead
        return []
    return out


def evaluations_of(r: Run, client) -> list[Evaluation]:
    """The evaluations a run holds: a --run-dir's results.json; an MLflow run's history, else its newest results
    (artifact or metrics); and the budgets its metrics hold that none of those has (an earlier evaluation whose
    results file was replaced by a later one's)."""
    if r.history is not None or client is None:
        return [Evaluation(r.variant, r.results, f"{r.run_id}", r.start_time / 1000)] if r.results else []
    evs = _history(client, r)
    if not evs:
        res = R.load_run(client, r.run_id, r.tags, r.metrics)
        evs = [Evaluation(r.variant, res, f"MLflow run {r.run_id[:8]}", _when(res, r.start_time / 1000))]
    have = {b["loops"] for e in evs for b in e.results.get("budgets", [])}
    rest = [b for b in R.from_metrics(r.metrics, r.variant)["budgets"] if b["loops"] not in have]
    if rest:
        res = {"model": {"variant": r.variant}, "table_metric": evs[0].results.get("table_metric"), "budgets": rest}
        evs.append(Evaluation(r.variant, res, f"MLflow run {r.run_id[:8]}, metrics of an earlier evaluation", 0.0))
    return evs


def _merge(v: str, evs: list[Evaluation], sel: Selection) -> None:
    """Variant v's rows: each budget from the newest evaluation that measured it (evs newest first)."""
    chosen: dict[int, tuple[dict, Evaluation]] = {}
    for e in evs:
        for b in e.results.get("budgets", []):
            chosen.setdefault(b["loops"], (b, e))
    newest = evs[0].results
    metric = newest.get("table_metric") or "acc"
    if len(evs) > 1:
        sel.several.add(v)
    budgets = []
    for M in sorted(chosen):
        b, e = chosen[M]
        if (e.results.get("table_metric") or "acc") != metric:  # its stored average is of another metric
            b = {k: x for k, x in b.items() if k != "avg_acc"}
        budgets.append(b)
        sel.origin[(v, M)] = e
        if not any(x is e for x in sel.evaluations):
            sel.evaluations.append(e)
    res = {**newest, "table_metric": metric, "budgets": budgets}
    sel.eval[v] = Run(evs[0].where, v, v, int(evs[0].when * 1000), {}, {}, res)


def select(runs: list[Run], client) -> Selection:
    """The newest training run per variant, and per variant and budget the newest evaluation that measured it."""
    sel = Selection()
    evs: dict[str, list[Evaluation]] = {}
    for r in runs:  # newest first
        if r.has_train:
            sel.train.setdefault(r.variant, r)
        if r.has_eval:
            evs.setdefault(r.variant, []).extend(evaluations_of(r, client))
    for v in sel_order(evs):
        _merge(v, sorted(evs[v], key=lambda e: -e.when), sel)
    for i, e in enumerate(sel.evaluations, start=1):
        e.label = f"E{i}"
    return sel


def sel_order(evs: dict) -> list[str]:
    """Variants in the paper's order, then the others by name."""
    return [v for v in VARIANTS if v in evs] + sorted(set(evs) - set(VARIANTS))


def _with(sel: Selection, keys: list[tuple[str, int]]) -> tuple[list[str], list[list[str]]]:
    """The columns that say what each row (variant, M) was evaluated with, where the rows differ: the evaluation's
    label when a variant's rows come from several, and its limit, tasks or budgets where those differ; (column
    names, one list of cells per row)."""
    origin = [sel.origin.get(k) for k in keys]
    if not keys or any(o is None for o in origin):
        return [], [[] for _ in keys]
    cols, what = [], [o.what() for o in origin]
    per_variant: dict[str, set] = {}
    for (v, _), o in zip(keys, origin):
        per_variant.setdefault(v, set()).add(o.label)
    if any(len(x) > 1 for x in per_variant.values()):
        cols.append("evaluation")
    cols += [k for k in ("limit", "tasks", "budgets") if len({w[k] for w in what} - {"?"}) > 1]  # ?: unknown
    cells = [[o.label if c == "evaluation" else w[c] for c in cols] for o, w in zip(origin, what)]
    return cols, cells


# ------------------------------------------------------------------------------------------ tables
@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list]  # first cell is the row label; other cells float or None
    better: list[str]  # per value column: "low", "high" or "" (not compared)
    fmt: list[str]  # per value column: format spec
    notes: list[str] = field(default_factory=list)  # printed under the table

    def best(self) -> list[float | None]:
        out = []
        for j, b in enumerate(self.better, start=1):
            vals = [r[j] for r in self.rows if isinstance(r[j], (int, float)) and math.isfinite(r[j])]
            distinct = len(set(vals)) > 1  # a column where every value ties has no best
            out.append((min(vals) if b == "low" else max(vals)) if (b and distinct) else None)
        return out

    def cells(self, mark: tuple[str, str]) -> list[list[str]]:
        best = self.best()
        out = []
        for r in self.rows:
            row = [str(r[0])]
            for j, v in enumerate(r[1:]):
                if v is None or (isinstance(v, float) and not math.isfinite(v)):
                    row.append("")
                    continue
                s = format(v, self.fmt[j])
                row.append(f"{mark[0]}{s}{mark[1]}" if best[j] is not None and v == best[j] else s)
            out.append(row)
        return out

    def markdown(self) -> str:
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join(["---"] * len(self.columns)) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in self.cells(("**", "**"))]
        lines += [""] + [f"- {n}" for n in self.notes] if self.notes else []
        return "\n".join(lines) + "\n"

    def text(self) -> str:
        rows = [self.columns] + self.cells(("*", ""))
        w = [max(len(r[j]) for r in rows) for j in range(len(self.columns))]
        out = [self.title, "  ".join(c.ljust(w[j]) for j, c in enumerate(rows[0]))]
        out.append("  ".join("-" * x for x in w))
        out += ["  ".join(c.rjust(w[j]) if j else c.ljust(w[j]) for j, c in enumerate(r)) for r in rows[1:]]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(self.columns)
            for r in self.rows:
                w.writerow(["" if v is None else v for v in r])


def _ppl_sets(runs: list[Run]) -> list[str]:
    sets: list[str] = []
    for r in runs:
        for b in r.budgets():
            sets += [k for p in b.get("perplexity", []) if (k := R.ppl_key(p["set"])) not in sets]
    return sets


def table1(sel: Selection, metric: str = "acc") -> Table:
    """Perplexities, ten accuracies (x100) and their average, one row per variant and loop budget, with what each
    row was evaluated with where the rows differ (`_with`) and, as notes, the evaluations and the tokens behind
    each perplexity."""
    runs = [sel.eval[v] for v in sel.variants() if v in sel.eval]
    sets = _ppl_sets(runs)
    rows, keys = [], []
    for r in runs:
        for b in r.budgets():
            accs = R.budget_accuracies(b, metric)
            avg = R.budget_average(r.results, b, metric)
            row = (
                [R.budget_ppl(b, s) for s in sets]
                + [None if a is None else 100 * a for a in accs]
                + [None if avg is None else 100 * avg]
            )
            if any(v is not None for v in row):  # (an evaluation of a depth task alone has none: Table 4's)
                rows.append([f"{r.variant} (M={b['loops']})"] + row)
                keys.append((r.variant, b["loops"]))
    extra, cells = _with(sel, keys)
    rows = [[row[0], *c, *row[1:]] for row, c in zip(rows, cells)]
    cols = ["Model (M)", *extra] + [f"PPL {s}" for s in sets] + list(R.TASK_LABELS.values()) + ["Avg"]
    return Table(
        "Table 1: perplexity and zero-shot accuracy",
        cols,
        rows,
        [""] * len(extra) + ["low"] * len(sets) + ["high"] * (len(R.TASK_LABELS) + 1),
        [""] * len(extra) + [".2f"] * (len(cols) - 1 - len(extra)),
        evaluation_notes(sel, keys) + ppl_notes(runs),
    )


def evaluation_notes(sel: Selection, keys: list[tuple[str, int]]) -> list[str]:
    """Which evaluation each row comes from, with what it was evaluated, when several exist."""
    rows: dict[str, list[str]] = {}
    for v, M in keys:
        if (v, M) in sel.origin:
            rows.setdefault(sel.origin[(v, M)].label, []).append(f"M={M}")
    used = [e for e in sel.evaluations if e.label in rows]
    known = [{k: x for k, x in e.what().items() if x != "?"} for e in used]
    differ = any(len({w[k] for w in known if k in w}) > 1 for k in ("limit", "tasks", "budgets"))
    if not differ and not sel.several & {v for v, _ in keys}:
        return []  # one evaluation per variant, all evaluated alike: nothing to tell apart
    out = []
    for e in used:
        w = e.what()
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(e.when)) if e.when else "time unknown"
        out.append(
            f"{e.label}: {e.variant}, {e.where}, evaluated {when}: limit {w['limit']}, tasks {w['tasks']}, "
            f"budgets {w['budgets']}; rows {', '.join(rows[e.label])}"
        )
    return out + ["Each budget's row is the newest evaluation that measured it."]


def ppl_notes(runs: list[Run]) -> list[str]:
    """The tokens each perplexity column rests on (per set: the distinct counts over the rows), and a warning
    where they are too few to trust (`valsplit.short_note`)."""
    seen: dict[str, dict[int, set]] = {}
    for r in runs:
        for b in r.budgets():
            for p in b.get("perplexity", []) if not b.get("levels") else []:  # (not the fold task's)
                if "tokens" in p:
                    where = f"{p['dir']} ({p.get('split', 'val')})" if p.get("dir") else "its validation split"
                    seen.setdefault(R.ppl_key(p["set"]), {}).setdefault(int(p["tokens"]), set()).add(where)
    out = []
    for name, counts in seen.items():
        text = "; ".join(f"{n:,} tokens of {', '.join(sorted(w))}" for n, w in sorted(counts.items()))
        note = valsplit.short_note(min(counts))
        out.append(f"PPL {name}: {text}" + (f" — warning: the smallest {note}" if note else ""))
    return out


def table2(sel: Selection) -> Table:
    """Decoding latency per variant and budget: TPOT (ms/token) and TTFT (ms) at each measured size."""
    runs = [sel.eval[v] for v in sel.variants() if v in sel.eval]
    keys: list[tuple[str, str]] = []  # (tpot_ms | ttft_ms, size)
    for r in runs:
        for b in r.budgets():
            lat = b.get("latency") or {}
            keys += [(k, n) for k in ("tpot_ms", "ttft_ms") for n in lat.get(k) or {} if (k, n) not in keys]
    keys.sort(key=lambda kn: (kn[0] == "ttft_ms", int(kn[1])))
    rows, at = [], []
    for r in runs:
        for b in r.budgets():
            lat = b.get("latency") or {}
            vals = [(lat.get(k) or {}).get(n) for k, n in keys]
            if any(v is not None for v in vals):
                rows.append([f"{r.variant} (M={b['loops']})"] + vals + [lat.get("decode_mean_depth")])
                at.append((r.variant, b["loops"]))
    extra, cells = _with(sel, at)
    rows = [[row[0], *c, *row[1:]] for row, c in zip(rows, cells)]
    cols = ["Model (M)", *extra] + [f"{k[:4].upper()} ms {R.LATENCY_SIZE[k]}{n}" for k, n in keys] + ["decode depth"]
    return Table(
        "Table 2: decoding latency",
        cols,
        rows,
        [""] * len(extra) + ["low"] * len(keys) + [""],
        [""] * len(extra) + [".3f"] * len(keys) + [".2f"],
    )


def _train_loss_key(r: Run) -> str:
    """The full pass's CE (`loss_L`) where logged: comparable across variants, unlike the total objective."""
    return "loss_L" if "loss_L" in r.metrics else "loss"


def tokens_per_s(m: dict) -> tuple[float | None, bool]:
    """A training run's tokens/s: its average, train_tokens / train_time_s (the optimizer steps alone), and True;
    else (a run that did not log them) the last logged step's rate and False."""
    if m.get("train_time_s") and m.get("train_tokens"):
        return m["train_tokens"] / m["train_time_s"], True
    return m.get("tokens_per_s"), False


def table3(sel: Selection) -> Table:
    """Training: peak memory, throughput (the run's average), MFU, final training and validation loss and the
    tokens that validation loss rests on, mean router depth."""
    cols = ["Model", "peak mem GB", "tokens/s", "MFU %", "train loss (L_L)", "val loss", "val tokens", "mean depth"]
    rows, last, notes = [], [], []
    for v in sel.variants():
        r = sel.train.get(v)
        if r is None:
            continue
        m = r.metrics
        mem = m.get("mem/cuda_max_allocated_gb", m.get("mem/peak_rss_gb"))
        mfu = m.get("mfu")
        tps, average = tokens_per_s(m)
        if tps is not None and not average:
            last.append(v)
        val_tokens = r.tags.get("val_tokens")
        rows.append(
            [
                v,
                mem,
                tps,
                None if mfu is None else 100 * mfu,
                m.get(_train_loss_key(r)),
                m.get("val/loss"),
                None if val_tokens is None else float(val_tokens),
                m.get("router/full/mean_depth"),
            ]
        )
        split = r.tags.get("val_split_tokens")
        if split is not None and (note := valsplit.short_note(int(float(split)))):
            notes.append(f"{v}: its data's val split {note}")
    notes.insert(
        0,
        "tokens/s: the run's average, tokens trained / seconds in optimizer steps (validation, checkpoints and "
        "logging excluded)"
        + (f"; the last logged step's rate for {', '.join(last)} (no train_time_s logged)" if last else ""),
    )
    return Table(
        "Table 3: training memory and speed",
        cols,
        rows,
        ["low", "high", "high", "low", "low", "", ""],
        [".3f", ",.0f", ".2f", ".3f", ".3f", ",.0f", ".2f"],
        notes,
    )


def _routed(r: Run) -> bool:
    """Whether an evaluation's model has a router (its results.json says so)."""
    return bool((r.results or {}).get("model", {}).get("router"))


def table4(sel: Selection) -> Table:
    """Depth task (an evaluation on a depth-fold data.dir): answer accuracy overall and by level,
    executed loop work, rho(executed depth, level) and the share of answers run at depth >= their level, one row
    per variant and budget; and what a fixed-depth variant's elastic curve reaches at the same work (the first
    variant without a router evaluated at several budgets: loopformer in the study), and the difference."""
    from evaluation.levels import accuracy_at_work, share_at_depth_ge_level

    runs = [r for v in sel.variants() if (r := sel.eval.get(v)) is not None]
    lv = {r.variant: [(b["loops"], b["levels"]) for b in r.budgets() if b.get("levels")] for r in runs}
    lv = {v: x for v, x in lv.items() if x}
    L = max((len(sc.get("accuracy_by_level") or {}) for x in lv.values() for _, sc in x), default=0)
    ref = next(
        (r.variant for r in runs if len(lv.get(r.variant, [])) > 1 and not _routed(r)),
        None,
    )
    curve = [(sc["work"], sc["accuracy"]) for _, sc in lv[ref]] if ref else []
    cols = [
        "Model (M)",
        "accuracy",
        *(f"level {k}" for k in range(1, L + 1)),
        "work (loops/token)",
        "rho(depth, level)",
    ]
    cols += ["depth >= level"] + ([f"{ref} at that work", "difference"] if ref else [])
    rows, keys = [], []
    for v, budgets in lv.items():
        for M, sc in budgets:
            keys.append((v, M))
            by = {int(k): a for k, a in (sc.get("accuracy_by_level") or {}).items()}
            ge = share_at_depth_ge_level(sc["level_depth"]) if sc.get("level_depth") else None
            row = [
                f"{v} (M={M})",
                sc["accuracy"],
                *(by.get(k) for k in range(1, L + 1)),
                sc["work"],
                sc.get("spearman"),
                ge,
            ]
            if ref:
                at = None if v == ref else accuracy_at_work(curve, sc["work"])
                row += [at, None if at is None else sc["accuracy"] - at]
            rows.append(row)
    extra, cells = _with(sel, keys)
    return Table(
        "Table 4: depth task, accuracy against executed loop work",
        [cols[0], *extra, *cols[1:]],
        [[row[0], *c, *row[1:]] for row, c in zip(rows, cells)],
        [""] * len(extra) + ["high"] * (L + 1) + ["low", "high", "high"] + (["", "high"] if ref else []),
        [""] * len(extra) + [".3f"] * (L + 1) + [".2f", ".2f", ".2f"] + ([".3f", "+.3f"] if ref else []),
    )


def level_depth_text(sel: Selection) -> str:
    """For each router variant evaluated on a depth task, at its largest budget: the level x executed-depth
    table (% of each level's answers at each depth, and the share at depth >= the level)."""
    from evaluation.levels import level_depth_lines

    out = []
    for v in sel.variants():
        r = sel.eval.get(v)
        if r is None or not _routed(r):
            continue
        b = max(
            (b for b in r.budgets() if (b.get("levels") or {}).get("level_depth")),
            key=lambda b: b["loops"],
            default=None,
        )
        if b is not None:
            out += [
                f"{v} (M={b['loops']}): level x executed depth, % of the level's answers",
                *level_depth_lines(b["levels"]["level_depth"]),
            ]
    return "\n".join(out) + "\n" if out else ""


# ------------------------------------------------------------------------------------------ plots
def plot_all(sel: Selection, client, out: Path) -> list[Path]:
    """The PNG plots of the selection that has data for them, written into out."""
    plt = pyplot()
    runs = {v: sel.eval[v] for v in sel.variants() if v in sel.eval}
    plots = (
        (_plot_losses, sel, client),
        (_plot_ppl, runs),
        (_plot_depth, runs),
        (_plot_work, runs),
        (_plot_throughput, sel),
        (_plot_elastic_training, sel, client),
    )
    paths = []
    for fn, *args in plots:
        got = fn(plt, *args)
        if got is not None:
            paths.append(save(got[0], out / got[1]))
    return paths


def _plot_losses(plt, sel: Selection, client):
    """Training and validation loss curves, one line per variant."""
    if not sel.train:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for v in sel.variants():
        r = sel.train.get(v)
        if r is None:
            continue
        # loss_L (the full pass's CE) compares across variants; `loss` adds the shortcut terms
        for ax, key in zip(axes, (_train_loss_key(r), "val/loss")):
            h = history(client, r, key)
            if h:
                marker = "o" if key != "loss" else None
                ax.plot([st for st, _ in h], [x for _, x in h], marker=marker, markersize=3, label=v)
    for ax, t in zip(axes, ("training loss (full pass, L_L)", "validation loss")):
        ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.set_title(t), ax.grid(alpha=0.3)
        if ax.lines:  # (no validation loss without train.eval_interval)
            ax.legend(fontsize=7)
    return fig, "loss_curves.png"


def _plot_ppl(plt, runs: dict[str, Run]):
    """Elastic depth: perplexity against the loop budget, one panel per perplexity set."""
    sets = _ppl_sets(list(runs.values()))
    if not (runs and sets):
        return None
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for ax, s in zip(axes[0], sets):
        for v, r in runs.items():
            pts = [(M, p) for M, p in ((b["loops"], R.budget_ppl(b, s)) for b in r.budgets()) if p is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.set_xlabel("loop budget M"), ax.set_ylabel("perplexity"), ax.set_title(f"PPL {s} vs loop budget")
        ax.grid(alpha=0.3), ax.legend(fontsize=7)
    return fig, "ppl_vs_loops.png"


def _plot_depth(plt, runs: dict[str, Run]):
    """The depth distribution of a router variant (t-loopformer if evaluated) at its largest budget."""
    depth = {
        v: b
        for v, r in runs.items()
        if (b := max((b for b in r.budgets() if b.get("depth")), key=lambda b: b["loops"], default=None))
    }
    if not depth:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in [v for v in depth if v == "t-loopformer"] or list(depth)[:1]:
        M, d = depth[v]["loops"], depth[v]["depth"]
        shares = (list(d["share"]) + [0.0] * M)[:M]
        ax.bar(range(1, M + 1), [100 * s for s in shares], label=f"{v} (M={M}, mean {d['mean']:.2f})")
    ax.set_xticks(range(1, max(b["loops"] for b in depth.values()) + 1))
    ax.set_xlabel("loops per token"), ax.set_ylabel("share of tokens (%)"), ax.set_title("depth distribution")
    ax.legend(fontsize=7)
    return fig, "depth_distribution.png"


def _plot_work(plt, runs: dict[str, Run]):
    """Depth task: answer accuracy against executed loop work (mean loops per token), one line per run."""
    work = {}
    for v, r in runs.items():
        lv = [b["levels"] for b in r.budgets() if (b.get("levels") or {}).get("work") is not None]
        if lv:
            work[v] = [(x["work"], x["accuracy"]) for x in lv]
    if not work:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for v, pts in work.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=v)
    ax.set_xlabel("executed loop work (mean loops per token)"), ax.set_ylabel("answer accuracy")
    ax.set_title("depth task: accuracy vs loop work"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    return fig, "accuracy_vs_work.png"


def elastic_points(sel: Selection, client) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """{variant: {step: [(loop work, validation loss), ...] by budget}} of each training run that logged several
    budgets (train.eval_loops: val/M{M}/loss): loop work is a routed pass's val/M{M}/loop_work (mean depth / L),
    else M / L, L the largest budget logged."""
    out: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for v in sel.variants():
        r = sel.train.get(v)
        budgets = sorted(int(m[1]) for k in (r.metrics if r else {}) if (m := re.fullmatch(r"val/M(\d+)/loss", k)))
        if len(budgets) < 2:
            continue
        per: dict[int, dict[int, list[float]]] = {}
        for M in budgets:
            work = dict(history(client, r, f"val/M{M}/loop_work"))
            for step, loss in history(client, r, f"val/M{M}/loss"):
                per.setdefault(step, {})[M] = [work.get(step, M / budgets[-1]), loss]
        out[v] = {st: [tuple(per[st][M]) for M in sorted(per[st])] for st in sorted(per)}
    return out


def _plot_elastic_training(plt, sel: Selection, client):
    """The elastic curve over training: validation loss against loop work at each logged step (one line per step,
    darker later), a routed variant's passes dashed, with its routed point at M = L marked."""
    pts = elastic_points(sel, client)
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmaps = ["Blues", "Oranges", "Greens", "Purples", "Reds"]
    for i, (v, steps) in enumerate(pts.items()):
        routed = any(k.endswith("/loop_work") for k in sel.train[v].metrics)  # logged by a routed pass only
        cmap = plt.get_cmap(cmaps[i % len(cmaps)])
        for j, (st, line) in enumerate(steps.items()):
            color = cmap(0.35 + 0.65 * (j + 1) / len(steps))
            last = j == len(steps) - 1
            ax.plot(
                *zip(*line), linestyle="--" if routed else "-", color=color, label=f"{v} step {st}" if last else None
            )
            if routed:
                ax.plot(*line[-1], marker="*", markersize=10, color=color)
    ax.set_xlabel("loop work (share of the full pass's loops)"), ax.set_ylabel("validation loss")
    ax.set_title("elastic curve over training (darker: later; *: routed point at M = L)")
    ax.grid(alpha=0.3), ax.legend(fontsize=7)
    return fig, "elastic_over_training.png"


def _plot_throughput(plt, sel: Selection):
    """Training tokens/s per variant."""
    thr = [(v, tokens_per_s(sel.train[v].metrics)[0]) for v in sel.variants() if v in sel.train]
    thr = [(v, t) for v, t in thr if t is not None]
    if not thr:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([v for v, _ in thr], [t for _, t in thr])
    ax.set_xlabel("training tokens/s"), ax.set_title("throughput")
    return fig, "throughput.png"


# ------------------------------------------------------------------------------------------ run
@dataclass
class CompareResult:
    tables: list[Table]
    files: list[Path]
    text: str


def run(
    tracking_uri: str = "",
    experiments: tuple[str, ...] = ("tlf",),
    tags: dict | None = None,
    run_ids: tuple[str, ...] = (),
    out: str | Path = "compare",
    metric: str = "acc",
    run_dirs: tuple[str, ...] = (),
) -> CompareResult:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one results.json per run: no bars
    outd = check_writable(out, "--out")  # before the runs are read
    if run_dirs:  # no MLflow at all
        client, runs = None, local_runs(list(run_dirs))
    else:
        uri, client = open_store(tracking_uri)
        runs = collect_runs(client, uri, list(experiments), tags or {}, list(run_ids))
    sel = select(runs, client)
    outd.mkdir(parents=True, exist_ok=True)
    tables = [table1(sel, metric), table2(sel), table3(sel), table4(sel)]
    kept = [(i, t) for i, t in enumerate(tables, start=1) if i <= 3 or t.rows]  # table 4 only with a depth task
    files = []
    for i, t in kept:
        t.write_csv(outd / f"table{i}.csv")
        files.append(outd / f"table{i}.csv")
    md = (
        "# tlf compare\n\n"
        + f"{len(runs)} runs; variants: {', '.join(sel.variants()) or 'none'}\n\n"
        + "\n".join(t.markdown() for _, t in kept)
    )
    depth = level_depth_text(sel)
    if depth:
        md += "\n### Level x executed depth\n\n```\n" + depth + "```\n"
    plots = plot_all(sel, client, outd)
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    (outd / "compare.md").write_text(md)
    files = [outd / "compare.md"] + files + plots
    text = "\n".join(t.text() for t in tables if t.rows) + ("\n" + depth if depth else "")
    return CompareResult(tables, files, text)


@click.command("compare")
@click.option(
    "--tracking-uri",
    default="",
    help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db).",
)
@click.option(
    "--experiment",
    "experiments",
    multiple=True,
    default=("tlf",),
    show_default=True,
    help="Experiment name(s) to read.",
)
@click.option(
    "--tag", "tag_items", type=KeyValue(), multiple=True, help="Only runs with this tag, KEY=VALUE (repeatable)."
)
@click.option("--run-id", "run_ids", multiple=True, help="Exactly these runs (repeatable); overrides --experiment.")
@click.option(
    "--run-dir",
    "run_dirs",
    type=click.Path(exists=True, file_okay=False),
    multiple=True,
    help="Read this run directory's metrics.jsonl (or an eval output's results.json) instead of MLflow (repeatable).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="compare",
    show_default=True,
    help="Output directory for markdown, CSV and PNG.",
)
@click.option(
    "--metric",
    type=click.Choice(["acc", "acc_norm"]),
    default="acc",
    show_default=True,
    help="Accuracy column: acc, or acc_norm where a task has it.",
)
def compare(tracking_uri, experiments, tag_items, run_ids, run_dirs, out, metric):
    """Side-by-side tables (the paper's Tables 1-3) and plots from MLflow runs of the variants."""
    try:
        res = run(tracking_uri, experiments, dict(tag_items), run_ids, out, metric, run_dirs)
    except (tracking.MetricsFileError, FileFormatError) as e:  # a damaged metrics.jsonl, tracking.json, results.json
        raise click.ClickException(str(e)) from None
    click.echo(res.text or "no runs with training or evaluation metrics matched")
    click.echo("files:\n" + "\n".join(f"  {f}" for f in res.files))
