"""`run()`: the whole evaluation of one checkpoint (what `tlf eval` calls; the tests call it directly).

For every loop budget M (data and tokenised requests are loaded once and reused): the zero-shot tasks,
perplexity on each validation set, the depth distribution (+ PNG) on the first set, and latency when
`eval.latency` is on. Before any of it, one line says what it will cost (evaluation/estimate.py). Writes
`results.json` and `table1.md` (+ `depth_M{M}.png`) into the output directory (removed again, when still empty,
if the evaluation fails or is interrupted), and logs everything to MLflow, saying which run at which tracking URI.
results.json records the export directory evaluated and the checkpoint's training run and step (its run.json):
what `tlf export` matches to put a checkpoint's evaluation on its model card (pipeline/hf/export.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from data_prep import valsplit
from data_prep.files import check_writable, new_dirs_removed_on_error
from pipeline import tracking
from data_prep.foldtask import task_of
from data_prep.tokenizer import GPT2_VOCAB
from pipeline.config import VARIANTS, Config, ConfigError, load_config, trained_variant
from pipeline.device import resolve_device
from pipeline.export import EVAL_ROOT
from pipeline.hf.load import load_any, model_dir
from pipeline.train.checkpoint import read_run_record

from evaluation import report, results
from evaluation.depth import depth_chart
from evaluation.estimate import estimate_line
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
            raise ConfigError(
                f"loop budget {m} exceeds the checkpoint's training loops model.loops={L} "
                f"({cfg.model.variant}); use budgets in 1..{L}"
            )
        else:
            out.append((m, m))
    return out


def check_config(cfg: Config, expected: str | None) -> None:
    """With --check-preset NAME (tlf eval): the checkpoint's model section must equal that preset's."""
    if not expected:
        return
    want = load_config(expected).model
    diffs = [
        f"model.{k}: checkpoint {getattr(cfg.model, k)!r} != {expected} {getattr(want, k)!r}"
        for k in want.__dataclass_fields__
        if getattr(cfg.model, k) != getattr(want, k)
    ]
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
        raise ConfigError(
            f"--variant {variant}: evaluates a {trained_variant(variant)} checkpoint, this one is {cfg.model.variant}"
        )
    own, cfg.model.variant = cfg.model.variant, variant
    cfg.model.validate()
    return own


def pick_device(cfg: Config, device: str | None) -> str:
    """--device if given, else train.device (pipeline.device.resolve_device)."""
    if device:
        return resolve_device(device, "--device", indexed=True)
    return resolve_device(cfg.train.device, "train.device")


def ppl_dirs(cfg: Config) -> list[str]:
    return list(cfg.eval.ppl_dirs) or (cfg.data.sources() + list(cfg.data.extra_val_dirs))


@dataclass
class _Inputs:
    """Everything loaded once and reused at every budget."""

    tasks: dict  # name -> task data
    skipped: dict  # name -> why (eval.strict=false)
    requests: dict  # name -> (tokenised requests, spans)
    streams: list  # perplexity TokenStreams
    windows: list  # perplexity windows per stream
    level_dir: str  # a depth-task data.dir (the fold task; "" otherwise): accuracy by level


@dataclass
class _Run:
    """One evaluation's state, shared by its steps."""

    model: object
    cfg: Config
    dev: str
    inp: _Inputs
    scorer: Scorer
    bar: Progress
    say: object
    out_dir: Path
    files: list = field(default_factory=list)
    warned: set = field(default_factory=set)  # perplexity sets already said to be too small


