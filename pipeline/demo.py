"""`make demo`: the whole pipeline on the embedded offline default, in minutes on 2 CPU cores.

    data (demo corpus -> shards) -> train small base-loop, loopformer, t-loopformer -> eval -> compare

`make demo-fold` (`--fold`) runs the same plan on the fold task (docs/data.md), whose every answer needs a known
number of loops: data (the fold task) -> train fold loopformer, t-loopformer -> eval by level -> compare at equal
work. `tlf eval` scores it by level with the level x executed-depth table, and `tlf compare`'s Table 4 sets
t-loopformer's accuracy against loopformer's elastic curve at the same executed loop work.

Every stage is the `tlf` command a user would type (printed before it runs); the train -> eval -> compare
stages are `pipeline/orchestrate.py`'s, the same plan `tlf sweep` runs, with the demo's own settings.
Everything the demo writes lives under `runs/demo/` (MLflow store, checkpoints, evaluation and comparison
outputs; the fold task's under `runs/demo/fold/`, with a store of its own) and `data/`.
Options: `python -m pipeline.demo --help` (more variants, steps, task limit).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from pipeline import orchestrate

DEFAULT_VARIANTS = ("base-loop", "loopformer", "t-loopformer")
# The demo's t-loopformer trains with the budget router recipe (docs/router.md; target depth 2.5 of 4):
# the paper's recipe sends every token to one depth for the first ~100 steps, so an 80-step demo would show a single
# bar. The fold part's t-loopformer trains with the expected recipe (frozen exited keys, no shortcut terms).
PRESETS = {"t-loopformer": "small/t-loopformer-budget"}
FOLD_PRESETS = {"t-loopformer": "fold/t-loopformer-expected"}
# The fold part: levels 1..2 of a fold over 8 symbols (9-token documents), 128 documents a step, on the fold scale
# (its optimiser: what the depth tasks need to be learnt at all), the router's prior at this task's mean need.
FOLD_LEVELS, FOLD_SYMBOLS, FOLD_BATCH = 2, 8, 128
DEMO_TASKS = (
    "copa",
    "hellaswag",
    "lambada_openai",
    "openbookqa",
    "piqa",
    "sciq",
    "arc_challenge",
    "social_iqa",
    "arc_easy",
)  # RACE has no offline copy: it needs --race-file (see README)


def variants_of(a: argparse.Namespace) -> list[str]:
    return [v.strip() for v in a.variants.split(",") if v.strip()]


def plan(a: argparse.Namespace, work: Path, uri: str) -> list[orchestrate.Stage]:
    """The demo's stages: the two data sets, then the orchestrator's train -> eval -> compare for `a.variants`."""
    common = [f"logging.tracking_uri={uri}", "logging.experiment=demo"]
    data = [
        orchestrate.Stage(
            "data: demo corpus (State of the Union + Moby-Dick) -> GPT-2 shards",
            ["prep-data", "--source", "demo", "--out", "data/demo", "--no-progress"],
        ),
        orchestrate.Stage(
            "data: enwiki sample -> second-domain validation shards",
            ["prep-data", "--source", "demo-enwiki", "--out", "data/demo-enwiki", "--no-progress"],
        ),
    ]
    train = lambda v: [
        f"schedule.max_steps={a.steps}",
        "checkpoint.resume=none",
        f"checkpoint.interval={a.steps}",
        "train.eval_batches=4",  # 4 x 512 tokens per validation set
        "data.extra_val_dirs=[data/demo-enwiki]",
        "train.eval_interval=50",
        *common,
    ]
    ev = [
        "--loops",
        a.loops,
        "--limit",
        str(a.limit),
        "--tasks",
        ",".join(DEMO_TASKS),
        "--ppl-tokens",
        str(a.ppl_tokens),
        "eval.ppl_dirs=[data/demo,data/demo-enwiki]",
        *common,
    ]
    cmp = ["--tracking-uri", uri, "--experiment", "demo", "--out", str(work / "compare")]
    return data + orchestrate.variant_stages("small", variants_of(a), str(work), train, ev, cmp, presets=PRESETS)


def fold_plan(a: argparse.Namespace, out: Path, uri: str) -> list[orchestrate.Stage]:
    """The fold part's stages: the task's shards, then the orchestrator's train -> eval -> compare for fold
    loopformer and t-loopformer into `out` (its own MLflow experiment, so compare never mixes them with the text
    models)."""
    from data_prep import foldtask

    L, data = FOLD_LEVELS, "data/demo-fold"
    need = float(foldtask.need(L, visible=True).mean())  # the oracle's mean depth with frozen exited keys
    docs = a.fold_steps * FOLD_BATCH * 20 // 19 + 20  # every training document seen once (1 in 20 is val)
    common = [f"logging.tracking_uri={uri}", "logging.experiment=demo-fold"]
    prep = orchestrate.Stage(
        f"data: the fold task (levels 1..{L}: an answer of level k needs k loops) -> shards",
        ["prep-data", "--source", "depth-fold", "--out", data, f"depth_levels={L}", f"fold_symbols={FOLD_SYMBOLS}"]
        + [f"depth_docs={docs}", "seed=0", "--no-progress"],
    )
    train = lambda v: [
        f"data.dir={data}",
        f"model.block_size={foldtask.doc_length(L)}",
        f"model.loops={L}",
        f"schedule.max_steps={a.fold_steps}",
        f"train.micro_batch_size={FOLD_BATCH}",
        f"train.global_batch_size={FOLD_BATCH}",
        "checkpoint.resume=none",
        f"checkpoint.interval={a.fold_steps}",
        *([f"objective.router.target_depth={need:.4f}"] if v == "t-loopformer" else []),
        *common,
    ]
    budgets = ",".join(str(M) for M in range(1, L + 1))
    ev = ["--loops", budgets, "eval.tasks=[]", "eval.perplexity=false", "eval.latency=false", *common]
    cmp = ["--tracking-uri", uri, "--experiment", "demo-fold", "--out", str(out / "compare")]
    variants = ["loopformer", "t-loopformer"]
    return [prep] + orchestrate.variant_stages("fold", variants, str(out), train, ev, cmp, presets=FOLD_PRESETS)


def _announce(st: orchestrate.Stage) -> None:
    print(f"\n=== {st.title}\n$ {st.shell()}", flush=True)


def _fail(st: orchestrate.Stage, code: int) -> None:
    sys.exit(f"demo: stage '{st.title}' failed (exit {code}); command: {st.shell()}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="small/<variant> presets to train")
    ap.add_argument("--steps", type=int, default=80, help="training steps per variant")
    ap.add_argument("--limit", type=int, default=40, help="examples per zero-shot task")
    ap.add_argument("--loops", default="1,2,4", help="loop budgets to evaluate")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="validation tokens scored per set")
    ap.add_argument("--fold", action="store_true", help="run the fold task's plan instead (make demo-fold)")
    ap.add_argument("--fold-steps", type=int, default=1500, help="training steps per model on the fold task")
    ap.add_argument("--work", default="runs/demo")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    t_start = time.time()
    work = Path(a.work).resolve()
    out = work / "fold" if a.fold else work  # what this run writes (the fold task's plan: its own MLflow store)
    if out.exists():
        shutil.rmtree(out)  # the demo's own directory: every number printed is measured in this run
    out.mkdir(parents=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    from pipeline.train.ds import extensions_dir

    extensions_dir()  # the demo's ranks inherit it: DeepSpeed's shm op is built once per virtualenv
    log = orchestrate.run((fold_plan if a.fold else plan)(a, out, uri), _announce, _fail)
    wall = time.time() - t_start
    if not a.fold:
        for v in variants_of(a):
            results = work / "eval" / v / "results.json"
            summary = depth_summary(results) if results.is_file() else None
            if summary:
                print(summary)
    print("\n=== demo finished in " + f"{wall / 60:.1f} min: " + ", ".join(f"{t} {dt:.0f}s" for t, dt in log))
    _where(a, out, uri)


def _where(a: argparse.Namespace, out: Path, uri: str) -> None:
    """The closing lines: where the outputs in `out` are, and (text part) the fold task's command."""
    if a.fold:
        print(f"fold task comparison (Table 4: accuracy at equal loop work; level x depth): {out / 'compare'}")
    else:
        print(f"comparison (markdown, CSV, PNG): {out / 'compare'}")
        for p in sorted((out / "compare").glob("*.png")):
            print(f"  plot: {p}")
        print(f"evaluation outputs: {out / 'eval'}")
    print(f"MLflow store: {uri}")
    ui = f".venv/bin/mlflow ui --backend-store-uri {uri} --port 5000"
    print(f"browse it:    make setup && {ui}  # make setup adds MLflow's UI to the demo's packages")
    page = _experiment_page(uri, "demo-fold" if a.fold else "demo")
    if page:
        print(f"then open:    {page}")
    if not a.fold:
        print("the same plan on the fold task, where an answer of level k needs k loops: make demo-fold")


