"""Files written whole or not at all: `atomic_write_bytes` (temp name, fsync, rename), the one JSON writer,
`write_json`, used by every layer (shards, manifests, checkpoints, exports, evaluation and benchmark results),
`read_json` for JSON a user may have broken (manifests, DeepSpeed templates): an error naming the file, and
`new_dirs_removed_on_error`, so a command that fails leaves no empty directory it made.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, chunks) -> None:
    """Writes the byte chunks to path via a temp file, fsync and rename (complete or absent)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            for c in chunks:
                fh.write(c)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a failed write (ENOSPC) names no file by itself: name the one being written
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _plain(o):
    """numpy / torch scalars as numbers; anything else JSON cannot hold as its str()."""
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def write_json(path: str | os.PathLike, obj, indent: int = 2, sort_keys: bool = False) -> Path:
    """Writes obj as JSON atomically, creating the directory; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, [json.dumps(obj, indent=indent, sort_keys=sort_keys, default=_plain).encode()])
    return path


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError):
    """The JSON value in path; invalid JSON raises `error` with a one-line message naming the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON ({e})") from None


@contextlib.contextmanager
def new_dirs_removed_on_error(path: str | os.PathLike):
    """For a block that creates directory `path` (and its missing parents): when the block raises (an error, an
    interrupt), those of them that did not exist before it and are still empty are removed, deepest first, so a
    failed start leaves nothing behind; a directory something was written into stays."""
    path = Path(path)
    new = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        yield path
    except BaseException:
        for p in new:
            with contextlib.suppress(OSError):  # not empty (or gone): kept as it is
                p.rmdir()
        raise
