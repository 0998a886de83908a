"""Files written whole or not at all: `atomic_write_bytes` (temp name, fsync, rename), the one JSON writer,
`write_json`, used by every layer (shards, manifests, checkpoints, exports, evaluation and benchmark results),
the one text reader, `read_text` / `read_json`, for every file a user may have broken or swapped (manifests, export
and checkpoint configs, results.json, tracking.json, DeepSpeed templates, task files): a missing file, a directory,
bytes that are not UTF-8, invalid JSON or JSON of another shape is one `FileFormatError` line naming the file (and
the byte offset, or line and column), `check_writable`, which every command that writes after a long computation
calls first on its output paths, and `new_dirs_removed_on_error`, so a command that fails leaves no empty directory
it made.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from data_prep.configlib import ConfigError


class FileFormatError(ConfigError):
    """A file tlf reads that is missing, a directory, not UTF-8 text, not JSON, or JSON of another shape; the message
    names the file and what is wrong on one line. A ConfigError, so the `tlf` group reports one that reaches it as a
    usage error; readers whose callers expect another error class pass `error=` to read_text / read_json."""


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


def decode_text(data: bytes, path: str | os.PathLike, *, error: type[Exception] = FileFormatError) -> str:
    """`data` (the bytes of `path`, or of one of its lines) as text: UTF-8, a leading byte-order mark dropped,
    newlines as `Path.read_text` gives them; bytes that are not UTF-8 raise `error` naming `path` and the offset of
    the first bad byte in `data`."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # e.object: data without its byte-order mark
        raise error(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start + len(data) - len(e.object)}); "
            "a binary or damaged file, or text in another encoding"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def read_text(path: str | os.PathLike, *, error: type[Exception] = FileFormatError) -> str:
    """The text of a UTF-8 file (decode_text); a missing file, a directory, an unreadable file or bytes that are not
    UTF-8 raise `error` with one line naming the file (and the offset of the first bad byte)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    return decode_text(data, path, error=error)


JSON_KINDS = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


def json_kind(value) -> str:
    """The JSON name of a decoded value's type: object, array, string, number, boolean, null."""
    return JSON_KINDS.get(type(value), "number")


def read_json(path: str | os.PathLike, expect: type | None = None, *, error: type[Exception] = FileFormatError):
    """The JSON value in a UTF-8 file (read_text's errors); invalid JSON raises `error` naming the file, line and
    column; with `expect` (dict or list) a value of another kind is `… must be a JSON object, not array`."""
    path = Path(path)
    text = read_text(path, error=error)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if expect is not None and not isinstance(value, expect):
        raise error(f"{path}: must be a JSON {JSON_KINDS[expect]}, not {json_kind(value)}")
    return value


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
