"""The validation loss (`evaluate`, run by the Validation callback) and the all-reduce-and-read both it and the
trainer use (`sum_over_ranks`). Its own module, so callbacks.py and trainer.py do not import each other."""

from __future__ import annotations

import torch

from data_prep.foldtask import levels_at


def sum_over_ranks(t: torch.Tensor) -> list[float]:
    """All-reduces a small float64 vector and reads it: the host sync of whoever calls it."""
    torch.distributed.all_reduce(t)
    return t.tolist()


def evaluate(engine, loaders, n_batches: int, device) -> dict[str, float]:
    """Mean validation loss (the cross-entropy of the full pass at M = L, from materialised logits) over n_batches
    micro-batches per rank, for each loader; engine: DeepSpeed's engine over the `Objective`. On a depth-task
    split (a loader with a `task`) also the answers' accuracy (argmax) by level, `<name>/acc_L<k>` (`val/acc_L<k>`
    for the first loader, whose name is val/loss), in the same all-reduce."""
    out = {}
    engine.eval()
    with torch.no_grad():
        for name, loader in loaders:
            task = getattr(loader, "task", None)
            L = 0 if task is None else int(task["levels"])
            tot = torch.zeros(2 + 2 * L, dtype=torch.float64, device=device)  # loss, batches, (right, n) by level
            for x, y in loader.batches(n_batches):
                yd = y.to(device)
                o = engine(x.to(device), yd, full_only=True, fused_loss=False)
                tot[0] += o.loss.detach().double()
                tot[1] += 1
                if L:
                    lev = torch.from_numpy(levels_at(x.numpy(), task)).to(device)  # (B, T) 0: no answer
                    right = o.logits.argmax(-1) == yd
                    k = torch.arange(1, L + 1, device=device)[:, None, None]  # (L, 1, 1)
                    at = lev[None] == k  # (L, B, T)
                    tot[2::2] += (at & right[None]).sum((1, 2)).double()
                    tot[3::2] += at.sum((1, 2)).double()
            s = sum_over_ranks(tot)
            out[name] = s[0] / s[1]
            prefix = "val" if name == "val/loss" else name
            for i in range(L):
                if s[3 + 2 * i]:
                    out[f"{prefix}/acc_L{i + 1}"] = s[2 + 2 * i] / s[3 + 2 * i]
    engine.train()
    return out