def load_inputs(cfg: Config, log) -> _Inputs:
    """The tasks (a task whose data cannot be reached is skipped with one line unless eval.strict), their
    tokenised requests, the perplexity streams and, for a depth-task data.dir, the directory to score by level."""
    ev = cfg.eval
    tasks, skipped, names = {}, {}, list(ev.tasks)
    if names and cfg.model.vocab_size < GPT2_VOCAB:  # e.g. a depth-task model: its ids are not GPT-2's
        why = (
            f"model.vocab_size={cfg.model.vocab_size} holds fewer ids than the GPT-2 text the zero-shot tasks are "
            f"written in ({GPT2_VOCAB}); a depth-task model is scored by level from its data.dir, and eval.tasks=[] "
            "leaves the tasks out"
        )
        if ev.strict:
            raise ConfigError(f"eval.tasks: {why}")
        log(f"eval: warning: skipping the zero-shot tasks (eval.strict=false): {why}")
        skipped, names = (
            dict.fromkeys(names, f"its GPT-2 text does not fit model.vocab_size={cfg.model.vocab_size}"),
            [],
        )
    for n in names:
        try:
            tasks[n] = load_task(n, ev.source, ev.race_file, ev.limit)
        except TaskUnavailable as e:
            if ev.strict:
                raise
            skipped[n] = str(e)
            log(f"eval: warning: skipping {n} (eval.strict=false): {e}")
    streams = (
        [TokenStream(d, cfg.data.val_split, ev.ppl_tokens, cfg.model.vocab_size) for d in ppl_dirs(cfg)]
        if ev.perplexity
        else []
    )
    T = min(ev.ppl_context or cfg.model.block_size, cfg.model.block_size)
    windows = [len(make_windows(st.num_tokens, T, ev.ppl_stride).starts) for st in streams]
    return _Inputs(
        tasks,
        skipped,
        {n: task_requests(td) for n, td in tasks.items()},
        streams,
        windows,
        cfg.data.dir if task_of(cfg.data.dir) else "",
    )


def _measure_tasks(r: _Run, b: dict, m_req: int, m_eff: int) -> None:
    for n, td in r.inp.tasks.items():
        t0 = time.time()
        reqs, spans = r.inp.requests[n]
        sp = TASKS[n]
        r.bar.stage(f"eval M={m_req} {n}")
        scored = r.scorer.score(reqs, m_eff, r.bar.part(len(td.examples), len(reqs)))
        b["tasks"][n] = task_metrics(td, sp.kind, sp.metrics, scored, spans)
        b["timing_s"][n] = round(time.time() - t0, 3)
        t = b["tasks"][n]
        r.say(
            f"  M={m_req} {n} ({t['split']}): "
            + ", ".join(f"{k}={v:.4f}" for k, v in t.items() if isinstance(v, float))
            + (f"  [{t['note']}]" if t.get("note") else "")
        )
    b["avg_acc"], b["avg_acc_tasks"] = results.average_accuracy(b["tasks"], r.cfg.eval.table_metric)


def _measure_perplexity(r: _Run, b: dict, m_req: int, m_eff: int) -> None:
    """Perplexity on every set; the depth distribution (+ chart) on the first."""
    ev, cfg = r.cfg.eval, r.cfg
    for i, st in enumerate(r.inp.streams):
        t0 = time.time()
        r.bar.stage(f"eval M={m_req} ppl {st.name}")
        p = perplexity(
            r.model,
            st,
            m_eff,
            ev.ppl_context,
            ev.ppl_stride,
            ev.batch_size,
            r.dev,
            progress=r.bar.part(r.inp.windows[i], r.inp.windows[i]),
        )
        b["timing_s"][f"ppl:{st.name}"] = round(time.time() - t0, 3)
        depth = p.pop("depth")
        b["perplexity"].append(p)
        r.say(f"  M={m_req} ppl {st.name}: {p['ppl']:.3f} ({p['tokens']:,} tokens of {st.dir} {st.split})")
        if i not in r.warned and not r.inp.level_dir and (note := valsplit.short_note(p["tokens"])):
            r.warned.add(i)
            r.say(f"  eval: warning: the perplexity on {st.name} {note}")
        if i == 0 and ev.depth:
            depth = dict(depth, set=st.name, variant=cfg.model.variant, router=cfg.model.router)
            b["depth"] = depth
            png = depth_chart(
                depth,
                m_eff,
                r.out_dir / f"depth_M{m_req}.png",
                f"{report.variant_label(cfg.model.variant)}: depth on {st.name}, M={m_req}",
            )
            r.files.append(png)
            b["depth"]["chart"] = str(png)
            r.say(f"  M={m_req} mean depth {depth['mean']:.3f}")


def _measure_levels(r: _Run, b: dict, m_req: int, m_eff: int) -> None:
    t0 = time.time()
    b["levels"] = level_scores(r.model, r.inp.level_dir, m_eff, r.cfg.data.val_split, device=r.dev)
    b["timing_s"]["levels"] = round(time.time() - t0, 3)
    for line in describe_levels(b["levels"], m_req):
        r.say(line)


def _measure_latency(r: _Run, b: dict, m_req: int, m_eff: int) -> None:
    r.bar.stage(f"eval M={m_req} latency")
    t0 = time.time()
    b["latency"] = measure_latency(r.model, m_eff, r.dev)
    b["timing_s"]["latency"] = round(time.time() - t0, 3)


