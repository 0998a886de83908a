"""Training batches drawn from several shard directories in set proportions (`data.dirs`, `data.weights`).

Every optimizer step reads G = train.global_batch_size sequences. Which source each of them comes from is drawn
from `numpy.random.PCG64([seed, MIX, step])` with the weights as probabilities, so the proportions hold within
sampling error and depend only on (seed, step). Each source is read in its own epochs: its windows (T + 1 tokens,
as in pipeline/train/data.py) in the order of a permutation drawn from `PCG64([seed, MIX, 1 + s, epoch])`, every
window once per epoch; a source whose windows run out starts its next epoch (said once per source). The step's G
sequences form one list; a global micro-batch takes the next world_size x micro_batch_size of them and rank r its
r-th slice. The position is global (the steps begun, the sequences of the current step taken, each source's epoch
and offset at the step's start), so a checkpoint resumes on any world size or grad-accum with the same G, at the
same sequence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from data_prep.foldtask import task_of
from data_prep.shards import ShardError, ShardSet, read_manifest
from pipeline.config import DataConfig
from pipeline.train.batch import to_batch
from pipeline.train.logger import log

MIX = 0x6D6978  # a constant of the mixture's seed sequences, so they never meet a single source's PCG64([seed, e])


class _Source:
    """One directory's training windows, read in its own seeded epochs; `take(n)` returns the next n window ids."""

    def __init__(self, index: int, directory: str, split: str, seq_len: int, seed: int, verify) -> None:
        self.index, self.name, self.T, self.seed = index, DataConfig.source_name(directory), seq_len, seed
        self.shards = ShardSet(directory, split, verify)
        self.windows = (self.shards.num_tokens - 1) // seq_len
        if self.windows < 1:
            raise ShardError(f"{directory} '{split}': fewer than one sequence of {seq_len}+1 tokens")
        self.epoch, self.offset, self._perm_epoch, self._perm, self.said = 0, 0, -1, None, False

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, MIX, 1 + self.index, epoch]))
            self._perm, self._perm_epoch = rng.permutation(self.windows), epoch
        return self._perm

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.offset == self.windows:
                self.epoch, self.offset = self.epoch + 1, 0
                if not self.said:
                    log.info(f"data: source {self.name} ran out of its {self.windows} sequences; next epoch")
                    self.said = True
            k = min(n - len(out), self.windows - self.offset)
            out += self._order(self.epoch)[self.offset : self.offset + k].tolist()
            self.offset += k
        return out

    def read(self, window: int) -> np.ndarray:
        return self.shards.read(window * self.T, self.T + 1)


class MixtureLoader:
    """Deterministic, disjoint per-rank micro-batches of (inputs, targets), each (mb, T) int64, from `dirs` in the
    proportions `weights` (see the module doc); the TrainLoader's interface (next, epoch, micro, state_dict,
    load_state_dict) plus `tokens`: the tokens each source has given the run so far, {name: int}."""

    def __init__(self, cfg, rank: int, world_size: int, verify) -> None:
        d, t = cfg.data, cfg.train
        self.T, self.mb, self.rank, self.ws = cfg.model.block_size, t.micro_batch_size, rank, world_size
        self.seed, self.G, self.vocab_size, self.weights = t.seed, t.global_batch_size, cfg.model.vocab_size, d.weights
        self.sources = [_Source(i, s, d.train_split, self.T, t.seed, verify) for i, s in enumerate(d.dirs)]
        self.per_micro = self.mb * world_size
        self.micro, self.step, self.taken = 0, 0, 0  # draws of this loader; steps begun; sequences of this step taken
        self.counts = np.zeros(len(self.sources), dtype=np.int64)  # sequences each source gave, steps begun
        self._begin()

    def _begin(self) -> None:
        """Notes each source's position and count at the start of the current step, then draws its list."""
        self._start = [(s.epoch, s.offset) for s in self.sources]
        self._counts_start = self.counts.copy()
        self._list = self._step_list()

    def _step_list(self) -> list[tuple[int, int]]:
        """The current step's G (source, window) pairs; advances each source past its share."""
        rng = np.random.Generator(np.random.PCG64([self.seed, MIX, self.step]))
        which = rng.choice(len(self.sources), size=self.G, p=np.asarray(self.weights, dtype=np.float64))
        ids = {s: iter(self.sources[s].take(int((which == s).sum()))) for s in range(len(self.sources))}
        self.counts += np.bincount(which, minlength=len(self.sources))
        return [(int(s), next(ids[int(s)])) for s in which]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.taken + self.per_micro > self.G:  # this step's sequences are used up (a nan-skip drew one more)
            self.step, self.taken = self.step + 1, 0
            self._begin()
        first = self.taken + self.rank * self.mb
        rows = [self.sources[s].read(w) for s, w in self._list[first : first + self.mb]]
        self.micro += 1
        self.taken += self.per_micro
        return to_batch(rows, self.vocab_size, "data.dirs", None)

    @property
    def epoch(self) -> float:
        """The first source's epochs (its share of the run)."""
        s = self.sources[0]
        return s.epoch + s.offset / s.windows

    @property
    def tokens(self) -> dict[str, int]:
        """Tokens each source has given the steps begun (every rank's share), T + 1 per sequence counted as T."""
        return {s.name: int(n) * self.T for s, n in zip(self.sources, self.counts)}

    def state_dict(self) -> dict:
        return {
            "mixture": [s.name for s in self.sources],
            "weights": list(self.weights),
            "seed": self.seed,
            "global_batch": self.G,
            "step": self.step,
            "taken": self.taken,
            "micro": self.micro,
            "counts": self._counts_start.tolist(),
            "start": [list(p) for p in self._start],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores the global position; the sources, weights, seed and global batch must be the checkpoint's."""
        want = {"mixture": [s.name for s in self.sources], "weights": list(self.weights), "seed": self.seed}
        for k, v in {**want, "global_batch": self.G}.items():
            if state.get(k) != v:
                raise ShardError(
                    f"checkpointed data position does not fit this run's data mixture: {k} was {state.get(k)!r}, "
                    f"now {v!r} (the same data.dirs, data.weights, train.seed and train.global_batch_size needed)"
                )
        self.step, self.taken, self.micro = int(state["step"]), int(state["taken"]), int(state["micro"])
        for s, (epoch, offset) in zip(self.sources, state["start"]):
            s.epoch, s.offset = int(epoch), int(offset)
        self.counts = np.asarray(state["counts"], dtype=np.int64)
        self._begin()


def check_sources(cfg) -> None:
    """data.dirs must hold text of one tokenizer, each with a val split when validation is on: a ShardError naming
    the directory otherwise (before any batch is read)."""
    seen: dict = {}
    for d in cfg.data.dirs:
        if task_of(d) is not None:
            raise ShardError(f"data.dirs: {d} holds fold-task data; a mixture is of text directories")
        m = Path(d) / "manifest.json"
        tok = read_manifest(m).get("tokenizer", {}) if m.is_file() else {}
        key = (tok.get("name"), tok.get("n_vocab")) if isinstance(tok, dict) else (None, None)
        if seen and key != next(iter(seen.values())):
            first = next(iter(seen))
            raise ShardError(
                f"data.dirs: {d} was tokenized with {key[0]} ({key[1]} ids), {first} with "
                f"{seen[first][0]} ({seen[first][1]} ids): a mixture needs one tokenizer"
            )
        seen[d] = key
