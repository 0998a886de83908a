"""prep-data from an unreachable Hub fails fast and cleanly: a whole message (its reason shortened at a word
boundary, never mid-word), no progress bar drawn, and nothing left behind (no manifest.json or .lock that would
make the next command refuse the directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from data_prep.hf import short_error

REPO = Path(__file__).resolve().parent.parent


def _prep(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))  # nothing listens on port 9
    return subprocess.run(
        [sys.executable, "-m", "data_prep", "prep-data", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_unreachable_hub_leaves_nothing_behind(tmp_path):
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    for out in (fresh, existing):
        r = _prep("--source", "fineweb-edu", "--hf-config", "sample-10BT", "--out", str(out), "hf_timeout=5")
        assert r.returncode == 1, r.stderr[-2000:]
        assert "cannot reach the Hugging Face Hub" in r.stderr and "--source files" in r.stderr
        assert "%|" not in r.stderr and "tok/s" not in r.stderr  # no (empty) progress bar
    assert not fresh.exists() and list(existing.iterdir()) == []
    # the next command into the same directory is not refused
    r = _prep("--source", "demo", "--out", str(existing), "--max-tokens", "20000", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]


def test_short_error_names_the_wrapped_cause_and_never_cuts_a_word():
    class Inner(OSError):
        pass

    class Outer(Exception):
        def __init__(self, reason):
            super().__init__("Max retries exceeded")
            self.reason = reason

    long = "Failed to resolve " + " ".join(["wordy"] * 100)
    s = short_error(RuntimeError(Outer(Inner(long))), limit=60)
    assert s.startswith("Inner: Failed to resolve wordy") and s.endswith(" …")
    assert all(w in ("Inner:", "Failed", "to", "resolve", "wordy", "…") for w in s.split())
    assert short_error(ValueError("short\nsecond line")) == "ValueError: short"
