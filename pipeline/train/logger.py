"""The one run logger: console progress, the local metrics file and MLflow, rank 0 only.

Use the module-level `log` (`from pipeline.train.logger import log`); nothing is passed around. `open(rank)`
turns the console on (rank 0; on ranks > 0 every method is a no-op) and `close()` off again; the run is opened by
`start` and ended by `end` (the trainer's `MLflowLogger` callback does both). Every step's metrics are a line of
`<run dir>/metrics.jsonl` (always, MLflow or not; `tlf compare --run-dir` reads it). MLflow: tracking URI
`logging.tracking_uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///<cwd>/mlflow.db` (artifacts in `./mlruns`),
experiment `logging.experiment`; the resolved config (`cfg.flat()`) is logged as params, the run is tagged with
the tags the caller passes (pipeline.train.callbacks.run_tags), and the metrics go from the file to the server on
a background thread (pipeline.train.spool: the file is the spool of an outage, replayed on the next start).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from data_prep.files import write_json
from pipeline import tracking
from pipeline.train.spool import Sender


class RunLogger:
    def __init__(self) -> None:
        self.active = False
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None  # the MLflow experiment of the run (`start`)
        self._file = None  # metrics.jsonl, appended by the training thread
        self._sender: Sender | None = None
        self.drain_s = 60.0  # logging.mlflow_drain_s, set by start
        self._system = None  # MLflow's system-metrics monitor (logging.system_metrics)
        self._pending: list[threading.Thread] = []  # artifacts being sent

    # ------------------------------------------------------------------------------------- life cycle
    def open(self, rank: int) -> None:
        """Console output on (rank 0 only); no MLflow run yet."""
        self.active, self.client, self.run_id, self._file, self._sender = rank == 0, None, None, None, None
        self._system, self._pending = None, []

    def close(self) -> None:
        """Turns the console off; an MLflow run nobody ended (a callback failed before it) ends FAILED."""
        self.end("FAILED")
        self.active = False

    def start(
        self, cfg, tags: dict, resume_run_id: str | None = None, root: Path | None = None, step: int = 0
    ) -> str | None:
        """On rank 0 after `open`: the local metrics file `root`/metrics.jsonl (its lines after `step`, the start
        step, dropped: they are run again) and, with logging.mlflow, the MLflow run (`resume_run_id` reopened, else
        a new one) with its sender thread; returns the run id (None without MLflow; when the server cannot be reached
        at the start, the file alone keeps the metrics and a resumed run's id is kept for the next start). Steps the
        run holds past `step` (an attempt no checkpoint kept) are sent again as they are redone (`_record_redo`). A
        run the previous process left RUNNING (tracking.json) is ended KILLED."""
        self.client, self.run_id, self._file, self._sender = None, None, None, None
        self.drain_s = cfg.logging.mlflow_drain_s
        if not self.active:
            return None
        if root is not None:
            self._file = _open_metrics(Path(root) / tracking.METRICS_FILE, step, self.warn)
        prev = self._previous_run(root)
        uri = tracking.tracking_uri(cfg.logging.tracking_uri) if cfg.logging.mlflow else ""
        try:
            if cfg.logging.mlflow:
                self.client = tracking.checked_client(uri)
                after = self._open_run(cfg, tags, resume_run_id, uri)
                if after > step:
                    self._record_redo(step, after)
                after = min(after, step)  # unsent steps up to the start are replayed; the redone ones sent again
                self._end_dead_run(prev, uri)
        except Exception as e:  # noqa: BLE001 - the outside service failing never stops training
            self.warn(
                f"MLflow at {uri} cannot be used ({tracking.one_line(e)}); this run's metrics are only in "
                f"{self._file.name if self._file else 'the console'}"
            )
            self.client, self.run_id = None, resume_run_id  # kept in checkpoints: the next start reopens and replays
        if root is not None:
            write_json(
                Path(root) / tracking.RUN_FILE,
                {"run_id": self.run_id, "tracking_uri": uri, "name": self._name(cfg), "tags": tags},
            )
        if self.client is None:
            return self.run_id
        self.info(f"MLflow run {self.run_id} in experiment '{cfg.logging.experiment}' at {uri}")
        link = tracking.ui_link(uri, self.experiment_id, self.run_id)
        if link:
            self.info(f"MLflow UI: {link}")
            self.info(f"MLflow charts: {tracking.ui_link(uri, self.experiment_id, view=True)}")
        if self._file is not None:
            self._sender = Sender(Path(self._file.name), self.client, self.run_id, after, self._say)
            self._sender.start()
        if cfg.logging.system_metrics:
            self._system = _system_monitor(self.run_id, uri, bool(resume_run_id), self.warn)
        return self.run_id

    def _name(self, cfg) -> str:
        return cfg.logging.run_name or cfg.name or cfg.model.variant

    def _open_run(self, cfg, tags: dict, resume_run_id: str | None, uri: str) -> int:
        """Opens the run; returns the last step its `loss` history already holds (0 for a new run)."""
        if resume_run_id:
            try:
                run = self.client.get_run(resume_run_id)
                if run.info.lifecycle_stage == "active":
                    self.run_id, self.experiment_id = resume_run_id, run.info.experiment_id
                    self.client.update_run(self.run_id, status="RUNNING")
                    self.client.set_tag(self.run_id, "resumed", "true")
                    return max((m.step for m in self.client.get_metric_history(self.run_id, "loss")), default=0)
            except Exception:  # noqa: BLE001 - another tracking store, or the run was deleted: start a new one
                self.run_id = None
        from mlflow.entities import Param, RunTag

        exp_id = self.experiment_id = tracking.experiment_id(self.client, cfg.logging.experiment)
        tags = {**tracking.source_tags("tlf train"), **{k: str(v) for k, v in tags.items()}}
        run = self.client.create_run(exp_id, run_name=self._name(cfg), tags=tags)
        self.run_id = run.info.run_id
        try:  # the run table's Dataset column: the shards trained and validated on
            self.client.log_inputs(self.run_id, datasets=dataset_inputs(cfg))
        except Exception as e:  # noqa: BLE001 - an older server without inputs: the run goes on without them
            self.warn(f"MLflow dataset inputs not logged: {tracking.one_line(e)}")
        params = [Param(k, str(v)[:6000]) for k, v in cfg.flat().items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag("tracking_uri", uri)])
        return 0

    def _previous_run(self, root) -> dict:
        """The previous process's tracking.json ({} when there is none or it is unreadable: one warning)."""
        try:
            return tracking.read_run_file(root) if root is not None else {}
        except tracking.MetricsFileError as e:
            self.warn(f"{e}; ignored (rewritten now)")
            return {}

    def _record_redo(self, step: int, after: int) -> None:
        """The run already holds steps step+1..after of an attempt that no checkpoint kept: they are sent again as
        they are redone; a run tag `redo/<n>` says which values are the abandoned attempt's (the older ones)."""
        what = f"steps {step + 1}-{after} redone from the checkpoint of step {step}"
        try:
            n = 1 + sum(k.startswith("redo/") for k in self.client.get_run(self.run_id).data.tags)
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            note = f"{what} at {when}; the values logged at these steps before then are the abandoned attempt's"
            self.client.set_tag(self.run_id, f"redo/{n}", note)
        except Exception as e:  # noqa: BLE001 - a tag is advice: never stop training
            self.warn(f"MLflow tag redo/* not set: {tracking.one_line(e)}")
            n = "?"
        self.info(f"MLflow run {self.run_id}: {what}; their new values supersede the earlier ones (tag redo/{n})")

    def _end_dead_run(self, prev: dict, uri: str) -> None:
        """The previous process's run, if it is not the one reopened and is still RUNNING: ended KILLED."""
        rid = prev.get("run_id")
        if not rid or rid == self.run_id or prev.get("tracking_uri") != uri:
            return
        try:
            if self.client.get_run(rid).info.status == "RUNNING":
                self.client.set_terminated(rid, status="KILLED")
                self.info(f"MLflow run {rid} of a process that died was left RUNNING; marked KILLED")
        except Exception:  # noqa: BLE001 - best effort: the dead run stays as it was, training goes on
            pass

    def end(self, status: str = "FINISHED") -> None:
        """Flushes the local file; sends the rest (waiting up to logging.mlflow_drain_s for a server that is
        down) and ends the run with `status`, or leaves the unsent steps to the next start."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._system is not None:
            _stop_system(self._system, self.drain_s)
            self._system = None
        deadline = time.monotonic() + self.drain_s
        for th in self._pending:
            th.join(max(deadline - time.monotonic(), 0.0))
        self._pending = []
        if self._sender is not None:
            sender, self._sender = self._sender, None
            if not sender.stop(self.drain_s):
                self.warn(
                    f"MLflow still unreachable; the unsent steps stay in {sender.path} and are sent by the "
                    f"next start of this run"
                )
                self.client = None
        if self.client is not None and self.run_id:
            try:
                self.client.set_terminated(self.run_id, status=status)
            except Exception as e:  # noqa: BLE001 - a server down at the end: warn, the run is ended next start
                self.warn(f"could not mark MLflow run {self.run_id} {status}: {tracking.one_line(e)}")
        self.client = None

    def artifact(self, path: Path, folder: str) -> None:
        """Logs a file to the MLflow run under `folder`, from a daemon thread (a server that is down or slow never
        holds training; a failure is one warning)."""
        client, run_id = self.client, self.run_id
        if client is None or not run_id:
            return

        def send():
            try:
                client.log_artifact(run_id, str(path), folder)
            except Exception as e:  # noqa: BLE001 - the outside service failing never stops training
                self.warn(f"MLflow artifact {path.name} not sent: {tracking.one_line(e)}")

        th = threading.Thread(target=send, daemon=True, name="tlf-artifact")
        th.start()
        self._pending.append(th)  # waited for by `end`, up to logging.mlflow_drain_s

    # ------------------------------------------------------------------------------------------ output
    def info(self, msg: str) -> None:
        if self.active:
            print(f"[tlf] {msg}", file=sys.stdout, flush=True)

    def warn(self, msg: str) -> None:
        if self.active:
            print(f"[tlf] warning: {msg}", file=sys.stderr, flush=True)

    def _say(self, kind: str, msg: str) -> None:
        (self.warn if kind == "warn" else self.info)(msg)

    def metrics(self, values: dict, step: int) -> None:
        """Appends {name: float} as the step's line of metrics.jsonl (the sender reads it from there)."""
        if self._file is None:
            return
        rec = {"step": int(step), "time": int(time.time() * 1000)} | {k: float(v) for k, v in values.items()}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()

    def flush(self) -> None:
        """Wakes the sender (log steps): what the file holds goes to MLflow without waiting for the thread."""
        if self._sender is not None:
            self._sender.wake()

    def set_tags(self, tags: dict) -> None:
        if self.client is not None:
            try:
                for k, v in tags.items():
                    self.client.set_tag(self.run_id, k, str(v))
            except Exception as e:  # noqa: BLE001 - tags are advice: never stop training
                self.warn(f"MLflow tags not set: {tracking.one_line(e)}")


log = RunLogger()


def dataset_inputs(cfg) -> list:
    """MLflow dataset inputs of a run: each training directory (data.dir, or each of data.dirs) and each
    data.extra_val_dirs entry, named by its directory, with its manifest's digest (sha256 of manifest.json, 12 hex
    digits), the tokenizer as schema, the token counts of its splits as profile, and its context (training or
    validation)."""
    import hashlib

    from mlflow.entities import Dataset, DatasetInput, InputTag

    from data_prep.shards import read_manifest

    out = []
    dirs = [(d, "training") for d in cfg.data.sources()] + [(d, "validation") for d in cfg.data.extra_val_dirs]
    for d, context in dirs:
        m = Path(d) / "manifest.json"
        meta = read_manifest(m) if m.is_file() else {}
        splits = meta.get("splits", {})
        profile = {"tokens": {k: v.get("tokens") for k, v in splits.items()}, "total_tokens": meta.get("total_tokens")}
        schema = {"tokenizer": meta.get("tokenizer", {}).get("name"), "block_size": cfg.model.block_size}
        digest = hashlib.sha256(m.read_bytes()).hexdigest()[:12] if m.is_file() else "no-manifest"
        ds = Dataset(Path(d).name or str(d), digest, "local", str(d), json.dumps(schema), json.dumps(profile))
        out.append(DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)]))
    return out


