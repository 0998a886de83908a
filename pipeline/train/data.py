"""Training and validation batches from the one shard reader (`data_prep.shards.ShardSet`).

A split of N tokens is cut into W = (N - 1) // T windows of T + 1 tokens (inputs and next-token targets;
neighbouring windows share one token). Epoch e visits the windows in the order of a permutation drawn from
`numpy.random.PCG64([seed, e])`: the first (W // G) x G of them, G = train.global_batch_size (the remainder is
dropped for that epoch; the next permutation differs). The position is global: (epoch, offset), the number of
windows of the epoch consumed, whatever the world size. Each draw takes the next *global micro-batch* of
world_size x micro_batch_size windows, of which rank r takes windows [offset + r * mb, offset + (r + 1) * mb); an
optimizer step draws grad_accum_steps of them, i.e. G windows (a batch skipped under `train.nan_policy=skip`
draws one more). So the windows of each optimizer step, their order, and the epoch ends depend only on (seed, G,
W): a checkpoint written by N ranks resumes on M ranks (grad-accum adapting, same G) at the same sequence, none
skipped or repeated. `micro` counts the draws of this loader (this run's units, for fault hooks and tests).
"""

from __future__ import annotations


import numpy as np
import torch

from data_prep.foldtask import check_window, task_of
from data_prep.shards import ShardError, ShardSet
from pipeline.train.batch import to_batch


