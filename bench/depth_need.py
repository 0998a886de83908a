"""Depth-need study: on a task where every scored token needs a known number of loops, does the router earn its compute?

Data: `tlf prep-data --source depth-fold` (data_prep/foldtask.py; docs/data.md "The fold task"), made once: levels 1..L of
a fold over `--symbols` symbols (`--rule`, `--typed` cells); `--layout slots` makes the documents one slot of a drawn
level each (prep-data fold_layout=slots), `--slots` of them a window.
Cases: presets of the fold scale (configs/fold/), each trained with `tlf train`'s trainer (`pipeline.train.trainer.run`
through bench/testkit.train_case, one process per case, `--jobs` at a time, one thread each) for `--steps` steps at
every seed of `--seeds`, paired by seed (the same seed gives every case the same data order, and the same initial
weights for the parts the architectures share):
- base: fold/base, the non-looped model with J L distinct layers (one pass);
- loopformer: fold/loopformer, evaluated elastically at M = 1..L (its accuracy-vs-work curve);
- t-loopformer: fold/t-loopformer, the paper's router recipe;
- t-loopformer-budget: fold/t-loopformer-budget, the budget recipe at the task's mean need;
- t-loopformer-expected: fold/t-loopformer-expected, the expected recipe with frozen exited keys and no shortcut
  terms at the task's mean need with frozen keys;
- kinds: fold/kinds, the kinds recipe on base-loop-router (docs/router.md), at that need too.
What the task decides is passed to every case over its preset: block_size, vocabulary, loops L (base: L layers) and
the router's target depth (the manifest's mean need, with frozen exited keys where the preset has them), with the
steps, seed, batch and data. `--curriculum c` trains with data.curriculum=c (levels one at a time, validated every
`--eval-every` steps), which the fold task needs.
Measured on the first `--windows` validation windows (evaluation/levels.py, the code `tlf eval` runs): answer
accuracy overall and by level at every budget M, executed work (layers per token over every token: loops x
layers per loop, so base's one pass of L layers counts L), the
level x depth table, the share of level-k answers run at depth >= k, and Spearman's rho(executed depth, level).
The value question: a routed case's accuracy at its executed work against loopformer's elastic curve
interpolated at the same work, per seed (paired), mean +- std.

    python bench/depth_need.py --levels 2 --symbols 32 --rule random --typed --layout slots --slots 2 \
        --curriculum 0.9 --eval-every 500 --batch 256 --steps 14000 --seeds 0,1,2 --cases loopformer,kinds

Writes `<out>/depth_need.json`, `<out>/depth_need_accuracy_vs_work.png`, `<out>/depth_need_level_depth.png`
(out: bench/results/depth_need).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleave import write_json  # noqa: E402  (after the sys.path lines above)
from testkit import train_case  # noqa: E402  (after the sys.path lines above)

from data_prep.foldtask import LAYOUTS, RULES  # noqa: E402

BASE = [
    "checkpoint.resume=none",
    "checkpoint.interval=0",
    "train.eval_interval=0",
    "train.device=cpu",
    "logging.mlflow=false",
    "train.log_interval=100",
]
CASES = ("base", "loopformer", "t-loopformer", "t-loopformer-budget", "t-loopformer-expected", "kinds")


def task_overrides(preset: str, task: dict, levels: int, per_window: int) -> list[str]:
    """What the task decides of a case, over its preset: the window's length, the vocabulary, the loops (base: the
    layers of its one pass) and, for a recipe with a prior over depths, its target: the task's mean need (with
    frozen exited keys where the preset has them)."""
    from pipeline.config import load_config

    cfg = load_config(preset)
    out = [
        f"model.block_size={task['doc_tokens'] * per_window}",
        f"model.vocab_size={-(-task['vocab_needed'] // 64) * 64}",
        f"model.n_layers={levels}" if cfg.model.loops == 1 else f"model.loops={levels}",
    ]
    if hasattr(cfg.objective.router, "target_depth"):
        need = task["mean_need_frozen" if cfg.model.exited_keys == "frozen" else "mean_need"]
        out.append(f"objective.router.target_depth={round(float(need), 3)}")
    return out


def _slug(label: str) -> str:
    return label.replace(" ", "_")


def prepare(
    data: Path,
    docs: int,
    levels: int = 2,
    symbols: int = 32,
    rule: str = "random",
    typed: bool = True,
    layout: str = "slots",
) -> dict:
    """The task's shards (made once with the real CLI; a rerun with the same options is a no-op)."""
    cmd = [sys.executable, "-m", "pipeline.cli", "prep-data", "--source", "depth-fold", "--out", str(data)]
    cmd += [f"depth_docs={docs}", f"depth_levels={levels}", "seed=0", "--no-progress"]
    cmd += [f"fold_symbols={symbols}", f"fold_rule={rule}", f"fold_typed={typed}", f"fold_layout={layout}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"prep-data failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    from data_prep.foldtask import task_of

    return task_of(data)


@torch.no_grad()
def evaluate_case(ckpt: str, data: Path, windows: int) -> dict:
    """evaluation/levels.py at every budget M = 1..L: {M: Levels}."""
    from evaluation.levels import level_scores
    from pipeline.model.io import load_model

    model, cfg = load_model(ckpt)
    model.eval()
    out = {
        M: level_scores(model, str(data), M, max_windows=windows, batch_size=32) for M in range(1, cfg.model.loops + 1)
    }
    for lv in out.values():  # compute in layers per token: base runs J L layers in its one loop
        lv["layer_work"] = lv["work"] * cfg.model.n_layers
    return out


def on_curve(curve: dict, work: float) -> float:
    """Loopformer's elastic accuracy (M = 1..L at work M, in layers per token) at `work`."""
    from evaluation.levels import accuracy_at_work

    return accuracy_at_work([(c["layer_work"], c["accuracy"]) for c in curve.values()], work)


def ms(values) -> dict | None:
    """{"mean", "std", "n"} over the values given (None skipped; std None for one value), or None if none."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None, "n": int(v.size)}


def fmt(m: dict | None) -> str:
    """An `ms` summary as the tables print it: "mean ± std", the mean alone for one seed, "–" for none."""
    if m is None:
        return "–"
    return f"{m['mean']:.3f}" if m["std"] is None else f"{m['mean']:.3f} ± {m['std']:.3f}"


def routed(label: str) -> bool:
    """Whether a case's model has a router (every case but the base and loopformer baselines)."""
    return label not in ("base", "loopformer")


def summarise(res: dict) -> None:
    """Per case: the mean +- std over seeds of every reported number; paired deltas against loopformer."""
    L = res["loops"]
    lf = res["cases"].get("loopformer")
    for label, c in res["cases"].items():
        seeds = c["seeds"]
        full = [s["levels"][L] for s in seeds.values()]
        c["summary"] = {
            "accuracy_at_L": ms(f["accuracy"] for f in full),
            "accuracy_by_level_at_L": {k: ms(f["accuracy_by_level"].get(k) for f in full) for k in range(1, L + 1)},
            "work_at_L": ms(f["layer_work"] for f in full),
            "spearman_at_L": ms(f["spearman"] for f in full),
            "depth_ge_level_at_L": {k: ms(f["depth_ge_level"].get(k) for f in full) for k in range(1, L + 1)},
            "accuracy_by_budget": {M: ms(s["levels"][M]["accuracy"] for s in seeds.values()) for M in range(1, L + 1)},
            "level_depth_at_L": np.sum([f["level_depth"] for f in full], axis=0).tolist(),
        }
        if lf is not None and routed(label):
            deltas = []
            for seed, s in seeds.items():
                if seed in lf["seeds"]:
                    curve = lf["seeds"][seed]["levels"]
                    at = on_curve(curve, s["levels"][L]["layer_work"])
                    s["loopformer_at_work"] = at
                    s["delta_vs_loopformer"] = s["levels"][L]["accuracy"] - at
                    deltas.append(s["delta_vs_loopformer"])
            c["summary"]["loopformer_at_work"] = ms(s.get("loopformer_at_work") for s in seeds.values())
            c["summary"]["delta_vs_loopformer"] = ms(deltas)
            if len(deltas) > 1:
                acc_std = np.std([f["accuracy"] for f in full], ddof=1)
                c["summary"]["delta_over_3_std"] = bool(np.mean(deltas) > 3 * acc_std)


def table(res: dict) -> str:
    L = res["loops"]
    head = (
        "| case | acc at M=L | "
        + " | ".join(f"level {k}" for k in range(1, L + 1))
        + " | work (layers/token) | ρ(depth, level) | loopformer at that work | Δ (paired) |"
    )
    lines = [head, "|" + "---|" * (7 + L - 1)]
    for label, c in res["cases"].items():
        s = c["summary"]
        lines.append(
            f"| {label} | {fmt(s['accuracy_at_L'])} | "
            + " | ".join(fmt(s["accuracy_by_level_at_L"][k]) for k in range(1, L + 1))
            + f" | {fmt(s['work_at_L'])} | {fmt(s['spearman_at_L'])} | {fmt(s.get('loopformer_at_work'))} | "
            f"{fmt(s.get('delta_vs_loopformer'))} |"
        )
    return "\n".join(lines)


def elastic_table(res: dict) -> str:
    L = res["loops"]
    lines = ["| case | " + " | ".join(f"M={M}" for M in range(1, L + 1)) + " |", "|" + "---|" * (L + 1)]
    for label, c in res["cases"].items():
        if label == "base":
            continue
        lines.append(
            f"| {label} | " + " | ".join(fmt(c["summary"]["accuracy_by_budget"][M]) for M in range(1, L + 1)) + " |"
        )
    return "\n".join(lines)


def level_depth_text(label: str, c: dict, L: int) -> str:
    """The level x depth table (answers at M = L, summed over seeds), rows in % of the level's answers."""
    from evaluation.levels import level_depth_lines

    head = f"{label}: level x executed depth at M={L} (% of the level's answers; summed over seeds)"
    return "\n".join([head, *level_depth_lines(c["summary"]["level_depth_at_L"], "  ")])


def figures(res: dict, out: Path) -> list[Path]:
    from evaluation.figures import pyplot, save

    plt, L, paths = pyplot(), res["loops"], []
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in res["cases"].items():
        pts = {
            M: [(s["levels"][M]["layer_work"], s["levels"][M]["accuracy"]) for s in c["seeds"].values()]
            for M in range(1, L + 1)
        }
        Ms = [L] if routed(label) or label == "base" else list(range(1, L + 1))
        xs = [np.mean([p[0] for p in pts[M]]) for M in Ms]
        ys = [np.mean([p[1] for p in pts[M]]) for M in Ms]
        es = [np.std([p[1] for p in pts[M]], ddof=1) if len(pts[M]) > 1 else 0.0 for M in Ms]
        ax.errorbar(
            xs,
            ys,
            yerr=es,
            marker="o" if len(Ms) > 1 else "*",
            ms=5 if len(Ms) > 1 else 12,
            capsize=3,
            lw=1.2,
            label=label,
        )
    ax.set_xlabel("executed work (layers per token over every token; one layer per loop)")
    ax.set_ylabel("answer accuracy")
    ax.set_title(f"depth-{res['task'].get('kind', 'hops')}: accuracy vs loop work (mean ± std over seeds)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(save(fig, out / "depth_need_accuracy_vs_work.png"))
    with_router = [k for k in res["cases"] if routed(k)]
    if with_router:
        fig, axes = plt.subplots(1, len(with_router), figsize=(3.4 * len(with_router), 3.2), squeeze=False)
        for ax, label in zip(axes[0], with_router):
            t = np.asarray(res["cases"][label]["summary"]["level_depth_at_L"], dtype=float)
            ax.imshow(t / np.maximum(t.sum(1, keepdims=True), 1), vmin=0, vmax=1, cmap="Blues")
            ax.set_xticks(range(L), [str(d) for d in range(1, L + 1)])
            ax.set_yticks(range(L), [str(k) for k in range(1, L + 1)])
            ax.set_xlabel("executed depth")
            ax.set_ylabel("level d*")
            ax.set_title(label, fontsize=8)
        paths.append(save(fig, out / "depth_need_level_depth.png"))
    return paths


def _int_keys(d):
    """A JSON-read study's dicts keyed by seed, budget or level back to int keys (recursively)."""
    if isinstance(d, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in d.items()}
    return [_int_keys(v) for v in d] if isinstance(d, list) else d


def merge(res: dict, path: str) -> None:
    """Adds to res the cases of the study at path that res does not hold, ahead of its own; the task, steps,
    documents per step, seeds and windows must match (an error names the first that does not)."""
    import json

    old = json.loads(Path(path).read_text())
    for key in ("task", "steps", "documents_per_step", "seeds", "windows"):
        if old.get(key) != res[key]:
            sys.exit(f"--merge {path}: its {key} {old.get(key)!r} differs from this study's {res[key]!r}")
    earlier = {
        label: {k: _int_keys(v) for k, v in c.items() if k != "summary"}
        for label, c in old["cases"].items()
        if label not in res["cases"]
    }
    res["cases"] = {**earlier, **res["cases"]}  # the earlier study's order, then the cases run now
    res["merged_from"] = str(path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000, help="training steps per case")
    ap.add_argument("--batch", type=int, default=256, help="windows per step (each a document, or --slots of them)")
    ap.add_argument("--levels", type=int, default=2, help="task levels 1..L = the models' loops L (base: L layers)")
    ap.add_argument("--symbols", type=int, default=32, help="symbols m of the folded operation")
    ap.add_argument("--rule", choices=RULES, default="random", help="how g is drawn (prep-data fold_rule)")
    ap.add_argument(
        "--typed", action=argparse.BooleanOptionalAction, default=True, help="typed cells (prep-data fold_typed)"
    )
    ap.add_argument("--layout", choices=LAYOUTS, default="slots", help="documents' layout (prep-data fold_layout)")
    ap.add_argument(
        "--slots", type=int, default=2, help="--layout slots: slots (documents) per window, levels drawn per slot"
    )
    ap.add_argument("--curriculum", type=float, default=0.0, help="data.curriculum (0: off)")
    ap.add_argument("--eval-every", type=int, default=250, help="with --curriculum: train.eval_interval")
    ap.add_argument("--lr", type=float, default=0.0, help="optim.lr (0: the preset's)")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (comma-separated); cases are paired by seed")
    ap.add_argument("--cases", default="", help=f"only these cases (comma-separated; default all: {', '.join(CASES)})")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained at once (one thread each)")
    ap.add_argument(
        "--windows", type=int, default=512, help="validation windows measured (each a document, or --slots of them)"
    )
    ap.add_argument("--out", default="bench/results/depth_need")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="evaluate a case whose checkpoint dir under --out holds a finished run of the same preset and "
        "overrides instead of training it again (a study stopped half-way, or a case added to one)",
    )
    ap.add_argument(
        "--merge",
        metavar="JSON",
        help="an earlier study's depth_need.json of the same task, steps, batch and seeds: its cases not run now "
        "join the table and figures (a case run apart, e.g. on another machine)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every case, after the others (repeatable; e.g. model.d_ff=64)",
    )
    return ap.parse_args(argv)


def make_specs(a: argparse.Namespace, task: dict, data: Path, out: Path, per_window: int) -> dict:
    """{(case, seed): train_case's spec}: each case's preset with the task's and the run's overrides."""
    chosen = list(CASES)
    if a.cases:
        chosen = [c.strip() for c in a.cases.split(",")]
        unknown = [c for c in chosen if c not in CASES]
        if unknown:
            sys.exit(f"--cases: unknown {unknown}; known: {list(CASES)}")
    run = [o for o in BASE if not (a.curriculum and o.startswith("train.eval_interval"))]
    run += [f"optim.lr={a.lr}"] if a.lr else []
    if a.curriculum:
        run += [f"data.curriculum={a.curriculum}", f"train.eval_interval={a.eval_every}", "train.eval_batches=4"]
    run += [f"schedule.max_steps={a.steps}", f"data.dir={data}"]
    run += [f"train.micro_batch_size={a.batch}", f"train.global_batch_size={a.batch}"]
    specs = {}
    for label in chosen:
        preset = f"fold/{label}"
        ov = run + task_overrides(preset, task, a.levels, per_window) + a.set
        for s in [int(s) for s in a.seeds.split(",") if s.strip()]:
            ck = out / "checkpoints" / f"{_slug(label)}_s{s}"
            specs[(label, s)] = {
                "preset": preset,
                "overrides": ov + [f"train.seed={s}", f"checkpoint.dir={ck}"],
                "reuse": a.reuse,
            }
    return specs


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    fold = (
        f"data_fold_m{a.symbols}_L{a.levels}"
        + ("" if a.rule == RULES[0] else f"_{a.rule}")
        + ("_typed" if a.typed else "")
        + ("" if a.layout == LAYOUTS[0] else f"_{a.layout}")
    )
    per_window = a.slots if a.layout == "slots" else 1  # documents per window
    data = out / fold
    docs = (a.steps * a.batch + 20 * a.windows) * per_window
    task = prepare(data, docs, a.levels, a.symbols, a.rule, a.typed, a.layout)
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    specs = make_specs(a, task, data, out, per_window)
    need = round(float(task["mean_need"]), 3)
    t0 = time.time()
    print(
        f"depth-need study: {len(specs) // len(seeds)} cases x {len(seeds)} seeds x {a.steps} steps, {a.jobs} at a "
        f"time; task mean need {need} loops per token -> {out}",
        flush=True,
    )
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        trained = dict(zip(specs, pool.map(train_case, list(specs.values()), chunksize=1)))
    t_train = time.time() - t0
    reused = [f"{label} s{s}" for (label, s), tr in trained.items() if tr.get("reused")]
    if reused:
        print(f"reused {len(reused)} finished runs (--reuse): {', '.join(reused)}", flush=True)
    res = {
        "command": "python bench/depth_need.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": a.steps,
        "documents_per_step": a.batch * per_window,
        "seeds": seeds,
        "task": task,
        "mean_need": need,
        "windows": a.windows,
        "train_wall_s": t_train,
        "cases": {},
    }
    for (label, s), tr in trained.items():
        c = res["cases"].setdefault(label, {"preset": specs[(label, s)]["preset"], "seeds": {}})
        c["overrides"] = [
            o for o in specs[(label, s)]["overrides"] if not o.startswith(("train.seed", "checkpoint.dir"))
        ]
        c["seeds"][s] = {**tr, "levels": evaluate_case(tr["dir"], data, a.windows)}
    if a.merge:
        merge(res, a.merge)
    res["loops"] = L = max(len(c["seeds"][seeds[0]]["levels"]) for c in res["cases"].values())
    for c in res["cases"].values():  # base (L = 1): its single pass stands for every budget
        for s in c["seeds"].values():
            s["levels"] = {M: s["levels"].get(M, s["levels"][max(s["levels"])]) for M in range(1, L + 1)}
    summarise(res)
    res["wall_s"] = time.time() - t0
    res["table"], res["elastic_table"] = table(res), elastic_table(res)
    res["level_depth_text"] = "\n\n".join(level_depth_text(k, c, L) for k, c in res["cases"].items() if routed(k))
    for p in figures(res, out):
        print(f"wrote {p}")
    write_json(out / "depth_need.json", res)
    print(res["table"])
    print("\nanswer accuracy at every budget M (mean ± std over seeds):")
    print(res["elastic_table"])
    print()
    print(res["level_depth_text"])
    print(f"\nstudy took {res['wall_s'] / 60:.1f} min (training {t_train / 60:.1f} min)")
    return res


if __name__ == "__main__":
    main()
