"""The base class of the Trainer's callbacks (pipeline.train.trainer.Trainer): every hook, a no-op. Its own module so
that the callbacks of other modules (pipeline/train/spikes.py, gradstats.py) and callbacks.py, which lists them in
`default_callbacks`, import it without importing each other; `pipeline.train.callbacks.Callback` is this class."""

from __future__ import annotations


class Callback:
    """Hooks, in the order the Trainer calls them (its class doc says when): pre_train(); per step pre_step(step),
    pre_update(step, meter) and post_update(step, meter) around the optimizer step, post_step(step, metrics),
    log_metrics(step, metrics), end_step(step); post_train(); post_checkpoint_saved(step, path); on_error(exc);
    close(status). `metrics` holds host floats; `meter` is the step's StepMeter, still on the device (a callback
    that reads it adds a host sync; `meter.add_sum` puts a device value into the step's one read instead).
    state_dict() / load_state_dict(state): a callback's own training state, saved in each rank's training state
    file under its class name and handed back when a run resumes from it (before pre_train)."""

    trainer = None  # the Trainer, set when it is built

    def pre_train(self) -> None: ...
    def pre_step(self, step: int) -> None: ...  # step: the 1-based number of the step about to run

    def pre_update(self, step: int, meter) -> bool:
        """At the step's accumulation boundary, after its last backward and before the optimizer step (the
        gradients are there). False discards the update (no optimizer or LR step; any callback's False does)."""
        return True

    def post_update(self, step: int, meter) -> None: ...  # after the optimizer step (meter.discarded: skipped)
    def post_step(self, step: int, metrics: dict) -> None: ...  # add metrics of the step just run
    def log_metrics(self, step: int, metrics: dict) -> None: ...  # emit them
    def end_step(self, step: int) -> None: ...
    def post_train(self) -> None: ...
    def post_checkpoint_saved(self, step: int, path) -> None: ...
    def on_error(self, exc: BaseException) -> None: ...
    def close(self, status: str) -> None: ...

    def state_dict(self) -> dict | None:
        """What a resume needs of this callback (plain Python values and tensors), or None: nothing."""
        return None

    def load_state_dict(self, state: dict) -> None: ...
