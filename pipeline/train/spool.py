"""The MLflow sender: metrics reach the server from a background thread that reads the run's metrics.jsonl, so
the training thread only appends a line per step and a slow or dead server can neither stall nor stop it.

The file is the spool: the sender keeps a byte offset into it and sends whole steps (one `log_batch` of at most
tracking.BATCH metrics, never splitting a step), each metric with the time stamp of its line, so a batch resent
after a lost reply is stored once (MLflow drops an identical metric). While the server is down it warns once,
retries every `retry_s` and says when it is back; what is still unsent at the end (after `drain_s`) stays in the
file and is replayed by the next start (`RunLogger.start`). Steps at or below `after_step` are already in the
run (sent by an earlier process) and are skipped: after a resume the history holds each step once, except the
steps a resume from an earlier checkpoint redoes, which are sent again (the newer value at a step is the run's,
`tracking.metric_history`). The file's lines are read by `tracking.parse_metrics`, the one metrics.jsonl reader.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pipeline import tracking


class Sender(threading.Thread):
    def __init__(self, path: Path, client, run_id: str, after_step: int, say, retry_s: float = 5.0) -> None:
        super().__init__(name="tlf-mlflow-sender", daemon=True)
        self.path, self.client, self.run_id, self.after = Path(path), client, run_id, after_step
        self.say, self.retry_s = say, retry_s  # say(kind, msg): kind "info" or "warn"
        self.offset, self.line, self.down_since = 0, 1, None  # byte offset and line number of the next unsent line
        self._wake, self._stopping, self._lock, self.drain_s = threading.Event(), False, threading.Lock(), 0.0

    # --------------------------------------------------------------------------- called by the training thread
    def wake(self) -> None:
        self._wake.set()

    def stop(self, drain_s: float) -> bool:
        """Sends what is left, trying for up to drain_s while the server is down; True when nothing is unsent."""
        self.drain_s, self._stopping = max(drain_s, 0.0), True
        self._wake.set()
        self.join(timeout=self.drain_s + 2 * _request_s())
        if self.is_alive():  # stuck in a request: leave it (a daemon thread), the file keeps the rest
            return False
        try:
            return self.down_since is None and not any(r["step"] > self.after for _, r in self._pending()[1])
        except (OSError, tracking.MetricsFileError):
            return False

    # -------------------------------------------------------------------------------------- the thread
    def run(self) -> None:
        deadline = None
        while True:
            if self.down_since is None:
                self._wake.wait()
            else:
                self._wake.wait(self.retry_s)
            self._wake.clear()
            stopping = self._stopping  # read before the file: every line is written by then (end() closed it)
            if stopping and deadline is None:
                deadline = time.monotonic() + self.drain_s
            try:
                with self._lock:
                    ok = self._send_pending()
            except Exception as e:  # noqa: BLE001 - a bad line or an MLflow surprise: never a dead thread that sends nothing
                ok = False
                self.down_since = self.down_since or time.monotonic()
                self.say("warn", f"MLflow sender: {tracking.one_line(e)}; retrying")
            if stopping and (ok or time.monotonic() >= deadline):
                return
            if stopping:
                time.sleep(min(self.retry_s, max(deadline - time.monotonic(), 0.0)))
                self._wake.set()

    def _pending(self) -> tuple[bytes, list[tuple[int, dict]]]:
        """The bytes after the offset, and their complete lines as (end offset, record), checked by
        tracking.parse_metrics (the last piece is empty or a line still being written)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return b"", []
        lines, _ = tracking.parse_metrics(data, self.path, self.line)
        return data, [(self.offset + end, rec) for end, rec in lines]

    def _advance(self, data: bytes, start: int, end: int) -> None:
        """Moves the offset (and the line number that messages name) to `end`; data: the bytes `_pending` read
        from offset `start`."""
        self.line += data[self.offset - start : end - start].count(b"\n")
        self.offset = end

    def _send_pending(self) -> bool:
        from mlflow.entities import Metric

        start = self.offset
        data, lines = self._pending()
        batch, end = [], self.offset
        for i, (pos, rec) in enumerate(lines):
            step = rec["step"]
            if step > self.after:
                ts = int(rec.get("time", 0))
                batch += [Metric(k, float(v), ts, step) for k, v in rec.items() if k not in ("step", "time")]
            end = pos
            last = i == len(lines) - 1
            if last or len(batch) + len(lines[i + 1][1]) > tracking.BATCH:
                if batch and not self._post(batch):
                    return False
                self._advance(data, start, end)
                batch = []
        if self.down_since is not None:
            self.say(
                "info", f"MLflow is back after {time.monotonic() - self.down_since:.0f} s; the spooled steps were sent"
            )
            self.down_since = None
        return True

    def _post(self, batch: list) -> bool:
        try:
            tracking.log_metrics(self.client, self.run_id, batch)  # and the experiment's saved view
            return True
        except Exception as e:  # noqa: BLE001 - any failure of the outside service: spool, never raise into training
            if self.down_since is None:
                self.down_since = time.monotonic()
                self.say(
                    "warn",
                    f"MLflow unreachable ({tracking.one_line(e)}); training goes on, metrics are "
                    f"spooled in {self.path} and sent when the server is back",
                )
            return False


def _request_s() -> float:
    import os

    env = {k: os.environ.get(k, v) for k, v in tracking.HTTP_DEFAULTS.items()}
    try:
        return float(env["MLFLOW_HTTP_REQUEST_TIMEOUT"]) * (1 + int(env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]))
    except ValueError:
        return 10.0
