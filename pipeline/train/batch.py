"""One micro-batch of (inputs, targets) from windows of T + 1 tokens: what every training and validation loader
(pipeline/train/data.py, pipeline/train/mixture.py) hands the trainer."""

from __future__ import annotations

import numpy as np
import torch

from data_prep.foldtask import levels_at
from data_prep.shards import ShardError


def to_batch(
    rows: list[np.ndarray], vocab_size: int, where: str, task: dict | None = None, level_cap: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (mb, T) int64. For a depth-task directory (`task`, from its manifest) only the
    answers are scored: a target whose position predicts no answer becomes the ignore index -1, and with
    level_cap > 0 (data.curriculum) so does an answer of a level above it."""
    arr = np.stack(rows).astype(np.int64)
    top = int(arr.max())
    if top >= vocab_size:
        raise ShardError(f"{where}: token id {top} >= model.vocab_size ({vocab_size})")
    t = torch.from_numpy(arr)
    x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
    if task is not None:
        lev = levels_at(arr[:, :-1], task)
        y[torch.from_numpy((lev == 0) | ((lev > level_cap) if level_cap else False))] = -1
    return x, y