def measure_budget(r: _Run, m_req: int, m_eff: int) -> dict:
    """Every measurement at one loop budget (requested m_req, run as m_eff): one `results.Budget`."""
    b = {"loops": m_req, "effective_loops": m_eff, "tasks": {}, "perplexity": [], "timing_s": {}}
    _measure_tasks(r, b, m_req, m_eff)
    _measure_perplexity(r, b, m_req, m_eff)
    if r.inp.level_dir:
        _measure_levels(r, b, m_req, m_eff)
    if r.cfg.eval.latency:
        _measure_latency(r, b, m_req, m_eff)
    return b


def publish(result: results.Results, r: _Run, export: Path, name: str, trained_as: str | None, log) -> None:
    """Writes results.json and table1.md, logs them (and the charts) to MLflow when eval.mlflow, prints the table."""
    md = r.out_dir / "table1.md"
    md.write_text(report.table1_markdown(result))
    out_json = r.out_dir / results.RESULTS_FILE
    result["files"] = {"json": str(out_json), "table": str(md), "charts": [str(f) for f in r.files]}
    results.write(out_json, result)
    if r.cfg.eval.mlflow:
        _log_mlflow(result, r, [out_json, md, *r.files], export, name, trained_as, log)
        results.write(out_json, result)
    log("\n" + md.read_text())
    log(f"eval: wrote {out_json} and {md}")


def _log_mlflow(result, r: _Run, files: list, export: Path, name: str, trained_as: str | None, log) -> None:
    """Logs the results to the checkpoint's training run (a new run for a relabelled variant or a run the store
    lacks) and says which run, at which tracking URI."""
    cfg, ev = r.cfg, r.cfg.eval
    run_id, step = result.get("train_run_id"), result.get("step", 0)
    tags = {
        "variant": cfg.model.variant,
        "preset": cfg.name or "",
        "checkpoint": str(export),
        "kind": "eval",
        "run_name": f"eval-{name}",
        "table_metric": ev.table_metric,
    }
    if trained_as and run_id:  # another variant's rows: its own run, linked to the training run
        tags["train_run_id"], run_id = run_id, None
    first = result["budgets"][0]["tasks"] if result["budgets"] else {}
    tags.update({f"split.{t}": x["split"] for t, x in first.items()})
    tags.update({f"skipped.{t}": "unavailable" for t in r.inp.skipped})
    uri = tracking.tracking_uri(cfg.logging.tracking_uri)
    result["mlflow_run_id"] = report.log_mlflow(result, files, uri, cfg.logging.experiment, run_id, tags, step)
    own = result["mlflow_run_id"] == run_id
    result["mlflow_run"] = "checkpoint's run" if own else "new run"
    if result.get("mlflow_note"):
        log(f"eval: {result['mlflow_note']}")
    which = "the checkpoint's training run" if own else f"a new run named {tags['run_name']}"
    log(
        f"eval: logged to MLflow run {result['mlflow_run_id']} ({which}), experiment {cfg.logging.experiment}, at {uri}"
    )


def _out_dir(cfg: Config, name: str) -> Path:
    """eval.out_dir, else out/eval/<name, / as _>/<timestamp> (EVAL_ROOT: where `tlf export` looks)."""
    if cfg.eval.out_dir:
        return Path(cfg.eval.out_dir)
    return EVAL_ROOT / name.replace("/", "_") / time.strftime("%Y%m%d-%H%M%S")


def _header(checkpoint, export: Path, cfg: Config, model, dev: str, inp: _Inputs, trained_as: str | None) -> dict:
    """The results' description of what was evaluated, how, and against which training run (run.json)."""
    ev, rec = cfg.eval, read_run_record(export)
    return {
        "checkpoint": str(Path(checkpoint)),
        "export": str(export.resolve()),  # `tlf export` finds the evaluation of a checkpoint by it
        **({"train_run_id": rec.mlflow_run_id} if rec and rec.mlflow_run_id else {}),
        **({"step": rec.step} if rec else {}),
        "config_name": cfg.name,
        "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),  # tlf compare: the newest of a budget
        "model": {
            "variant": cfg.model.variant,
            "n_layers": cfg.model.n_layers,
            "loops": cfg.model.loops,
            "router": cfg.model.router,
            "block_size": cfg.model.block_size,
            "params": model.num_params(),
            **({"trained_as": trained_as} if trained_as else {}),
        },
        "device": dev,
        "limit": ev.limit,
        "source": ev.source,
        "table_metric": ev.table_metric,
        "ppl_sets": [s.name for s in inp.streams],
        "budgets": [],
        **({"skipped_tasks": inp.skipped} if inp.skipped else {}),
    }


