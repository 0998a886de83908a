"""Hugging Face Hub datasets in streaming mode (FineWeb-Edu, OpenWebText, any dataset id), and the one Hub probe
(`hub_problem`, also used by evaluation's task loader).

Before streaming, the Hub is probed with a hard deadline (cfg.hf_timeout seconds, in a daemon thread so
not even a stuck DNS lookup can hang us); offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) fails at
once. Either way the error names the dataset and says how to use local files instead. Resume uses the
streaming iterator's own `state_dict()` (taken at each task start) plus a record count to skip.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import threading
from urllib.parse import urlparse

from data_prep.sources import Task
from data_prep.worker import PrepInputError

# datasets' packaged builders read local/remote files without the Hub (`hf_dataset=parquet` + files).
PACKAGED = ("parquet", "json", "csv", "text", "arrow")
ROWS_PER_TASK_MIN = 16


class HubUnreachable(PrepInputError):
    """The Hub (or the dataset) cannot be reached; the message says how to use local files instead."""


def offline_var() -> str | None:
    """The offline-mode variable that is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), or None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    return None


HUB_PACKAGES = ("huggingface_hub", "datasets")


def hub_missing() -> str | None:
    """Why the Hub cannot be used in this environment at all (a package `make demo`'s set-up leaves out), or None."""
    for name in HUB_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module entry set to None, or a broken parent
            found = False
        if not found:
            return f"{name} is not installed (make setup, or pip install -r requirements.txt, adds the Hub's packages)"
    return None


def short_error(e: BaseException, limit: int = 240) -> str:
    """'Type: message' of the error e wraps (requests -> urllib3's retries -> the resolver's or connection's
    error, which names the host), first line only, shortened at a word boundary with an ellipsis when longer than
    `limit` (never cut mid-word)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "reason", None)
        if not isinstance(inner, BaseException):
            inner = e.args[0] if e.args and isinstance(e.args[0], BaseException) else None
        if inner is None:
            break
        e = inner
    text = str(e).splitlines()[0] if str(e).strip() else ""
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0].rstrip(",;:(") + " …"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def hub_problem(timeout: float, dataset: str = "") -> str | None:
    """None when the Hub answers within about `timeout` s (for `dataset`: its dataset info; else a TCP connect to
    the endpoint), otherwise why not. Offline mode answers at once; the question runs in a daemon thread so not
    even a stuck DNS lookup can hang the caller."""
    var = offline_var()
    if var:
        return f"{var} is set (offline mode)"
    missing = hub_missing()
    if missing:
        return missing
    result: dict = {}

    def ask():
        try:
            if dataset:
                from huggingface_hub import HfApi

                HfApi().dataset_info(dataset, timeout=timeout)
            else:
                from huggingface_hub import constants

                u = urlparse(constants.ENDPOINT)
                port = u.port or (443 if u.scheme == "https" else 80)
                socket.create_connection((u.hostname or "", port), timeout=timeout).close()
            result["ok"] = True
        except Exception as e:  # noqa: BLE001 - any failure: network, 404, auth
            result["error"] = short_error(e)

    t = threading.Thread(target=ask, daemon=True, name="hf-probe")
    t.start()
    t.join(timeout + 1.0)
    if result.get("ok"):
        return None
    return result.get("error") or f"no answer within {timeout:g} s"


def _local_hint(dataset: str) -> str:
    return (
        f"To prepare {dataset} without the Hub, download its parquet/jsonl files on a connected machine, copy them "
        "here and run `tlf prep-data --source files --input 'DIR/**/*.parquet' --text-field text --out OUT` "
        "(the offline demo corpus: `--source demo`)."
    )


def probe(dataset: str, config: str, timeout: float) -> None:
    """Raises HubUnreachable within about `timeout` seconds unless the Hub answers for dataset."""
    where = f"dataset '{dataset}'" + (f" (config {config})" if config else "")
    why = hub_problem(timeout, dataset)
    if why is None:
        return
    if offline_var():
        raise HubUnreachable(f"cannot stream {where}: {why}. {_local_hint(dataset)}")
    raise HubUnreachable(f"cannot reach the Hugging Face Hub for {where}: {why}. {_local_hint(dataset)}")


class HubSource:
    """Rows of one streaming split; records are the text column's values."""

    def __init__(self, cfg):
        self.dataset, self.config, self.split = cfg.hf_target()
        self.text_field = cfg.text_field
        self.data_files = list(getattr(cfg, "hf_data_files", []) or [])
        self.timeout = cfg.hf_timeout
        self.batch_bytes = cfg.batch_bytes
        for var in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
            os.environ.setdefault(var, str(int(max(1, self.timeout))))

    def describe(self) -> list[dict]:
        return [{"dataset": self.dataset, "config": self.config, "split": self.split, "data_files": self.data_files}]

    def check(self) -> None:
        """Raises HubUnreachable (within about hf_timeout s) unless the Hub answers: prep-data asks before it writes
        anything or draws a progress bar, so an unreachable Hub leaves nothing behind."""
        if self.dataset not in PACKAGED and not getattr(self, "_checked", False):
            probe(self.dataset, self.config, self.timeout)
            self._checked = True

    def _open(self):
        """The streaming dataset; the Hub is probed first (not needed to see that an output is complete)."""
        self.check()
        import datasets

        kw = {"data_files": self.data_files} if self.data_files else {}
        try:
            return datasets.load_dataset(self.dataset, self.config or None, split=self.split, streaming=True, **kw)
        except Exception as e:  # noqa: BLE001 - whatever datasets raises, one line naming the dataset
            raise HubUnreachable(
                f"cannot open dataset '{self.dataset}' split '{self.split}': "
                f"{type(e).__name__}: {e}. {_local_hint(self.dataset)}"
            ) from None

    def tasks(self, cursor: dict | None = None):
        ds = self._open()
        if cursor and cursor.get("state") is not None:
            ds.load_state_dict(cursor["state"])
        skip = cursor.get("skip", 0) if cursor else 0
        row = (cursor["loc"] - 1 - skip) if cursor else 0  # rows before the task the cursor lies in
        it = iter(ds)
        for _ in range(skip):  # records of the cursor's task already written
            next(it, None)
            row += 1
        # the state after the last record read: where the next task starts
        task, size = Task("str", [], [], [], 0, None, None, {"state": ds.state_dict()}), 0
        for rec in it:
            row += 1
            if self.text_field not in rec:
                raise PrepInputError(
                    f"{self.dataset} row {row}: no text field '{self.text_field}' "
                    f"(columns: {', '.join(list(rec)[:12])}); set text_field"
                )
            text = rec[self.text_field]
            task.records.append(text)
            task.locs.append(row)
            task.where.append(f"{self.dataset} row {row}")
            size += len(text) if isinstance(text, str) else 0
            if size >= self.batch_bytes and len(task.records) >= ROWS_PER_TASK_MIN:
                yield task
                task, size = Task("str", [], [], [], 0, None, None, {"state": ds.state_dict()}), 0
        if task.records:
            yield task
