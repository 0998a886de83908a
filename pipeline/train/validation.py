"""The validation loss (`evaluate`, run by the Validation callback) and the all-reduce-and-read both it and the
trainer use (`sum_over_ranks`). Its own module, so callbacks.py and trainer.py do not import each other."""

from __future__ import annotations

import torch


def sum_over_ranks(t: torch.Tensor) -> list[float]:
    """All-reduces a small float64 vector and reads it: the host sync of whoever calls it."""
    torch.distributed.all_reduce(t)
    return t.tolist()


def evaluate(engine, loaders, n_batches: int, device) -> dict[str, float]:
    """Mean validation loss (the cross-entropy of the full pass at M = L, from materialised logits) over n_batches
    micro-batches per rank, for each loader; engine: DeepSpeed's engine over the `Objective`."""
    out = {}
    engine.eval()
    with torch.no_grad():
        for name, loader in loaders:
            tot, cnt = torch.zeros((), dtype=torch.float64, device=device), 0
            for x, y in loader.batches(n_batches):
                tot += engine(x.to(device), y.to(device), full_only=True, fused_loss=False).loss.detach().double()
                cnt += 1
            s, c = sum_over_ranks(torch.stack([tot, torch.tensor(float(cnt), dtype=torch.float64, device=device)]))
            out[name] = s / c
    engine.train()
    return out
