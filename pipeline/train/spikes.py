"""Loss spikes (train.spike_policy): a step's loss is a spike when it exceeds the mean of the rolling window (the
losses of the last train.spike_window steps that were not spikes) by more than train.spike_sigma of the window's
standard deviation, a one-sided rolling z-score as OLMo-core's stability monitor and skip-step optimizer judge it.
Steps are judged once the window holds min(20, spike_window) losses.

warn: `train/spike` is logged every step (1.0 at a spike, 0.0 otherwise) with a warning line at a spike; training is
what it is under off. skip: the spike's update is also discarded at the accumulation boundary (the `Spikes`
callback's pre_update returns False: the Trainer calls `ds.discard_update`, no optimizer or LR-scheduler step; the
data position moves on and the step counts towards schedule.max_steps), counted as `train/skipped_updates` (the
run's total, logged every step), and the run stops with `SpikeError` after train.spike_skip_limit skips in a row.
The window and the counters are the callback's state in every checkpoint (each rank's training state), so a
resumed run judges every later step as the uninterrupted run does.

Host syncs: warn judges the loss that the step's one read has already brought to the host (no read of its own);
skip must decide before the optimizer step, after the last micro-batch's backward, so it reads the step's loss,
summed over ranks, once more at the accumulation boundary (every rank takes the same decision from it).
"""

from __future__ import annotations

import math

import torch

from pipeline.config import ConfigError
from pipeline.train.hooks import Callback
from pipeline.train.logger import log
from pipeline.train.validation import sum_over_ranks

MIN_JUDGED = 20  # a step is judged once the window holds min(MIN_JUDGED, train.spike_window) losses


class SpikeError(RuntimeError):
    """train.spike_policy=skip discarded train.spike_skip_limit updates in a row; the message names the step, the
    loss against the window and the last good checkpoint."""


def window_stats(losses: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of the window, summed exactly (math.fsum): the same floats on every rank
    and in a resumed run."""
    n = len(losses)
    mean = math.fsum(losses) / n
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in losses) / (n - 1))


class Spikes(Callback):
    """train.spike_policy (module doc). State: `losses` (the window, oldest first), `in_a_row` (skips in a row),
    `skipped` (updates discarded in the run)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.in_a_row = 0
        self.skipped = 0
        self.judged: tuple[int, float, bool] | None = None  # skip: (step, loss, spike) decided at the boundary

    @property
    def policy(self) -> str:
        return self.trainer.cfg.train.spike_policy

    def ready(self) -> bool:
        return len(self.losses) >= min(MIN_JUDGED, self.trainer.cfg.train.spike_window)

    def is_spike(self, loss: float) -> bool:
        mean, std = window_stats(self.losses)
        return loss - mean > self.trainer.cfg.train.spike_sigma * std

    def pre_train(self) -> None:
        from pipeline.train.ds import discard_kind

        t = self.trainer
        opt = t.engine.optimizer
        if self.policy == "skip" and not discard_kind(opt):
            raise ConfigError(f"train.spike_policy=skip cannot discard an update of {type(opt).__name__}")
        del self.losses[: -t.cfg.train.spike_window]  # a resume with a shorter window keeps the newest losses
        t.result.skipped_updates = self.skipped

    def pre_update(self, step: int, meter) -> bool:
        """skip: the step's mean loss over micro-batches and ranks (the policy's one read of its own), judged before
        the optimizer step; False (discard the update) at a spike. A non-finite micro-batch is nan_policy's."""
        self.judged = None
        if self.policy != "skip" or not self.ready():
            return True
        v = sum_over_ranks(torch.cat([meter.losses[:1], meter.bad]))
        if any(b > 0 for b in v[1:]):
            return True
        loss = v[0] / self.trainer.ws / max(meter.n, 1)
        self.judged = (step, loss, self.is_spike(loss))
        return not self.judged[2]

    def post_step(self, step: int, metrics: dict) -> None:
        if self.policy == "off":
            return
        if self.judged is not None and self.judged[0] == step:
            _, loss, spike = self.judged
        else:  # warn (judged now), or skip with a window not ready yet (not judged)
            loss = metrics["loss"]
            spike = self.policy == "warn" and self.ready() and self.is_spike(loss)
        self.judged = None
        metrics["train/spike"] = float(spike)
        if spike:
            self.spike(step, loss)
        else:
            self.losses.append(loss)
            del self.losses[: -self.trainer.cfg.train.spike_window]
            self.in_a_row = 0
        if self.policy == "skip":
            metrics["train/skipped_updates"] = float(self.skipped)

    def spike(self, step: int, loss: float) -> None:
        """A warning line; skip: counted, and the run stopped at train.spike_skip_limit in a row."""
        t, limit = self.trainer, self.trainer.cfg.train.spike_skip_limit
        mean, std = window_stats(self.losses)
        z = (loss - mean) / std if std > 0 else math.inf
        what = (
            f"loss spike at step {step}: loss {loss:.4f} is {z:.1f} sigma above the rolling mean {mean:.4f} "
            f"(std {std:.4f}, {len(self.losses)} steps)"
        )
        t.result.spikes.append(step)
        if self.policy == "warn":
            log.warn(f"{what}; training goes on (train.spike_policy=warn)")
            return
        self.skipped += 1
        self.in_a_row += 1
        t.result.skipped_updates = self.skipped
        if self.in_a_row >= limit:
            raise SpikeError(
                f"{what}: {self.in_a_row} updates skipped in a row (train.spike_skip_limit={limit}); stopping. "
                f"Last good checkpoint: {t.last_good()}"
            )
        log.warn(f"{what}; update skipped (train.spike_policy=skip, {self.in_a_row} in a row, {self.skipped} in all)")

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.losses = [float(x) for x in state["losses"]]
        self.in_a_row, self.skipped = int(state["in_a_row"]), int(state["skipped"])
