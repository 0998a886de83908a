"""Files written whole or not at all: `atomic_write_bytes` (temp name, fsync, rename), the one JSON writer,
`write_json`, used by every layer (shards, manifests, checkpoints, exports, evaluation and benchmark results),
`read_json` for JSON a user may have broken (manifests, DeepSpeed templates): an error naming the file, and
`check_writable`, which every command that writes after a long computation calls first on its output paths, and
`new_dirs_removed_on_error`, so a command that fails leaves no empty directory it made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path


class UnwritableError(OSError):
    """An output path that cannot be written; the message names it and why, on one line."""


def _unwritable(path: Path, directory: bool) -> str | None:
    """Why `path` (a directory to create or fill when `directory`, else a file) cannot be written, or None."""
    if path.exists():
        if directory and not path.is_dir():
            return "Not a directory: it is a file"
        if not directory and path.is_dir():
            return "Is a directory"
        home = path if path.is_dir() else path.parent
        if not os.access(home, os.W_OK | os.X_OK) or not (path.is_dir() or os.access(path, os.W_OK)):
            return f"Permission denied: {path} is not writable"
        return None
    anc = path.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"Not a directory: {anc} is a file"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"Permission denied: {anc} is not writable"
    return None


def check_writable(path: str | os.PathLike, label: str, directory: bool = True, make: bool = False) -> Path:
    """Raises UnwritableError ('LABEL PATH: cannot write there (why)') when `path` cannot be written: a directory
    (directory=True) or a file, its missing parent directories to be made. Creates nothing unless `make` (the
    directory, or a file's parent directory), so a command checks its outputs before its work and leaves nothing
    behind when it fails. `label` is the option or config key that named the path (`--out`, `checkpoint.dir`)."""
    path = Path(path)
    sep = " " if label.startswith("-") else "="
    why = _unwritable(path, directory)
    if why is None and make:
        try:
            (path if directory else path.parent).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = e.strerror or str(e)
    if why:
        raise UnwritableError(f"{label}{sep}{path}: cannot write there ({why})")
    return path


def atomic_write_bytes(path: str | os.PathLike, chunks) -> str:
    """Writes the byte chunks to path via a temp file, fsync and rename (complete or absent); returns their sha256
    (hex), hashed as they are written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as fh:
            for c in chunks:
                digest.update(c)
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
    return digest.hexdigest()


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
