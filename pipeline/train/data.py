"""Training and validation batches from the one shard reader (`data_prep.shards.ShardSet`).

A split of N tokens is cut into W = (N - 1) // T windows of T + 1 tokens (inputs and next-token targets;
neighbouring windows share one token). Epoch e visits the windows in the order of a permutation drawn from
`numpy.random.PCG64([seed, e])`, in *global micro-batches* of world_size x micro_batch_size windows: rank r
takes windows [r * mb, (r + 1) * mb) of each global micro-batch, so ranks never overlap and together cover
the epoch. An optimizer step consumes grad_accum_steps global micro-batches (a batch skipped under
`train.nan_policy=skip` consumes one more). The whole position is one integer, `micro`, the number of global
micro-batches consumed so far: it is saved in every rank's checkpoint state, and since the order depends only
on (seed, global micro-batch size) the same data follows a resume. An epoch ends when fewer than one global
micro-batch of windows is left (the remainder is dropped for that epoch; the next permutation differs).
"""
from __future__ import annotations

import numpy as np
import torch

from data_prep.depthtask import levels_at, task_of
from data_prep.shards import ShardError, ShardSet


def _to_batch(rows: list[np.ndarray], vocab_size: int, where: str, task: dict | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (mb, T) int64. For a depth-hops directory (`task`, from its manifest) only the
    answers are scored: a target whose input is not a level marker becomes the ignore index -1."""
    arr = np.stack(rows).astype(np.int64)
    top = int(arr.max())
    if top >= vocab_size:
        raise ShardError(f"{where}: token id {top} >= model.vocab_size ({vocab_size})")
    t = torch.from_numpy(arr)
    x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
    if task is not None:
        y[torch.from_numpy(levels_at(arr[:, :-1], task["levels"]) == 0)] = -1
    return x, y


class TrainLoader:
    """Deterministic, disjoint per-rank micro-batches of (inputs, targets), each (mb, T) int64."""

    def __init__(self, directory: str, split: str, seq_len: int, micro_batch: int, rank: int, world_size: int,
                 seed: int, vocab_size: int):
        self.shards = ShardSet(directory, split)
        self.task = task_of(directory)
        self.T, self.mb, self.rank, self.ws = seq_len, micro_batch, rank, world_size
        self.seed, self.vocab_size = seed, vocab_size
        self.windows = (self.shards.num_tokens - 1) // seq_len
        self.per_micro = micro_batch * world_size  # windows per global micro-batch
        self.micros_per_epoch = self.windows // self.per_micro
        if self.micros_per_epoch < 1:
            raise ShardError(
                f"{directory} '{split}': {self.shards.num_tokens} tokens give {self.windows} sequences of {seq_len}+1 "
                f"tokens, fewer than one global micro-batch ({micro_batch} x {world_size} ranks = {self.per_micro})")
        self.micro = 0
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.windows)
            self._perm_epoch = epoch
        return self._perm

    def window_ids(self, micro: int) -> np.ndarray:
        """Window indices this rank reads for global micro-batch number `micro`."""
        epoch, k = divmod(micro, self.micros_per_epoch)
        start = k * self.per_micro + self.rank * self.mb
        return self._order(epoch)[start:start + self.mb]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.window_ids(self.micro)
        self.micro += 1
        rows = [self.shards.read(int(w) * self.T, self.T + 1) for w in ids]
        return _to_batch(rows, self.vocab_size, f"{self.shards.dir} '{self.shards.split}'", self.task)

    @property
    def epoch(self) -> float:
        return self.micro / self.micros_per_epoch

    def state_dict(self) -> dict:
        return {"micro": self.micro, "seed": self.seed, "per_micro": self.per_micro, "windows": self.windows}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "per_micro", "windows"):
            if state[k] != getattr(self, k):
                raise ShardError(f"checkpointed data position does not fit this run: {k} was {state[k]}, now "
                                 f"{getattr(self, k)} (same data, train.seed and micro_batch_size x world size needed)")
        self.micro = int(state["micro"])


class ValLoader:
    """The same fixed validation micro-batches at every evaluation: batch b of rank r is windows
    [(b * ws + r) * mb, ... + mb) of the split in order (wrapping around a small split)."""

    def __init__(self, directory: str, split: str, seq_len: int, micro_batch: int, rank: int, world_size: int,
                 vocab_size: int):
        self.shards = ShardSet(directory, split)
        self.task = task_of(directory)
        self.T, self.mb, self.rank, self.ws, self.vocab_size = seq_len, micro_batch, rank, world_size, vocab_size
        self.windows = (self.shards.num_tokens - 1) // seq_len
        if self.windows < 1:
            raise ShardError(f"{directory} '{split}': {self.shards.num_tokens} tokens, fewer than one sequence of "
                             f"{seq_len}+1 tokens")

    def batches(self, n: int):
        for b in range(n):
            first = (b * self.ws + self.rank) * self.mb
            rows = [self.shards.read(((first + i) % self.windows) * self.T, self.T + 1) for i in range(self.mb)]
            yield _to_batch(rows, self.vocab_size, f"{self.shards.dir} '{self.shards.split}'", self.task)
