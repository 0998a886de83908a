"""`run()`: the whole evaluation of one checkpoint (what `tlf eval` calls; the tests call it directly).

For every loop budget M (data and tokenised requests are loaded once and reused): the zero-shot tasks,
perplexity on each validation set, the depth distribution (+ PNG) on the first set, and latency when
`eval.latency` is on. Writes `results.json` and `table1.md` (+ `depth_M{M}.png`) into the output
directory and logs everything to MLflow.
"""
from __future__ import annotations

import time
from pathlib import Path

from pipeline import tracking
from data_prep.depthtask import task_of
from pipeline.config import VARIANTS, Config, ConfigError, load_config, trained_variant
from pipeline.device import resolve_device
from pipeline.model.io import find_export, load_model
from pipeline.train.checkpoint import read_run_record

from evaluation import report, results
from evaluation.depth import depth_chart
from evaluation.perplexity import TokenStream, make_windows, perplexity
from evaluation.progress import Progress
from evaluation.latency import measure_latency
from evaluation.levels import describe_levels, level_scores
from evaluation.scorer import Scorer, task_metrics, task_requests
from evaluation.tasks import TASKS, TaskUnavailable, load_task, spec


def parse_loops(value) -> list[int]:
    """'2,4,8' / [2, 4, 8] / 4 -> [2, 4, 8]."""
    if value is None or value == "" or value == []:
        return []
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = []
    for x in items:
        try:
            out.append(int(str(x).strip()))
        except ValueError:
            raise ConfigError(f"--loops: {x!r} is not an integer (expected e.g. 2,4,8)") from None
    return out


def resolve_budgets(cfg: Config, loops: list[int]) -> list[tuple[int, int]]:
    """[(requested M, effective M)]: a looped model accepts 1..L; the base model (L = 1) is not looped, so
    every requested budget runs its single pass (effective M = 1)."""
    L = cfg.model.loops
    req = loops or list(cfg.eval.loops) or [L]
    out = []
    for m in req:
        if m < 1:
            raise ConfigError(f"--loops / eval.loops: loop budget {m} must be >= 1")
        if L == 1:
            out.append((m, 1))
        elif m > L:
            raise ConfigError(f"loop budget {m} exceeds the checkpoint's training loops model.loops={L} "
                              f"({cfg.model.variant}); use budgets in 1..{L}")
        else:
            out.append((m, m))
    return out


def check_config(cfg: Config, expected: str | None) -> None:
    """With --check-preset NAME (tlf eval): the checkpoint's model section must equal that preset's."""
    if not expected:
        return
    want = load_config(expected).model
    diffs = [f"model.{k}: checkpoint {getattr(cfg.model, k)!r} != {expected} {getattr(want, k)!r}"
             for k in want.__dataclass_fields__ if getattr(cfg.model, k) != getattr(want, k)]
    if diffs:
        raise ConfigError(f"checkpoint is not a {expected} model: " + "; ".join(diffs[:6]))


def relabel(cfg: Config, variant: str | None) -> str | None:
    """Evaluate the checkpoint as `variant` (naive-loop-ee: a base-loop checkpoint read at M < L, no training
    run of its own): checks the checkpoint is the model that variant trains as, renames cfg.model.variant and
    returns the checkpoint's own variant (None when not relabelled)."""
    if not variant or variant == cfg.model.variant:
        return None
    if variant not in VARIANTS:
        raise ConfigError(f"--variant: {variant!r} is not one of {', '.join(VARIANTS)}")
    if trained_variant(variant) != cfg.model.variant:
        raise ConfigError(f"--variant {variant}: evaluates a {trained_variant(variant)} checkpoint, this one is "
                          f"{cfg.model.variant}")
    own, cfg.model.variant = cfg.model.variant, variant
    cfg.model.validate()
    return own


def pick_device(cfg: Config, device: str | None) -> str:
    """--device if given, else train.device (pipeline.device.resolve_device)."""
    if device:
        return resolve_device(device, "--device", indexed=True)
    return resolve_device(cfg.train.device, "train.device")


def ppl_dirs(cfg: Config) -> list[str]:
    return list(cfg.eval.ppl_dirs) or ([cfg.data.dir] + list(cfg.data.extra_val_dirs))


