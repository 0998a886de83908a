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
    exists without a kind gets it (a kind set by its owner stays), and one without tlf's saved view an empty one
    (`save_view`, best effort)."""
    exp = cl.get_experiment_by_name(name)
    if exp is None:
        exp_id = cl.create_experiment(name, tags=KIND)
    else:
        exp_id = exp.experiment_id
        if "mlflow.experimentKind" not in exp.tags:
            cl.set_experiment_tag(exp_id, *next(iter(KIND.items())))
    if exp is None or VIEW_TAG not in exp.tags:  # the view link works before the first metric is sent
        try:
            save_view(cl, exp_id, tags=KIND if exp is None else exp.tags)
        except Exception:  # noqa: BLE001 - a server refusing tags: the runs go on without the view
            pass
    return exp_id


def ui_link(uri: str, experiment_id: str, run_id: str | None = None, view: bool = False) -> str | None:
    """The MLflow UI's page of an experiment (or one of its runs) on a tracking server, opened as model training
    (MLflow 3's `workflowType`, which a new browser otherwise takes to be a GenAI app's); view: the experiment's
    runs in chart mode through tlf's saved view (`VIEW_ID`: the headline charts first); None for a local store."""
    if not uri.startswith(("http://", "https://")):
        return None
    page = f"{uri.rstrip('/')}/#/experiments/{experiment_id}"
    if view:
        return f"{page}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_ID}&compareRunsMode=CHART"
    return page + (f"/runs/{run_id}" if run_id else "") + "?workflowType=machine_learning"


# ------------------------------------------------------------------------------------ the charts view
# MLflow's chart view orders its sections by metric prefix (the key up to its last "/"), alphabetically, with the
# un-prefixed metrics ("Model metrics": loss, lr, tokens_per_s) and "System metrics" last, every section expanded;
# a run's page does the same and keeps its layout only in the browser. An experiment's saved view (an experiment
# tag `mlflow.sharedViewState.<id>` that the UI lists under "Saved views" and opens from `viewStateShareKey=<id>`)
# is the one layout a server holds: tlf keeps one per experiment, `VIEW_ID`, whose first section holds the charts a
# user looks at first (HEADLINE), then every other section in MLflow's order, the zero-shot `eval/...` sections
# collapsed; `ui_link(..., view=True)` opens it. It grows with the metric keys as they are sent (log_metrics), so
# it has only charts with data.
VIEW_ID = "tlf-training"
VIEW_TAG = "mlflow.sharedViewState." + VIEW_ID
VIEW_NAME = "tlf: training"
HEADLINE_SECTION = "Headline"  # loss, validation per budget, tokens/s, memory, depth
MODEL_SECTION, SYSTEM_SECTION = "Model metrics", "System metrics"  # MLflow's names of its two fixed sections
COLLAPSED = ("eval/",)  # sections (prefixes) the view starts collapsed: the zero-shot tasks, one chart per point
# The headline charts, in this order (within a pattern: by budget M, then by name)
HEADLINE = (
    r"loss",
    r"val/loss",
    r"val/M(\d+)/loss",
    r"tokens_per_s",
    r"mem/(cuda_max_allocated_gb|peak_rss_gb)",
    r"router/full/mean_depth",
)


def _headline_rank(key: str) -> tuple | None:
    import re

    for i, pattern in enumerate(HEADLINE):
        m = re.fullmatch(pattern, key)
        if m:
            num = m.group(1) if m.groups() and m.group(1).isdigit() else None
            return (i, int(num) if num else 0, key)
    return None


def section_of(key: str) -> str:
    """The chart section MLflow puts a metric in: its key up to the last "/" (MLflow's `extractChartSectionName`);
    un-prefixed keys: "Model metrics", `system/...`: "System metrics"."""
    if key.startswith("system/"):
        return SYSTEM_SECTION
    return key.rpartition("/")[0] or MODEL_SECTION


def view_layout(keys, headline=(), sections=()) -> tuple[list[str], list[str]]:
    """(headline keys, other sections) of the view for metric `keys`, merged with an earlier view's `headline` and
    `sections`: the headline by HEADLINE's order, the sections by MLflow's (alphabetical, "Model metrics" then
    "System metrics" last), each section only when a key outside the headline is in it."""
    head = set(headline) | {k for k in keys if _headline_rank(k)}
    secs = set(sections) | {section_of(k) for k in keys if not _headline_rank(k)}
    last = {MODEL_SECTION: 1, SYSTEM_SECTION: 2}
    return sorted(head, key=_headline_rank), sorted(secs, key=lambda s: (last.get(s, 0), s))