class TrainLoader:
    """Deterministic, disjoint per-rank micro-batches of (inputs, targets), each (mb, T) int64."""

    def __init__(
        self,
        directory: str,
        split: str,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        vocab_size: int,
        verify: bool = False,
        global_batch: int | None = None,
        curriculum: bool = False,
    ):
        self.shards = ShardSet(directory, split, (rank, world_size) if verify else None)
        self.task = task_of(directory)
        check_window(self.task, seq_len, directory)
        if curriculum and self.task is None:
            raise ShardError(
                f"data.curriculum needs a depth-task data.dir (prep-data --source depth-fold); "
                f"{directory}/manifest.json has no depth_task entry"
            )
        self.curriculum = curriculum
        self.level_cap = 1 if curriculum else 0  # the highest level trained (0: every level)
        self.T, self.mb, self.rank, self.ws = seq_len, micro_batch, rank, world_size
        self.seed, self.vocab_size = seed, vocab_size
        self.windows = (self.shards.num_tokens - 1) // seq_len
        self.per_micro = micro_batch * world_size  # windows per global micro-batch
        self.global_batch = global_batch or self.per_micro  # windows per optimizer step (G)
        self.usable = self.windows // self.global_batch * self.global_batch  # windows visited per epoch
        self.micros_per_epoch = self.usable // self.per_micro
        if self.micros_per_epoch < 1:
            raise ShardError(
                f"{directory} '{split}': {self.shards.num_tokens} tokens give {self.windows} sequences of {seq_len}+1 "
                f"tokens, fewer than one global micro-batch ({micro_batch} x {world_size} ranks = {self.per_micro})"
            )
        self.micro, self.epoch_no, self.offset = 0, 0, 0
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
        return self._order(epoch)[start : start + self.mb]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.offset + self.per_micro > self.usable:  # this epoch's windows are used up
            self.epoch_no, self.offset = self.epoch_no + 1, 0
        start = self.offset + self.rank * self.mb
        ids = self._order(self.epoch_no)[start : start + self.mb]
        self.micro += 1
        self.offset += self.per_micro
        rows = [self.shards.read(int(w) * self.T, self.T + 1) for w in ids]
        return to_batch(rows, self.vocab_size, f"{self.shards.dir} '{self.shards.split}'", self.task, self.level_cap)

    @property
    def levels(self) -> int:
        """The task's levels (0 for text)."""
        return 0 if self.task is None else int(self.task["levels"])

    def raise_level(self) -> None:
        """The curriculum's next level (data.curriculum): answers of level level_cap + 1 are trained from now on."""
        self.level_cap = min(self.level_cap + 1, self.levels)

    @property
    def epoch(self) -> float:
        return self.epoch_no + self.offset / self.usable

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch_no,
            "offset": self.offset,
            "micro": self.micro,
            "seed": self.seed,
            "per_micro": self.per_micro,
            "global_batch": self.global_batch,
            "windows": self.windows,
            "level_cap": self.level_cap,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores the global position; a state of another world size (per_micro) fits when G is the same."""
        if "offset" not in state:  # written before the position was global: (micro, per_micro) of that run
            state = {
                **state,
                "global_batch": self.global_batch if state["per_micro"] == self.per_micro else 0,
                **dict(zip(("epoch", "offset"), divmod(state["micro"], state["windows"] // state["per_micro"]))),
            }
            state["offset"] *= state["per_micro"]
        for k in ("seed", "global_batch", "windows"):
            if state[k] != getattr(self, k):
                raise ShardError(
                    f"checkpointed data position does not fit this run's data.dir={self.shards.dir} "
                    f"'{self.shards.split}': {k} was {state[k]}, now "
                    f"{getattr(self, k)} (same data, train.seed and train.global_batch_size needed)"
                )
        self.epoch_no, self.offset = int(state["epoch"]), int(state["offset"])
        # the curriculum's level goes on where it was; one switched on at this resume starts at 1, off: every level
        self.level_cap = (int(state.get("level_cap", 0)) or 1) if self.curriculum else 0
        same = state["per_micro"] == self.per_micro
        self.micro = (
            int(state["micro"]) if same else self.epoch_no * self.micros_per_epoch + self.offset // self.per_micro
        )


class ValLoader:
    """The same fixed validation micro-batches at every evaluation: batch b of rank r is windows
    [(b * ws + r) * mb, ... + mb) of the split in order (wrapping around a small split)."""

    def __init__(
        self,
        directory: str,
        split: str,
        seq_len: int,
        micro_batch: int,
        rank: int,
        world_size: int,
        vocab_size: int,
        verify: bool = False,
    ):
        self.shards = ShardSet(directory, split, (rank, world_size) if verify else None)
        self.task = task_of(directory)
        check_window(self.task, seq_len, directory)
        self.T, self.mb, self.rank, self.ws, self.vocab_size = seq_len, micro_batch, rank, world_size, vocab_size
        self.windows = (self.shards.num_tokens - 1) // seq_len
        if self.windows < 1:
            raise ShardError(
                f"{directory} '{split}': {self.shards.num_tokens} tokens, fewer than one sequence of {seq_len}+1 tokens"
            )

    def distinct_windows(self, n: int) -> int:
        """How many different windows `batches(n)` reads on all ranks together (a small split wraps around)."""
        return min(self.windows, n * self.ws * self.mb)

    def batches(self, n: int):
        for b in range(n):
            first = (b * self.ws + self.rank) * self.mb
            rows = [self.shards.read(((first + i) % self.windows) * self.T, self.T + 1) for i in range(self.mb)]
            yield to_batch(rows, self.vocab_size, f"{self.shards.dir} '{self.shards.split}'", self.task)


def build_loaders(cfg, rank: int, ws: int, loader=None) -> tuple:
    """(train loader, [(metric name, ValLoader)]) of a run: `loader` when given (anything with next() -> (x, y),
    epoch, state_dict(), load_state_dict()), else the TrainLoader over data.dir or the MixtureLoader over data.dirs;
    a ValLoader per validation dir (data.dir's named val/loss, each of data.dirs and data.extra_val_dirs
    val/<its name>), none when train.eval_interval is 0."""
    T, mb = cfg.model.block_size, cfg.train.micro_batch_size
    if loader is None and cfg.data.dirs:
        from pipeline.train.mixture import MixtureLoader, check_sources

        check_sources(cfg)
        loader = MixtureLoader(cfg, rank, ws, (rank, ws) if cfg.data.verify else None)
    if loader is None:
        loader = TrainLoader(
            cfg.data.dir,
            cfg.data.train_split,
            T,
            mb,
            rank,
            ws,
            cfg.train.seed,
            cfg.model.vocab_size,
            cfg.data.verify,
            global_batch=cfg.train.global_batch_size,
            curriculum=cfg.data.curriculum > 0,
        )
    val = []
    if cfg.train.eval_interval > 0:
        val = [
            (
                f"val/{cfg.data.source_name(d)}",
                ValLoader(d, cfg.data.val_split, T, mb, rank, ws, cfg.model.vocab_size, cfg.data.verify),
            )
            for d in cfg.data.sources() + list(cfg.data.extra_val_dirs)
        ]
        if not cfg.data.dirs:  # a mixture's val/loss is its sources' weighted mean (validation.mix)
            val[0] = ("val/loss", val[0][1])
    return loader, val