def _experiment_page(uri: str, experiment: str) -> str | None:
    """The demo's experiment in `mlflow ui` on port 5000, opened on its runs' charts through tlf's saved view (the
    headline charts first: `tracking.ui_link(view=True)`); None when the store cannot be read."""
    from pipeline import tracking

    try:
        exp = tracking.checked_client(uri).get_experiment_by_name(experiment)
    except Exception:  # noqa: BLE001 - a closing line only
        return None
    return tracking.ui_link("http://127.0.0.1:5000", exp.experiment_id, view=True) if exp is not None else None


def depth_summary(results: Path) -> str | None:
    """The depth distribution at the largest evaluated budget of a router variant and the loop work it cost
    (sum_i |A_i| / (M * tokens) = mean depth / M), from `tlf eval`'s results.json; None without a router."""
    from data_prep.files import read_json

    res = read_json(results, dict)
    if not res["model"]["router"]:
        return None
    b = max((b for b in res["budgets"] if b.get("depth")), key=lambda b: b["effective_loops"], default=None)
    if b is None:
        return None
    d, M = b["depth"], b["effective_loops"]
    shares = ", ".join(f"depth {i}: {100 * s:.1f}%" for i, s in enumerate(d["share"], 1))
    return (
        f"\n=== {res['model']['variant']} depth on {d['set']} at M={M}: {shares}; mean depth {d['mean']:.2f} -> "
        f"loop work {d['mean'] / M:.2f} of the dense {M} loops\n    chart: {d.get('chart', '')}"
    )


if __name__ == "__main__":
    main()