def view_state(headline: list[str], sections: list[str]) -> dict:
    """The saved view (MLflow 3's experiment-page UI state): one line chart per headline key in the first section,
    then `sections`, the COLLAPSED ones closed; MLflow adds any other metric's chart to its prefix's section
    (a new section at the end)."""
    head = {"uuid": "tlf-headline", "name": HEADLINE_SECTION, "display": True, "isReordered": True}
    rest = [
        {"uuid": f"tlf-section:{s}", "name": s, "display": not s.startswith(COLLAPSED), "isReordered": False}
        for s in sections
    ]
    charts = [
        {
            "uuid": f"tlf-chart:{k}",
            "type": "LINE",
            "metricKey": k,
            "metricSectionId": head["uuid"],
            "displayName": k,
            "isGenerated": False,
            "deleted": False,
            "runsCountToCompare": 10,
            "lineSmoothness": 0,
            "scaleType": "linear",
            "xAxisScaleType": "linear",
            "xAxisKey": "step",
            "selectedXAxisMetricKey": "",
            "useGlobalXaxisKey": True,
            "useGlobalLineSmoothing": True,
        }
        for k in headline
    ]
    return {
        "compareRunCharts": charts,
        "compareRunSections": [head, *rest],
        "isAccordionReordered": True,
    }


def _pack(state: dict) -> str:
    """An experiment tag's value of a saved view: MLflow's envelope {name, createdAt, state}, the state compressed
    as its UI writes it ("deflate;" + base64 of zlib)."""
    import base64
    import time
    import zlib

    packed = "deflate;" + base64.b64encode(zlib.compress(json.dumps(state, separators=(",", ":")).encode())).decode()
    return json.dumps({"name": VIEW_NAME, "createdAt": int(time.time() * 1000), "state": packed})


def _unpack(value: str) -> dict:
    import base64
    import zlib

    state = json.loads(value)["state"]
    if state.startswith("deflate;"):
        state = zlib.decompress(base64.b64decode(state[len("deflate;") :])).decode()
    return json.loads(state)


def save_view(cl, experiment_id: str, keys=(), tags: dict | None = None) -> None:
    """Writes the experiment's saved view (VIEW_TAG) for metric `keys`, merged with the view it holds, when that
    changes it (an unreadable or older view is rewritten). tags: the experiment's tags when the caller has them
    (None: read from the server)."""
    tags = cl.get_experiment(experiment_id).tags if tags is None else tags
    old, headline, sections = None, [], []
    if VIEW_TAG in tags:
        try:
            old = _unpack(tags[VIEW_TAG])
            headline = [c["metricKey"] for c in old["compareRunCharts"] if c.get("metricSectionId") == "tlf-headline"]
            sections = [s["name"] for s in old["compareRunSections"][1:]]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            old = None
    state = view_state(*view_layout(keys, headline, sections))
    if state != old:
        cl.set_experiment_tag(experiment_id, VIEW_TAG, _pack(state))


_seen: dict[str, tuple[str, set]] = {}  # run id: (its experiment id, the headline keys and sections in its view)


def note_keys(cl, run_id: str, keys) -> None:
    """Brings the run's experiment's saved view up to date with metric `keys` just sent, when they add a headline
    chart or a section this process has not put in it yet; best effort (the view is for browsing: a failure
    leaves it as it was)."""
    try:
        if run_id not in _seen:
            _seen[run_id] = (cl.get_run(run_id).info.experiment_id, set())
        exp, done = _seen[run_id]
        marks = {k if _headline_rank(k) else section_of(k) for k in keys}
        if marks - done:
            save_view(cl, exp, keys)
            done |= marks
    except Exception:  # noqa: BLE001 - the server failing here is the sender's to report; the view waits
        pass


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
    """Sends mlflow.entities.Metric objects with log_batch, BATCH at a time, and keeps the experiment's saved view
    (`note_keys`) up to date with their keys."""
    for i in range(0, len(metrics), BATCH):
        cl.log_batch(run_id, metrics=metrics[i : i + BATCH])
    note_keys(cl, run_id, {m.key for m in metrics})


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
