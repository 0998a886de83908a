"""The validation loss (`evaluate`, run by the Validation callback) and the all-reduce-and-read both it and the
trainer use (`sum_over_ranks`). Its own module, so callbacks.py and trainer.py do not import each other."""

from __future__ import annotations

import torch

from data_prep.foldtask import levels_at


def sum_over_ranks(t: torch.Tensor) -> list[float]:
    """All-reduces a small float64 vector and reads it: the host sync of whoever calls it."""
    torch.distributed.all_reduce(t)
    return t.tolist()


def default_budgets(loops: int) -> list[int]:
    """`train.eval_loops` when empty: 1, 2, 4, ... below L, and L (L = 8: 1, 2, 4, 8; L = 3: 1, 2, 3); [1] for the
    dense baseline."""
    return sorted({*(2**k for k in range(loops.bit_length()) if 2**k < loops), loops})


def evaluate(engine, loaders, n_batches: int, device, budgets: list[int], loops: int) -> dict[str, float]:
    """Validation over n_batches micro-batches per rank of each loader (engine: DeepSpeed's engine over the
    `Objective`), at each loop budget M of `budgets`, the same batches at every budget: the cross-entropy of the
    pass at M from materialised logits, `<prefix>/M{M}/loss` (prefix `val` for the first loader, else its name), and
    for a routed model the pass's mean depth `<prefix>/M{M}/mean_depth` and loop work (mean depth / L, the share of
    the full pass's loops) `<prefix>/M{M}/loop_work`. The pass at M = L (run whether or not it is listed) is also
    the loader's own name (val/loss, val/<extra dir>); on a depth-task split (a loader with a `task`) that pass
    also gives the answers' accuracy (argmax) by level, `<prefix>/acc_L<k>`. One all-reduce per loader."""
    out = {}
    run = sorted({*budgets, loops})
    engine.eval()
    with torch.no_grad():
        for name, loader in loaders:
            prefix = "val" if name == "val/loss" else name
            s, levels = _sums(engine, loader, n_batches, device, run, loops)
            for i, M in enumerate(run):
                loss, batches, depth, tokens = s[4 * i : 4 * i + 4]
                if M == loops:
                    out[name] = loss / batches
                if M not in budgets:
                    continue
                out[f"{prefix}/M{M}/loss"] = loss / batches
                if tokens:
                    out[f"{prefix}/M{M}/mean_depth"] = depth / tokens
                    out[f"{prefix}/M{M}/loop_work"] = depth / tokens / loops
            acc = s[4 * len(run) :]
            for k in range(levels):
                if acc[2 * k + 1]:
                    out[f"{prefix}/acc_L{k + 1}"] = acc[2 * k] / acc[2 * k + 1]
    engine.train()
    return out


def _sums(engine, loader, n_batches: int, device, run: list[int], loops: int) -> tuple[list[float], int]:
    """[loss sum, batches, depth sum, tokens] at each budget of `run` (depth: a routed pass's; 0 otherwise), then
    (right, count) of each answer level at M = L on a depth-task split, summed over the ranks; and the levels."""
    task = getattr(loader, "task", None)
    levels = 0 if task is None else int(task["levels"])
    tot = torch.zeros(4 * len(run) + 2 * levels, dtype=torch.float64, device=device)
    for x, y in loader.batches(n_batches):
        xd, yd = x.to(device), y.to(device)
        for i, M in enumerate(run):
            o = engine(xd, yd, full_only=True, loops=None if M == loops else M, fused_loss=False)
            tot[4 * i] += o.loss.detach().double()
            tot[4 * i + 1] += 1
            if engine.module.net.router is not None:
                tot[4 * i + 2] += o.depth.sum().double()
                tot[4 * i + 3] += o.depth.numel()
            if M == loops and levels:
                lev = torch.from_numpy(levels_at(x.numpy(), task)).to(device)  # (B, T) 0: no answer
                right = o.logits.argmax(-1) == yd
                k = torch.arange(1, levels + 1, device=device)[:, None, None]  # (levels, 1, 1)
                at = lev[None] == k  # (levels, B, T)
                tot[4 * len(run) :: 2] += (at & right[None]).sum((1, 2)).double()
                tot[4 * len(run) + 1 :: 2] += at.sum((1, 2)).double()
    return sum_over_ranks(tot), levels


def mix(out: dict[str, float], names: list[str], weights: list[float]) -> dict[str, float]:
    """A mixture's validation (data.dirs): val/loss and each val/M{M}/<metric> as the weighted mean, by data.weights,
    of the sources' val/<name> and val/<name>/M{M}/<metric> (`evaluate`'s keys of each source); `out` plus those."""
    mixed = {"val/loss": sum(w * out[f"val/{n}"] for n, w in zip(names, weights))}
    first = f"val/{names[0]}/"
    for key in [k for k in out if k.startswith(first + "M")]:
        rest = key[len(first) :]
        if all(f"val/{n}/{rest}" in out for n in names):
            mixed[f"val/{rest}"] = sum(w * out[f"val/{n}/{rest}"] for n, w in zip(names, weights))
    return {**out, **mixed}