def measure_all(r: _Run, budgets: list[tuple[int, int]]) -> list[dict]:
    """`measure_budget` at every budget; a budget that runs as one already measured (the base model's) reuses it."""
    done: dict[int, dict] = {}
    out = []
    for m_req, m_eff in budgets:
        if m_eff in done:  # the base model: the same pass again would give the same numbers
            prev = done[m_eff]
            b = {
                "loops": m_req,
                "effective_loops": m_eff,
                **{k: prev[k] for k in ("tasks", "perplexity", "depth", "avg_acc", "latency", "levels") if k in prev},
                "timing_s": {"reused_from_loops": prev["loops"]},
            }
        else:
            b = done[m_eff] = measure_budget(r, m_req, m_eff)
        out.append(b)
    r.bar.close()
    return out


def _prepare(checkpoint, overrides, config, device, model, cfg, variant):
    """(export dir, model on its device, config, device, checkpoint's own variant when relabelled): the model
    loaded (unless given) from anything `pipeline.hf.load.model_dir` accepts, checked and placed."""
    export = model_dir(checkpoint)
    if model is None or cfg is None:
        model, cfg = load_any(export, "cpu", list(overrides))
    check_config(cfg, config)
    trained_as = relabel(cfg, variant)
    dev = pick_device(cfg, device)
    for n in cfg.eval.tasks:
        spec(n)  # unknown task names fail before anything runs
    if cfg.eval.mlflow:  # a dead or refusing server: one line now (TrackingError), not after the whole evaluation
        tracking.checked_client(cfg.logging.tracking_uri)
    return export, model.to(dev).eval(), cfg, dev, trained_as


def run(
    checkpoint: str | Path,
    overrides: list[str] | tuple = (),
    loops=None,
    config: str | None = None,
    device: str | None = None,
    model=None,
    cfg: Config | None = None,
    variant: str | None = None,
    log=print,
    out_label: str = "eval.out_dir",
) -> results.Results:
    """Evaluates `checkpoint` (export, checkpoint or run dir, or tlf's transformers export). `overrides` are
    `section.key=value` strings applied to the checkpoint's config (e.g. eval.tasks=[copa], eval.limit=20,
    eval.source=offline); `loops` '2,4,8' or a list; `variant` labels the results as another variant of the same
    trained model (`relabel`). Returns the results (evaluation/results.py's schema, also written to
    <out_dir>/results.json); an evaluation that fails leaves no empty output directory behind. An output directory
    that cannot be written is an error before any work, naming it by `out_label` (the option that set it)."""
    t_start = time.time()
    export, model, cfg, dev, trained_as = _prepare(checkpoint, overrides, config, device, model, cfg, variant)
    name = (cfg.name or export.name) + (f"-as-{cfg.model.variant}" if trained_as else "")
    out_dir = check_writable(_out_dir(cfg, name), out_label if cfg.eval.out_dir else "eval.out_dir")
    budgets = resolve_budgets(cfg, parse_loops(loops))
    t0 = time.time()
    inp = load_inputs(cfg, log)
    log(
        f"eval: {len(inp.tasks)} tasks, {len(inp.streams)} perplexity sets loaded in {time.time() - t0:.1f}s; budgets "
        f"{[m for m, _ in budgets]} on {dev}"
    )
    estimate = estimate_line(model, cfg, inp, budgets, dev)  # before any work: what it costs, how to cut it
    if estimate:
        log(estimate)
    with new_dirs_removed_on_error(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        work = sum(len(td.examples) for td in inp.tasks.values()) + sum(inp.windows)  # per budget
        bar = Progress(work * len({m for _, m in budgets}), cfg.eval.progress)
        ev = cfg.eval
        r = _Run(model, cfg, dev, inp, Scorer(model, ev.batch_size, dev), bar, bar.say(log), out_dir)
        result: results.Results = _header(checkpoint, export, cfg, model, dev, inp, trained_as)
        if cfg.model.loops == 1 and any(m != 1 for m, _ in budgets):
            result["note"] = "base model (model.loops=1) is not looped: every budget runs its single pass"
        result["budgets"] = measure_all(r, budgets)
        result["wall_s"] = round(time.time() - t_start, 3)
        publish(result, r, export, name, trained_as, log)
    return result
