"""MLflow plumbing shared by training (`pipeline.train.logger`), evaluation (`evaluation.report`) and
`tlf compare`: one default store, one way to open a client and an experiment, one batched metric writer, and the
run's local metrics file (`metrics.jsonl` beside the checkpoints, read by `tlf compare --run-dir`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from data_prep.files import decode_text, read_json

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


# MLflow 3's UI opens an experiment by its kind: tlf's are model training (the runs, their charts), not a GenAI
# app (its traces page)
KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment_id(cl, name: str) -> str:
    """The id of experiment `name`, created as a model-training experiment (`KIND`) if it does not exist; one that
    exists without a kind gets it (a kind set by its owner stays)."""
    exp = cl.get_experiment_by_name(name)
    if exp is None:
        return cl.create_experiment(name, tags=KIND)
    if "mlflow.experimentKind" not in exp.tags:
        cl.set_experiment_tag(exp.experiment_id, *next(iter(KIND.items())))
    return exp.experiment_id


def ui_link(uri: str, experiment_id: str, run_id: str | None = None) -> str | None:
    """The MLflow UI's page of an experiment (or one of its runs) on a tracking server, opened as model training
    (MLflow 3's `workflowType`, which a new browser otherwise takes to be a GenAI app's); None for a local store."""
    if not uri.startswith(("http://", "https://")):
        return None
    page = f"{uri.rstrip('/')}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return page + "?workflowType=machine_learning"


def source_tags(command: str) -> dict[str, str]:
    """The run's Source as MLflow shows it: the command, LOCAL, and the git commit of tlf's checkout when it is
    one (an installed package: its version)."""
    tags = {"mlflow.source.name": command, "mlflow.source.type": "LOCAL"}
    repo = Path(__file__).resolve().parent.parent
    try:
        import subprocess

        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
        tags["mlflow.source.git.commit"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            tags["tlf_version"] = version("tlf")
        except PackageNotFoundError:
            pass
    return tags


def log_metrics(cl, run_id: str, metrics: list) -> None:
    """Sends mlflow.entities.Metric objects with log_batch, BATCH at a time."""
    for i in range(0, len(metrics), BATCH):
        cl.log_batch(run_id, metrics=metrics[i : i + BATCH])


def metric_history(cl, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric of an MLflow run, by step: at each step the value logged last. A step redone
    after a resume from an earlier checkpoint is logged again (`RunLogger.start`, run tag `redo/<n>`); the
    abandoned attempt's value stays in the history, older."""
    newest = {}
    for m in sorted(cl.get_metric_history(run_id, key), key=lambda m: m.timestamp):
        newest[m.step] = m.value
    return sorted(newest.items())


# ------------------------------------------------------------------------------------ local metrics file
class MetricsFileError(ValueError):
    """A metrics.jsonl or tracking.json that is not what the trainer writes; the message names the file (and
    line) on one line."""


def parse_metrics(data: bytes, path, first_line: int = 1) -> tuple[list[tuple[int, dict]], bytes]:
    """The metrics.jsonl lines in `data` (the file's bytes from a line start): ([(byte offset after the line,
    record)], the incomplete last piece: a line without its newline, still being written or cut by a kill). A line
    that is not a JSON object with an integer `step` and numbers for every other key is a MetricsFileError
    naming `path:line` (and the key); blank lines are skipped."""
    out, pos = [], 0
    *lines, tail = data.split(b"\n")
    for n, raw in enumerate(lines, start=first_line):
        pos += len(raw) + 1
        if raw.strip():
            out.append((pos, _record(raw, f"{path}:{n}")))
    return out, tail


def _record(raw: bytes, where: str) -> dict:
    text = decode_text(raw, where, error=MetricsFileError)  # bytes that are not UTF-8: the offset in the line
    try:
        rec = json.loads(text)
    except ValueError as e:
        raise MetricsFileError(f"{where}: not a JSON line ({e})") from None
    if not isinstance(rec, dict):
        raise MetricsFileError(f"{where}: a JSON object of one step's metrics expected, not {type(rec).__name__}")
    for k, v in rec.items():
        if k == "step" and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise MetricsFileError(f"{where}: 'step' must be an integer >= 0, got {v!r}"[:300])
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise MetricsFileError(f"{where}: metric {k!r} must be a number, got {v!r}"[:300])
    if "step" not in rec:
        raise MetricsFileError(f"{where}: no 'step'")
    return rec


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The records of a metrics.jsonl (none when it does not exist), checked by `parse_metrics`; an incomplete
    last line (what a kill leaves) is skipped, reported through warn(one line) when given."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:  # a directory, no permission
        raise MetricsFileError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    lines, tail = parse_metrics(data, path)
    if tail.strip() and warn is not None:
        n = data.count(b"\n") + 1
        warn(f"{path}:{n}: incomplete last line (a write cut short, e.g. by a kill) skipped")
    return [rec for _, rec in lines]


RUN_FILE_TYPES = {"run_id": (str, type(None)), "tracking_uri": (str,), "name": (str, type(None)), "tags": (dict,)}


def read_run_file(directory: Path) -> dict:
    """tracking.json of a run directory ({} when there is none); anything but what the trainer writes is a
    MetricsFileError naming the file (and key)."""
    f = Path(directory) / RUN_FILE
    if not f.exists():
        return {}
    d = read_json(f, dict, error=MetricsFileError)  # not UTF-8, not JSON, not an object: the file named
    for k, kinds in RUN_FILE_TYPES.items():
        if k in d and not isinstance(d[k], kinds):
            raise MetricsFileError(f"{f}: key {k!r} has the wrong type ({d[k]!r})"[:300])
    return d
