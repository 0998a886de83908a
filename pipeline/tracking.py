"""MLflow plumbing shared by training (`pipeline.train.logger`), evaluation (`evaluation.report`) and
`tlf compare`: one default store, one way to open a client and an experiment, one batched metric writer, and the
run's local metrics file (`metrics.jsonl` beside the checkpoints, read by `tlf compare --run-dir`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

BATCH = 1000  # MLflow's log_batch limit on metrics per call
METRICS_FILE = "metrics.jsonl"  # one line per step: {"step": S, "time": MS, "<metric>": value, ...}
RUN_FILE = "tracking.json"  # {"run_id", "tracking_uri", "name", "tags"}: the MLflow run of the run directory
# A client that waits minutes on a dead server stalls whoever holds it: short requests, few retries (a user's
# own MLFLOW_HTTP_REQUEST_* variables win).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


class TrackingError(Exception):
    """The tracking server cannot be reached or refuses us; the message is one line."""


def tracking_uri(uri: str = "") -> str:
    """The given URI (config key / option), else $MLFLOW_TRACKING_URI, else the local default that needs no
    server: sqlite:///<cwd>/mlflow.db."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI", "") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def client(uri: str = ""):
    """An MlflowClient on tracking_uri(uri), with the database-migration chatter silenced and short HTTP
    timeouts (HTTP_DEFAULTS)."""
    import logging

    from mlflow.tracking import MlflowClient

    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=tracking_uri(uri))


def one_line(exc: BaseException) -> str:
    """An MLflow/HTTP exception as one short line (MLflow's own messages carry whole retry chains)."""
    text = " ".join(str(exc).split())
    for marker in ("Max retries exceeded", "Invalid Host header", "Connection refused", "Read timed out"):
        if marker in text:
            return marker[0].lower() + marker[1:]
    return text[:200] + ("..." if len(text) > 200 else "")


def checked_client(uri: str = ""):
    """client(uri) after one cheap request, so an unreachable or refusing server is a TrackingError (one line,
    within seconds) instead of minutes of retries and a traceback."""
    resolved = tracking_uri(uri)
    cl = client(resolved)
    if resolved.startswith(("http://", "https://")):
        try:
            cl.search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - any failure of the server (connection, HTTP, auth) is one line
            raise TrackingError(f"MLflow server at {resolved} cannot be used: {one_line(e)}") from None
    return cl


def experiment_id(cl, name: str) -> str:
    """The id of experiment `name`, created if it does not exist."""
    exp = cl.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else cl.create_experiment(name)


def log_metrics(cl, run_id: str, metrics: list) -> None:
    """Sends mlflow.entities.Metric objects with log_batch, BATCH at a time."""
    for i in range(0, len(metrics), BATCH):
        cl.log_batch(run_id, metrics=metrics[i : i + BATCH])


# ------------------------------------------------------------------------------------ local metrics file
def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl (a line cut by a kill is ignored)."""
    out = []
    try:
        with open(path) as fh:
            for line in fh:
                if line.endswith("\n"):
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return out


def read_run_file(directory: Path) -> dict:
    try:
        d = json.loads((Path(directory) / RUN_FILE).read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
