"""Router study: does the token-choice router earn its compute?

Trains, at each of `--seeds` (paired: every case sees the same data order at a seed), with the same data and steps (the project's trainer, `pipeline.train.trainer.run`, one process
per case, `--jobs` at a time), small/loopformer and t-loopformer under each router recipe: the paper's
(small/t-loopformer) and the budget recipe (small/t-loopformer-budget) at each `--targets` mean depth. Then, on the first
`--val-tokens` validation tokens of the demo corpus, it measures for every case:

- depth shares over training (the trainer's per-step `router/full/depth_share_<i>` of the training batches,
  averaged over the `--window` steps ending at each reported step; read back from the case's MLflow store);
- at M = L: the share of tokens at / reaching each depth, mean depth against its target, executed loop work
  sum_i |A_i| / (L * T) = mean depth / L, and how depth depends on the token: the entropy of depth, its
  entropy given the token id (and the share of depth entropy the token id explains), the token ids (seen at
  least twice) that occur at more than one depth, and the Spearman correlation of depth with the token's
  log frequency in the training split;
- validation loss at every budget M = 1..L for both models, with the loop work of each, so t-loopformer's
  loss at its executed work is read against loopformer's elastic curve (linear interpolation in work).

    python bench/router.py                       # default size: 500 steps x 4 cases x 3 seeds, 2 jobs
    python bench/router.py --steps 120 --seeds 1337 --jobs 1  # quicker look

Writes `<out>/router.json`, `<out>/router_depth_over_training.png`, `<out>/router_loss_vs_work.png` and
`<out>/router_depth_final.png` (out: bench/results/router).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleave import write_json
from testkit import train_case

BASE = [
    "schedule.warmup_steps=50",
    "checkpoint.resume=none",
    "checkpoint.interval=0",
    "train.eval_interval=0",
    "train.device=cpu",
    "logging.experiment=router",
]


def cases(targets: list[float]) -> dict[str, tuple[str, list[str]]]:
    """label -> (preset, overrides) of every case of the study."""
    out = {
        "loopformer": ("small/loopformer", []),
        "t-loopformer paper": ("small/t-loopformer", []),
    }
    for t in targets:
        out[f"t-loopformer budget {t:g}"] = ("small/t-loopformer-budget", [f"objective.router.target_depth={t}"])
    return out


def _slug(label: str) -> str:
    return label.replace(" ", "_")


# ------------------------------------------------------------------------------------------- measuring
def depth_history(uri: str, run_id: str, L: int, steps: int, window: int, points: list[int]) -> dict:
    """Mean per-step training-batch depth shares over the `window` steps ending at each of `points`."""
    from pipeline import tracking

    client = tracking.client(uri)
    hist = np.zeros((steps + 1, L))
    for i in range(1, L + 1):
        for m in client.get_metric_history(run_id, f"router/full/depth_share_{i}"):
            if m.step <= steps:
                hist[m.step, i - 1] = m.value
    rows = {}
    for p in points:
        lo = max(1, p - window + 1)
        share = hist[lo : p + 1].mean(0)
        rows[p] = {"share": share.tolist(), "mean_depth": float((share * np.arange(1, L + 1)).sum())}
    return rows


@torch.no_grad()
def evaluate_case(model, loader_batches, L: int) -> dict:
    """Validation loss and depth at every budget M = 1..L, and the per-token depths and ids at M = L."""
    model.eval()
    per_m, ids, depths = {}, [], []
    for M in range(1, L + 1):
        tot, n, dsum = 0.0, 0, 0
        for x, y in loader_batches:
            out = model(x, loops=M)
            tot += float(F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-1)) * y.numel()
            n += y.numel()
            dsum += int(out.depth.sum())
            if M == L:
                ids.append(x.reshape(-1))
                depths.append(out.depth.reshape(-1))
        per_m[M] = {"val_loss": tot / n, "mean_depth": dsum / n, "loop_work": dsum / (n * L)}
    return {"per_budget": per_m, "ids": torch.cat(ids).numpy(), "depth": torch.cat(depths).numpy()}


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    def rank(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for u in np.unique(v):  # average ranks of ties
            m = v == u
            r[m] = r[m].mean()
        return r

    ra, rb = rank(a), rank(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def token_dependence(ids: np.ndarray, depth: np.ndarray, train_counts: np.ndarray, L: int) -> dict:
    """How depth depends on the token id (see the module doc)."""
    h = _entropy(np.bincount(depth - 1, minlength=L))
    uniq, inv, cnt = np.unique(ids, return_inverse=True, return_counts=True)
    joint = np.zeros((len(uniq), L))
    np.add.at(joint, (inv, depth - 1), 1)
    h_cond = float(sum(c * _entropy(row) for row, c in zip(joint, cnt)) / cnt.sum())
    seen2 = cnt >= 2
    multi = (joint[seen2] > 0).sum(1) > 1
    logf = np.log(train_counts[ids] + 1.0)
    return {
        "depth_entropy_bits": h,
        "depth_entropy_given_token_bits": h_cond,
        "entropy_explained_by_token": (1 - h_cond / h) if h > 0 else float("nan"),
        "token_ids_seen_twice": int(seen2.sum()),
        "token_ids_at_more_than_one_depth": int(multi.sum()),
        "spearman_depth_vs_log_train_freq": _spearman(depth.astype(float), logf),
    }


def interp_loss(curve: dict, L: int, work: float) -> float:
    """Loopformer's elastic curve (loss at work M / L for M = 1..L), linearly interpolated at `work`
    (clamped to its ends)."""
    xs = [m / L for m in range(1, L + 1)]
    ys = [curve[m]["val_loss"] for m in range(1, L + 1)]
    return float(np.interp(work, xs, ys))


# ----------------------------------------------------------------------------------------------- output
def figures(res: dict, out: Path, L: int) -> list[Path]:
    from evaluation.figures import pyplot, save

    plt = pyplot()
    routed = [k for k in res["cases"] if k != "loopformer"]
    paths = []
    fig, axes = plt.subplots(1, len(routed), figsize=(3.6 * len(routed), 3.2), sharey=True, squeeze=False)
    for ax, label in zip(axes[0], routed):
        hist = res["cases"][label]["depth_over_training"]
        steps = [int(s) for s in hist]
        shares = np.array([hist[s]["share"] for s in hist]) * 100
        ax.stackplot(steps, shares.T, labels=[f"depth {i}" for i in range(1, L + 1)])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(0, 100)
    axes[0][0].set_ylabel("training tokens (%)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    paths.append(save(fig, out / "router_depth_over_training.png"))

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for label, c in res["cases"].items():
        pts = sorted(c["per_budget"].items(), key=lambda kv: int(kv[0]))
        ax.plot(
            [p["loop_work"] for _, p in pts],
            [p["val_loss"] for _, p in pts],
            "o-" if label == "loopformer" else "s--",
            ms=4,
            lw=1.2,
            label=f"{label} (M=1..{L})",
        )
        full = c["per_budget"][str(L)] if str(L) in c["per_budget"] else c["per_budget"][L]
        if label != "loopformer":
            ax.plot([full["loop_work"]], [full["val_loss"]], "*", ms=11, color=ax.lines[-1].get_color())
    ax.set_xlabel("executed loop work  sum|A_i| / (L T)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    ax.set_title("validation loss against executed loop work (star: t-loopformer at M = L)", fontsize=8)
    paths.append(save(fig, out / "router_loss_vs_work.png"))

    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    w = 0.8 / len(routed)
    for k, label in enumerate(routed):
        share = np.array(res["cases"][label]["final"]["depth_share"]) * 100
        ax.bar(np.arange(1, L + 1) + (k - (len(routed) - 1) / 2) * w, share, width=w, label=label)
    ax.set_xlabel("depth (loops executed)")
    ax.set_ylabel("validation tokens (%)")
    ax.set_xticks(range(1, L + 1))
    ax.legend(fontsize=7)
    paths.append(save(fig, out / "router_depth_final.png"))
    return paths


def table(res: dict, L: int) -> str:
    lines = [
        "| case | " + " / ".join(f"d{i}" for i in range(1, L + 1)) + " (% tokens) | mean depth (target) | loop work | "
        "val loss at M=L | loopformer at that work | Δ | H(depth \\| token) / H(depth) bits | ids >1 depth | "
        "ρ(depth, log freq) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, c in res["cases"].items():
        f = c["final"]
        td = f.get("token_dependence")
        tgt = f" ({c['target_depth']:g})" if c.get("target_depth") else ""
        dep = (
            (
                f"{td['depth_entropy_given_token_bits']:.2f} / {td['depth_entropy_bits']:.2f}",
                f"{td['token_ids_at_more_than_one_depth']} of {td['token_ids_seen_twice']}",
                f"{td['spearman_depth_vs_log_train_freq']:+.2f}",
            )
            if td
            else ("–", "–", "–")
        )
        lf = f"{f['loopformer_loss_at_work']:.4f}" if "loopformer_loss_at_work" in f else "–"
        delta = f"{f['delta_vs_loopformer']:+.4f}" if "delta_vs_loopformer" in f else "–"
        lines.append(
            f"| {label} | {' / '.join(f'{100 * s:.0f}' for s in f['depth_share'])} | {f['mean_depth']:.2f}{tgt} "
            f"| {f['loop_work']:.3f} | {f['val_loss']:.4f} | {lf} | {delta} | {dep[0]} | {dep[1]} | {dep[2]} |"
        )
    return "\n".join(lines)


def measure_seed(
    trained: dict, specs: dict, batches: list, counts: np.ndarray, L: int, steps: int, window: int, points: list[int]
) -> dict:
    """Every case of one seed: the per-case dict the tables and figures read."""
    from pipeline.model.io import load_model
    from pipeline.train.recipes import target_depth

    cases_out = {}
    for label, tr in trained.items():
        model, cfg = load_model(tr["dir"])
        ev = evaluate_case(model, batches, L)
        ids, depth = ev.pop("ids"), ev.pop("depth")
        share = np.bincount(depth - 1, minlength=L) / len(depth)
        c = {
            "preset": specs[label]["preset"],
            "overrides": specs[label]["overrides"],
            **tr,
            "per_budget": ev["per_budget"],
            "final": {
                "depth_share": share.tolist(),
                "reach_share": [float((depth >= i).mean()) for i in range(1, L + 1)],
                "mean_depth": float(depth.mean()),
                "loop_work": float(depth.mean() / L),
                "val_loss": ev["per_budget"][L]["val_loss"],
            },
        }
        if cfg.model.router:
            c["recipe"] = cfg.objective.router.recipe
            if cfg.objective.router.recipe == "budget":
                target = target_depth(cfg.objective.router, cfg.model.loops)
                c["target_depth"] = target
                c["final"]["depth_vs_target"] = float(depth.mean() / target - 1)
            c["final"]["token_dependence"] = token_dependence(ids, depth, counts, L)
            c["depth_over_training"] = depth_history(tr["uri"], tr["run_id"], L, steps, window, points)
        cases_out[label] = c
    lf = cases_out["loopformer"]["per_budget"]
    for label, c in cases_out.items():
        if label != "loopformer":
            at = interp_loss(lf, L, c["final"]["loop_work"])
            c["final"]["loopformer_loss_at_work"] = at
            c["final"]["delta_vs_loopformer"] = c["final"]["val_loss"] - at
    return cases_out


def _ms(v) -> str:
    v = np.asarray(v, dtype=float)
    return f"{v.mean():.4f} ± {v.std(ddof=1):.4f}" if v.size > 1 else f"{v.mean():.4f}"


def seed_summary(per_seed: dict, L: int) -> tuple[dict, str, str]:
    """Mean ± std over seeds per case (the deltas are paired: each seed's t-loopformer against that seed's
    loopformer curve), as a dict and two markdown tables."""
    labels = list(next(iter(per_seed.values())))
    summ = {}
    for label in labels:
        cs = [per_seed[s][label] for s in per_seed]
        f = [c["final"] for c in cs]
        summ[label] = {
            "val_loss": [x["val_loss"] for x in f],
            "mean_depth": [x["mean_depth"] for x in f],
            "loop_work": [x["loop_work"] for x in f],
            "delta_vs_loopformer": [x["delta_vs_loopformer"] for x in f if "delta_vs_loopformer" in x],
            "per_budget": {M: [c["per_budget"][M]["val_loss"] for c in cs] for M in range(1, L + 1)},
        }
    lines = [
        "| case | val loss at M=L | mean depth | loop work | Δ vs loopformer at that work (paired) | seeds with Δ < 0 |",
        "|---|---|---|---|---|---|",
    ]
    for label, x in summ.items():
        d = x["delta_vs_loopformer"]
        lines.append(
            f"| {label} | {_ms(x['val_loss'])} | {_ms(x['mean_depth'])} | {_ms(x['loop_work'])} | "
            + (f"{_ms(d)} | {sum(v < 0 for v in d)} of {len(d)} |" if d else "– | – |")
        )
    el = ["| case | " + " | ".join(f"M = {M}" for M in range(1, L + 1)) + " |", "|" + "---|" * (L + 1)]
    for label, x in summ.items():
        el.append(f"| {label} | " + " | ".join(_ms(x["per_budget"][M]) for M in range(1, L + 1)) + " |")
    return summ, "\n".join(lines), "\n".join(el)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="training steps per case (512 tokens each)")
    ap.add_argument("--targets", default="2,3", help="budget recipe's target mean depths (comma-separated)")
    ap.add_argument("--jobs", type=int, default=2, help="cases trained at once (one thread each)")
    ap.add_argument("--val-tokens", type=int, default=20480, help="validation tokens measured")
    ap.add_argument("--window", type=int, default=10, help="steps averaged per point of the depth-over-training table")
    ap.add_argument(
        "--seeds",
        default="1337,1338,1339",
        help="training seeds (comma-separated): every case runs at each, deltas are paired by seed",
    )
    ap.add_argument("--data", default="data/demo", help="shards made by `tlf prep-data --source demo`")
    ap.add_argument("--out", default="bench/results/router")
    a = ap.parse_args(argv)

    torch.set_num_threads(1)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = Path(a.data).resolve()
    if not (data / "manifest.json").is_file():
        sys.exit(f"{data}: no shards; make them with `tlf prep-data --source demo --out {a.data}`")
    targets = [float(t) for t in a.targets.split(",") if t.strip()]
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    specs = {}
    for seed in seeds:
        for label, (preset, ov) in cases(targets).items():
            run = f"{_slug(label)}_s{seed}"
            specs[(seed, label)] = {
                "preset": preset,
                "overrides": BASE
                + ov
                + [
                    f"schedule.max_steps={a.steps}",
                    f"train.seed={seed}",
                    f"data.dir={data}",
                    f"checkpoint.dir={out / 'checkpoints' / run}",
                    f"logging.tracking_uri=sqlite:///{out / 'mlflow' / (run + '.db')}",
                ],
            }
    (out / "mlflow").mkdir(exist_ok=True)
    t0 = time.time()
    print(
        f"router study: {len(specs) // len(seeds)} cases x {len(seeds)} seeds x {a.steps} steps, {a.jobs} at a time "
        f"-> {out}",
        flush=True,
    )
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        trained = dict(zip(specs, pool.map(train_case, list(specs.values()), chunksize=1)))
    t_train = time.time() - t0

    from data_prep.shards import ShardSet
    from pipeline.model.io import load_model
    from pipeline.train.data import ValLoader

    train = ShardSet(str(data), "train")
    counts = np.bincount(train.read(0, train.num_tokens).astype(np.int64), minlength=50304)
    first = load_model(trained[(seeds[0], "loopformer")]["dir"])[1]
    L, T = first.model.loops, first.model.block_size
    mb = 8
    val = ValLoader(str(data), "val", T, mb, 0, 1, first.model.vocab_size)
    batches = list(val.batches(max(1, math.ceil(a.val_tokens / (T * mb)))))
    points = sorted({1, 5} | {s for s in range(0, a.steps + 1, max(1, a.steps // 10)) if s > 0} | {a.steps})
    per_seed = {}
    for seed in seeds:
        tr = {label: v for (s, label), v in trained.items() if s == seed}
        sp = {label: v for (s, label), v in specs.items() if s == seed}
        per_seed[seed] = measure_seed(tr, sp, batches, counts, L, a.steps, a.window, points)
    res = {
        "command": "python bench/router.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": a.steps,
        "tokens_per_step": first.train.global_batch_size * T,
        "seeds": seeds,
        "val_tokens": sum(int(y.numel()) for _, y in batches),
        "loops": L,
        "train_wall_s": t_train,
        "cases": per_seed[seeds[0]],
        "per_seed": {s: per_seed[s] for s in seeds[1:]},
    }
    res["summary"], res["summary_table"], res["elastic_table"] = seed_summary(per_seed, L)
    res["wall_s"] = time.time() - t0
    res["table"] = table(res, L)
    for p in figures(res, out, L):  # the figures show the first seed
        print(f"wrote {p}")
    # depth over training, as a table per routed case (first seed)
    lines = []
    for label, c in res["cases"].items():
        if "depth_over_training" in c:
            lines.append(f"\n{label}: step | " + " / ".join(f"d{i}" for i in range(1, L + 1)) + " % | mean depth")
            for s, row in c["depth_over_training"].items():
                lines.append(
                    f"  {s:>5} | " + " / ".join(f"{100 * x:.0f}" for x in row["share"]) + f" | {row['mean_depth']:.2f}"
                )
    res["depth_over_training_text"] = "\n".join(lines)
    write_json(out / "router.json", res)
    print(f"over {len(seeds)} seeds (mean ± std):")
    print(res["summary_table"])
    print("\nvalidation loss at every budget M (mean ± std over seeds):")
    print(res["elastic_table"])
    print(f"\nseed {seeds[0]} in detail:")
    print(res["table"])
    print(res["depth_over_training_text"])
    print(
        f"\nstudy took {res['wall_s'] / 60:.1f} min (training {t_train / 60:.1f} min; CPU time per run "
        + ", ".join(f"{k[1]} s{k[0]} {v['cpu_s']:.0f}s" for k, v in trained.items())
        + ")"
    )


if __name__ == "__main__":
    main()
