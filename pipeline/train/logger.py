"""The one run logger: console progress and MLflow, rank 0 only.

Use the module-level `log` (`from pipeline.train.logger import log`); nothing is passed around. `open(rank)`
turns the console on (rank 0; on ranks > 0 every method is a no-op) and `close()` off again; the MLflow run is
opened by `start` and ended by `end` (the trainer's `MLflowLogger` callback does both). MLflow: tracking URI
`logging.tracking_uri` (default `sqlite:///<cwd>/mlflow.db`, artifacts in `./mlruns`), experiment
`logging.experiment`; the resolved config (`cfg.flat()`) is logged as params, the run is tagged with the tags
the caller passes (pipeline.train.callbacks.run_tags), and metrics are buffered and sent with `log_batch` (at
most 1000 per call).
"""
from __future__ import annotations

import sys
import time

from pipeline import tracking


class RunLogger:
    def __init__(self) -> None:
        self.active = False
        self.client = None
        self.run_id: str | None = None
        self._buf: list = []

    # ------------------------------------------------------------------------------------- life cycle
    def open(self, rank: int) -> None:
        """Console output on (rank 0 only); no MLflow run yet."""
        self.active, self.client, self.run_id, self._buf = rank == 0, None, None, []

    def close(self) -> None:
        """Turns the console off; an MLflow run nobody ended (a callback failed before it) ends FAILED."""
        self.end("FAILED")
        self.active = False

    def start(self, cfg, tags: dict, resume_run_id: str | None = None) -> str | None:
        """Opens the MLflow run (a new one, or `resume_run_id` reopened) on rank 0 after `open`; returns its id."""
        self.client, self.run_id, self._buf = None, None, []
        if not self.active or not cfg.logging.mlflow:
            return None
        uri = tracking.tracking_uri(cfg.logging.tracking_uri)
        self.client = tracking.client(uri)
        exp_id = tracking.experiment_id(self.client, cfg.logging.experiment)
        if resume_run_id:
            try:
                run = self.client.get_run(resume_run_id)
                if run.info.lifecycle_stage == "active":
                    self.run_id = resume_run_id
                    self.client.update_run(self.run_id, status="RUNNING")
                    self.client.set_tag(self.run_id, "resumed", "true")
            except Exception:  # noqa: BLE001 - another tracking store, or the run was deleted: start a new one
                self.run_id = None
        if self.run_id is None:
            from mlflow.entities import Param, RunTag

            name = cfg.logging.run_name or cfg.name or cfg.model.variant
            run = self.client.create_run(exp_id, run_name=name, tags={k: str(v) for k, v in tags.items()})
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in cfg.flat().items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            self.client.log_batch(self.run_id, tags=[RunTag("tracking_uri", uri)])
        self.info(f"MLflow run {self.run_id} in experiment '{cfg.logging.experiment}' at {uri}")
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        if self.client is not None and self.run_id:
            self.flush()
            self.client.set_terminated(self.run_id, status=status)
        self.client = None

    # ------------------------------------------------------------------------------------------ output
    def info(self, msg: str) -> None:
        if self.active:
            print(f"[tlf] {msg}", file=sys.stdout, flush=True)

    def warn(self, msg: str) -> None:
        if self.active:
            print(f"[tlf] warning: {msg}", file=sys.stderr, flush=True)

    def metrics(self, values: dict, step: int) -> None:
        """Buffers {name: float}; sent with the next flush (automatic at 1000 buffered values)."""
        if self.client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._buf += [Metric(k, float(v), ts, int(step)) for k, v in values.items()]
        if len(self._buf) >= tracking.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.client is None or not self._buf:
            return
        buf, self._buf = self._buf, []
        tracking.log_metrics(self.client, self.run_id, buf)

    def set_tags(self, tags: dict) -> None:
        if self.client is not None:
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, str(v))


log = RunLogger()


def fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"
