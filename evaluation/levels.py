"""Accuracy by depth level on a depth-task shard directory (the fold task, data_prep/foldtask.py).

`level_scores(model, directory, loops)`: at loop budget M, next-token accuracy (argmax) of every scored target
(the token after a level marker) by its level d* = k and overall, the executed depth of the predicting position
by level (a level x depth count table: the router's choice, or M for every token without a router) and the
Spearman rho between executed depth and d* (None when either is constant), and `work`: the executed loops per
token over EVERY token of the windows (the compute; context tokens a query reads must keep looping too), the
x-axis on which runs are compared at equal work. Windows are the split cut into
non-overlapping rows of `block_size` + 1 tokens, as the training loader cuts them.
"""

from __future__ import annotations

import numpy as np
import torch

from data_prep.foldtask import check_window, levels_at, task_of
from data_prep.shards import ShardError, ShardSet
from evaluation.forward import hidden_states, logits_at


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing their mean rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # the last 1-based rank of each distinct value
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rho (Pearson's r of the tie-averaged ranks); None when either side is constant."""
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def level_scores(
    model,
    directory: str,
    loops: int,
    split: str = "val",
    max_windows: int = 256,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    router: bool = True,
) -> dict:
    task = task_of(directory)
    if task is None:
        raise ShardError(
            f"{directory}/manifest.json: not a depth-task directory (source depth-fold: no depth_task entry)"
        )
    L, M = int(task["levels"]), int(loops)
    shards = ShardSet(directory, split)
    T = model.cfg.block_size
    check_window(task, T, directory)
    n_win = min((shards.num_tokens - 1) // T, max_windows)
    lev_all, dep_all, ok_all, work = [], [], [], 0.0
    for b0 in range(0, n_win, batch_size):
        rows = np.stack([shards.read(w * T, T + 1) for w in range(b0, min(b0 + batch_size, n_win))]).astype(np.int64)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])  # (B, T) each
        lev = torch.from_numpy(levels_at(rows[:, :-1], task))  # (B, T), 0: not scored
        r, p = torch.nonzero(lev, as_tuple=True)
        h, depth = hidden_states(model, x.to(device), M, router=router)  # depth (B, T)
        work += float(depth.sum())
        pred = logits_at(model, h[r, p]).argmax(-1).cpu()  # (P,)
        lev_all.append(lev[r, p].numpy())
        dep_all.append(depth[r, p].cpu().numpy())
        ok_all.append((pred == y[r, p]).numpy())
    lev, dep, ok = (np.concatenate(a) for a in (lev_all, dep_all, ok_all))
    table = np.zeros((L, M), dtype=np.int64)  # [level-1, depth-1]
    np.add.at(table, (lev - 1, dep - 1), 1)
    acc = {int(k): (float(ok[lev == k].mean()) if (lev == k).any() else None) for k in range(1, L + 1)}
    return {
        "loops": M,
        "targets": int(ok.size),
        "accuracy": float(ok.mean()),
        "accuracy_by_level": acc,
        "level_depth": table.tolist(),
        "mean_depth": float(dep.mean()),
        "work": work / (n_win * T),
        "depth_ge_level": {int(k): float((dep[lev == k] >= k).mean()) for k in range(1, L + 1) if (lev == k).any()},
        "spearman": spearman(dep.astype(float), lev.astype(float)),
    }


def accuracy_at_work(curve: list[tuple[float, float]], work: float) -> float:
    """A fixed-depth model's elastic curve [(work, accuracy)] over its budgets, linearly interpolated at `work`
    (clamped to its ends): what that model reaches at another run's executed work."""
    w, a = zip(*sorted(curve))
    return float(np.interp(work, w, a))


def share_at_depth_ge_level(table) -> float | None:
    """The share of all answers run at depth >= their level, from a level x depth count table."""
    n = sum(sum(row) for row in table)
    return sum(sum(row[k:]) for k, row in enumerate(table)) / n if n else None


def level_depth_lines(table, indent: str = "    ") -> list[str]:
    """A level x executed-depth count table as text rows: % of each level's answers at each depth, and the share
    run at depth >= the level."""
    lines = [f"{indent}level | " + " ".join(f"d{d:<5}" for d in range(1, len(table[0]) + 1)) + "| depth >= level"]
    for k, row in enumerate(table, start=1):
        n = max(sum(row), 1)
        lines.append(
            f"{indent}{k:>5} | "
            + " ".join(f"{100 * c / n:5.1f} " for c in row)
            + f"| {100 * sum(row[k - 1 :]) / n:5.1f}%"
        )
    return lines


def describe_levels(lv: dict, M: int) -> list[str]:
    """Console lines for one budget's `level_scores`: accuracy overall and by level, work, rho and the level x
    executed-depth table."""
    acc = ", ".join(f"L{k} {a:.3f}" for k, a in lv["accuracy_by_level"].items() if a is not None)
    rho = f"; rho(depth, level) {lv['spearman']:.3f}" if lv.get("spearman") is not None else ""
    return [
        f"  M={M} depth-task accuracy {lv['accuracy']:.4f}; by level {acc}; work {lv['work']:.3f} loops/token{rho}",
        *level_depth_lines(lv["level_depth"]),
    ]