def run(checkpoint: str | Path, overrides: list[str] | tuple = (), loops=None, config: str | None = None,
        device: str | None = None, model=None, cfg: Config | None = None, variant: str | None = None,
        log=print) -> results.Results:
    """Evaluates `checkpoint` (export, checkpoint or run dir). `overrides` are `section.key=value` strings
    applied to the checkpoint's config (e.g. eval.tasks=[copa], eval.limit=20, eval.source=offline);
    `loops` '2,4,8' or a list; `variant` labels the results as another variant of the same trained model
    (`relabel`). Returns the results (evaluation/results.py's schema, also written to <out_dir>/results.json)."""
    t_start = time.time()
    export = find_export(checkpoint)
    if model is None or cfg is None:
        model, cfg = load_model(export, "cpu", list(overrides))
    check_config(cfg, config)
    trained_as = relabel(cfg, variant)
    dev = pick_device(cfg, device)
    model = model.to(dev).eval()
    budgets = resolve_budgets(cfg, parse_loops(loops))
    ev = cfg.eval
    task_names = list(ev.tasks)
    for n in task_names:
        spec(n)  # unknown task names fail before anything runs
    if ev.mlflow:  # a dead or refusing server: one line now (TrackingError), not after the whole evaluation
        tracking.checked_client(cfg.logging.tracking_uri)

    # ---- load everything once; a task whose data cannot be reached is skipped (one line) unless eval.strict
    t0 = time.time()
    tasks, skipped = {}, {}
    for n in task_names:
        try:
            tasks[n] = load_task(n, ev.source, ev.race_file, ev.limit)
        except TaskUnavailable as e:
            if ev.strict:
                raise
            skipped[n] = str(e)
            log(f"eval: warning: skipping {n} (eval.strict=false): {e}")
    requests = {n: task_requests(td) for n, td in tasks.items()}
    streams = [TokenStream(d, cfg.data.val_split, ev.ppl_tokens) for d in ppl_dirs(cfg)] if ev.perplexity else []
    load_s = time.time() - t0
    log(f"eval: {len(tasks)} tasks, {len(streams)} perplexity sets loaded in {load_s:.1f}s; budgets "
        f"{[m for m, _ in budgets]} on {dev}")

    name = (cfg.name or export.name) + (f"-as-{cfg.model.variant}" if trained_as else "")
    out_dir = Path(ev.out_dir) if ev.out_dir else Path("out") / "eval" / name.replace("/", "_") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    scorer = Scorer(model, ev.batch_size, dev)
    T = min(ev.ppl_context or cfg.model.block_size, cfg.model.block_size)
    windows = [len(make_windows(st.num_tokens, T, ev.ppl_stride).starts) for st in streams]
    work = sum(len(td.examples) for td in tasks.values()) + sum(windows)  # per budget
    bar = Progress(work * len({m for _, m in budgets}), ev.progress)
    say = bar.say(log)
    files: list[Path] = []
    result: results.Results = {
        "checkpoint": str(Path(checkpoint)), "export": str(export), "config_name": cfg.name,
        "model": {"variant": cfg.model.variant, "n_layers": cfg.model.n_layers, "loops": cfg.model.loops,
                  "router": cfg.model.router, "block_size": cfg.model.block_size,
                  "params": model.num_params(), **({"trained_as": trained_as} if trained_as else {})},
        "device": dev, "limit": ev.limit, "source": ev.source, "table_metric": ev.table_metric,
        "ppl_sets": [s.name for s in streams], "budgets": [],
        **({"skipped_tasks": skipped} if skipped else {}),
    }
    if cfg.model.loops == 1 and any(m != 1 for m, _ in budgets):
        result["note"] = "base model (model.loops=1) is not looped: every budget runs its single pass"
    level_dir = cfg.data.dir if task_of(cfg.data.dir) else ""  # a depth-hops directory: accuracy by level
    done: dict[int, dict] = {}
    for m_req, m_eff in budgets:
        b = {"loops": m_req, "effective_loops": m_eff, "tasks": {}, "perplexity": [], "timing_s": {}}
        if m_eff in done:  # the base model: the same pass again would give the same numbers
            prev = done[m_eff]
            b.update({k: prev[k] for k in ("tasks", "perplexity", "depth", "avg_acc", "latency", "levels") if k in prev})
            b["timing_s"] = {"reused_from_loops": prev["loops"]}
            result["budgets"].append(b)
            continue
        for n, td in tasks.items():
            t0 = time.time()
            reqs, spans = requests[n]
            sp = TASKS[n]
            bar.stage(f"eval M={m_req} {n}")
            scored = scorer.score(reqs, m_eff, bar.part(len(td.examples), len(reqs)))
            b["tasks"][n] = task_metrics(td, sp.kind, sp.metrics, scored, spans)
            b["timing_s"][n] = round(time.time() - t0, 3)
            r = b["tasks"][n]
            say(f"  M={m_req} {n} ({r['split']}): " + ", ".join(f"{k}={v:.4f}" for k, v in r.items()
                                                                 if isinstance(v, float))
                + (f"  [{r['note']}]" if r.get("note") else ""))
        avg, n_avg = results.average_accuracy(b["tasks"], ev.table_metric)
        b["avg_acc"], b["avg_acc_tasks"] = avg, n_avg
        for i, st in enumerate(streams):
            t0 = time.time()
            bar.stage(f"eval M={m_req} ppl {st.name}")
            p = perplexity(model, st, m_eff, ev.ppl_context, ev.ppl_stride, ev.batch_size, dev,
                           progress=bar.part(windows[i], windows[i]))
            b["timing_s"][f"ppl:{st.name}"] = round(time.time() - t0, 3)
            depth = p.pop("depth")
            b["perplexity"].append(p)
            say(f"  M={m_req} ppl {st.name}: {p['ppl']:.3f} ({p['tokens']} tokens)")
            if i == 0 and ev.depth:
                depth = dict(depth, set=st.name, variant=cfg.model.variant, router=cfg.model.router)
                b["depth"] = depth
                png = depth_chart(depth, m_eff, out_dir / f"depth_M{m_req}.png",
                                  f"{report.variant_label(cfg.model.variant)}: depth on {st.name}, M={m_req}")
                files.append(png)
                b["depth"]["chart"] = str(png)
                say(f"  M={m_req} mean depth {depth['mean']:.3f}")
        if level_dir:
            t0 = time.time()
            b["levels"] = level_scores(model, level_dir, m_eff, cfg.data.val_split, device=dev)
            b["timing_s"]["levels"] = round(time.time() - t0, 3)
            for line in describe_levels(b["levels"], m_req):
                say(line)
        if ev.latency:
            bar.stage(f"eval M={m_req} latency")
            t0 = time.time()
            b["latency"] = measure_latency(model, m_eff, dev)
            b["timing_s"]["latency"] = round(time.time() - t0, 3)
        done[m_eff] = b
        result["budgets"].append(b)
    bar.close()
    result["wall_s"] = round(time.time() - t_start, 3)
    md = out_dir / "table1.md"
    md.write_text(report.table1_markdown(result))
    out_json = out_dir / results.RESULTS_FILE
    result["files"] = {"json": str(out_json), "table": str(md), "charts": [str(f) for f in files]}
    files = [out_json, md] + files
    results.write(out_json, result)
    if ev.mlflow:
        rec = read_run_record(export)
        run_id, step = (rec.mlflow_run_id, rec.step) if rec else (None, 0)
        tags = {"variant": cfg.model.variant, "preset": cfg.name or "", "checkpoint": str(export),
                "kind": "eval", "run_name": f"eval-{name}", "table_metric": ev.table_metric}
        if trained_as and run_id:  # another variant's rows: its own run, linked to the training run
            tags["train_run_id"], run_id = run_id, None
        first = result["budgets"][0]["tasks"] if result["budgets"] else {}
        tags.update({f"split.{t}": r["split"] for t, r in first.items()})
        tags.update({f"skipped.{t}": "unavailable" for t in skipped})
        result["mlflow_run_id"] = report.log_mlflow(result, files, cfg.logging.tracking_uri, cfg.logging.experiment,
                                                    run_id, tags, step)
        result["mlflow_run"] = "checkpoint's run" if result["mlflow_run_id"] == run_id else "new run"
        if result.get("mlflow_note"):
            log(f"eval: {result['mlflow_note']}")
        results.write(out_json, result)
    log("\n" + md.read_text())
    log(f"eval: wrote {out_json} and {md}")
    return result