def _system_monitor(run_id: str, uri: str, resumed: bool, warn):
    """MLflow's system-metrics monitor of run_id, started (its own daemon thread samples and sends), or None with a
    warning when it cannot start (training goes on either way)."""
    try:
        import logging

        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop lines: noise
        monitor = SystemMetricsMonitor(run_id, tracking_uri=uri, resume_logging=resumed)
        monitor.start()
        return monitor
    except Exception as e:  # noqa: BLE001 - a monitor that cannot start never stops training
        warn(f"MLflow system metrics off: {tracking.one_line(e)}")
        return None


def _stop_system(monitor, wait_s: float) -> None:
    """Stops the monitor and sends one last sample, from a daemon thread waited on at most wait_s: a server that is
    down never holds the end of the run longer than logging.mlflow_drain_s."""

    def stop():
        try:
            monitor.finish()
            monitor.collect_metrics()
            monitor.publish_metrics(monitor.aggregate_metrics())
            monitor.mlflow_logger.flush()
        except Exception:  # noqa: BLE001 - a server gone at the end: the samples sent so far stay
            pass

    th = threading.Thread(target=stop, daemon=True, name="tlf-system-metrics-stop")
    th.start()
    th.join(wait_s)


def fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _open_metrics(path: Path, start_step: int, warn):
    """metrics.jsonl opened for appending, after dropping its lines past start_step (and a line cut by a kill,
    with a warning); a malformed line is a tracking.MetricsFileError. A run from step 0 starts it empty."""
    keep = [r for r in tracking.read_metrics(path, warn) if r["step"] <= start_step] if start_step else []
    if path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")
