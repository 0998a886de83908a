"""The one shard format and the one shard reader (docs/design.md §3), shared by prep-data, training and evaluation.

A shard is llm.c-compatible: a header of 256 int32 — [0] magic 20240520, [1] version 1, [2] token
count — then that many uint16 tokens. Files are `<name>_<split>_<index:06d>.bin`. Every file is
written atomically (temp name, fsync, rename), so a shard on disk is either complete or absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from data_prep.files import atomic_write_bytes, json_kind, read_json
from data_prep.tokenizer import EOT  # noqa: F401  (the document separator of every shard)

MAGIC = 20240520
VERSION = 1
DTYPE = "uint16"  # the tokens of a shard of MAGIC and VERSION
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMAT = "tlf-token-shards"  # manifest.json's `format`: a manifest prep-data wrote, every field of it checked


class ShardError(ValueError):
    """A shard or manifest problem; the message names the file."""


def shard_name(name: str, split: str, index: int) -> str:
    return f"{name}_{split}_{index:06d}.bin"


def write_shard(path: str | os.PathLike, tokens) -> None:
    """Writes tokens (any int array) as one shard; ids that do not fit uint16 are an error."""
    arr = np.asarray(tokens)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
        bad = int(arr.max()) if int(arr.max()) > 65535 else int(arr.min())
        raise ShardError(f"{path}: token id {bad} does not fit uint16 (0..65535)")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, VERSION, arr.size
    atomic_write_bytes(path, [header.tobytes(), arr.astype(np.uint16, copy=False).tobytes()])


class ShardReader:
    """One shard as a read-only memmap; checks magic, version and that the count matches the file size (the header
    and a stat: no read of the tokens). `expect` = (manifest, field, tokens): the manifest's count of this shard,
    which the header must repeat; a disagreement is a ShardError naming the manifest, the field and both values."""

    def __init__(self, path: str | os.PathLike, expect: tuple[Path, str, int] | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise ShardError(f"{self.path}: shard not found" + (f" (listed in {expect[0]})" if expect else ""))
        size = self.path.stat().st_size
        if size < HEADER_BYTES:
            raise ShardError(f"{self.path}: truncated header ({size} bytes < {HEADER_BYTES})")
        header = np.fromfile(self.path, dtype=np.int32, count=HEADER_INTS)
        if header[0] != MAGIC:
            raise ShardError(f"{self.path}: wrong magic {header[0]} (expected {MAGIC}); not a token shard")
        if header[1] != VERSION:
            raise ShardError(f"{self.path}: unsupported shard version {header[1]} (expected {VERSION})")
        n = int(header[2])
        if expect is not None and expect[2] != n:
            raise ShardError(
                f"{expect[0]}: {expect[1]} is {expect[2]} but {self.path.name}'s header says {n} tokens "
                f"(file of {size} bytes); the manifest or the shard was changed after prep-data"
            )
        expected = HEADER_BYTES + 2 * n
        if size != expected:
            raise ShardError(
                f"{self.path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes "
                + (
                    f"(the size of {n} 4-byte tokens: written as another dtype than {DTYPE})"
                    if size == expected + 2 * n
                    else "(truncated or corrupt)"
                )
                + (f"; {expect[0]}'s {expect[1]} is {expect[2]}" if expect is not None else "")
            )
        self.num_tokens = n
        self.tokens = (
            np.memmap(self.path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))
            if n
            else np.zeros(0, dtype=np.uint16)
        )

    def __len__(self) -> int:
        return self.num_tokens


FIELD_KINDS = {
    int: "an integer >= 0",
    str: "a string",
    bool: "true or false",
    dict: "a JSON object",
    list: "a JSON array",
}


class _Fields:
    """The fields of one manifest, read with their types checked. A manifest prep-data wrote (its `format` is
    FORMAT) must hold every field; one written by hand (no `format`) may leave any out. A missing field, a wrong
    type or a disagreement is a one-line ShardError naming the manifest, the field and both values."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.strict = path, "format" in meta
        if self.strict and meta["format"] != FORMAT:
            raise ShardError(f"{path}: format is {meta['format']!r}, not {FORMAT!r}: not a tlf token-shard manifest")

    def get(self, obj: dict, key: str, name: str, kind: type, required: bool | None = None):
        """obj[key] (None when absent and not required: by default, required in a manifest prep-data wrote)."""
        if key not in obj:
            if self.strict if required is None else required:
                raise ShardError(
                    f"{self.path}: {name} is missing (prep-data writes it: the manifest was edited or damaged; "
                    "rerun prep-data)"
                )
            return None
        v = obj[key]
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 0)):
            shown = repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."
            raise ShardError(f"{self.path}: {name} must be {FIELD_KINDS[kind]}, not {json_kind(v)} {shown}")
        return v

    def agree(self, name: str, have, want, what: str) -> None:
        """have (a field's value; None: absent) must equal want, which `what` describes."""
        if have is not None and have != want:
            raise ShardError(f"{self.path}: {name} is {have!r} but {what} {want!r}")


def _check_split(f: _Fields, split: str, info) -> int | None:
    """A split's entry checked (each shard's name, tokens, docs, sha256; the split's totals against the sums of
    its shards); returns its token count (None when a hand-written manifest leaves it unknown)."""
    if isinstance(info, dict) and f.strict:
        f.get(info, "shards", f"splits.{split}.shards", list)
    shards = info.get("shards", []) if isinstance(info, dict) else None
    if not isinstance(shards, list) or not all(
        isinstance(s, str) or (isinstance(s, dict) and isinstance(s.get("name"), str)) for s in shards
    ):
        raise ShardError(
            f"{f.path}: key 'splits.{split}.shards' must be a list of shard names or {{\"name\": ...}} objects"
        )
    counts: dict[str, list] = {"tokens": [], "docs": []}
    for i, s in enumerate(shards):
        where = f"splits.{split}.shards[{i}]"
        if isinstance(s, str) and f.strict:
            raise ShardError(f"{f.path}: {where} is the bare name {s!r}, not an object of name, tokens, docs, sha256")
        for key, got in counts.items():
            got.append(f.get(s, key, f"{where}.{key}", int) if isinstance(s, dict) else None)
        if isinstance(s, dict):
            f.get(s, "sha256", f"{where}.sha256", str, required=False)  # missing: not verified (older manifests)
    totals = {}
    for key, got in counts.items():
        totals[key] = f.get(info, key, f"splits.{split}.{key}", int)
        if None not in got:
            f.agree(f"splits.{split}.{key}", totals[key], sum(got), f"splits.{split}.shards[*].{key} add up to")
            totals[key] = sum(got)
    return totals["tokens"]


def read_manifest(path: str | os.PathLike) -> dict:
    """A manifest.json as a dict, checked for the shape every reader relies on (a mapping whose `splits` maps a
    split to {"shards": [{"name": ...} or name, ...]}) and, without reading a shard, for its fields' types and
    sums: each split's tokens and docs are its shards', total_tokens the splits', shard_format the one this
    reader reads. Anything else is a one-line ShardError naming the file, the field and both values."""
    path = Path(path)
    meta = read_json(path, dict, error=ShardError)
    f = _Fields(path, meta)
    f.get(meta, "complete", "complete", bool)
    splits = f.get(meta, "splits", "splits", dict) or {}
    sizes = [_check_split(f, split, info) for split, info in splits.items()]
    if None not in sizes:
        f.agree(
            "total_tokens", f.get(meta, "total_tokens", "total_tokens", int), sum(sizes), "splits.*.tokens add up to"
        )
    sf = f.get(meta, "shard_format", "shard_format", dict) or {}
    for key, want in (("magic", MAGIC), ("version", VERSION)):
        f.agree(f"shard_format.{key}", f.get(sf, key, f"shard_format.{key}", int), want, "this reader reads")
    f.agree(
        "shard_format.dtype",
        f.get(sf, "dtype", "shard_format.dtype", str),
        DTYPE,
        f"shards of magic {MAGIC} version {VERSION} hold tokens of",
    )
    return meta


def manifest_shards(meta: dict, split: str) -> list[str]:
    """The shard file names of `split` in a manifest checked by read_manifest."""
    return [s["name"] if isinstance(s, dict) else s for s in meta.get("splits", {}).get(split, {}).get("shards", [])]


def open_split(directory: Path, split: str, meta: dict | None) -> list[ShardReader]:
    """The readers of a split's shards: those DIRECTORY's manifest (`meta`, from read_manifest) lists, each header
    checked against the manifest's token count, or (meta None) the `*_<split>_*.bin` files."""
    if meta is None:
        return [ShardReader(p) for p in sorted(directory.glob(f"*_{split}_*.bin"))]
    entries = meta.get("splits", {}).get(split, {}).get("shards", [])
    mpath = directory / "manifest.json"
    return [
        ShardReader(
            directory / (e["name"] if isinstance(e, dict) else e),
            (mpath, f"splits.{split}.shards[{i}].tokens", e["tokens"])
            if isinstance(e, dict) and "tokens" in e
            else None,
        )
        for i, e in enumerate(entries)
    ]


class ShardSet:
    """All shards of one split in a directory, in index order, as one token stream.

    Reads `manifest.json` when present (its shard list for the split), else globs `*_<split>_*.bin`.
    `read(start, n)` returns n tokens from global offset start, spanning shard boundaries.

    verify=(rank, world_size): the first read touching shard k, on the rank with k % world_size == rank, hashes the
    whole file and compares it with the sha256 prep-data recorded in the manifest (so each shard is checked once
    per run, lazily, spread over the ranks); a mismatch is a ShardError. Shards without a recorded sha256 (older
    manifests, or no manifest) are not checked."""

    def __init__(self, directory: str | os.PathLike, split: str = "train", verify: tuple[int, int] | None = None):
        self.dir = Path(directory)
        self.split = split
        sums: list = []
        manifest = self.dir / "manifest.json"
        if manifest.is_file():
            meta = read_manifest(manifest)
            if meta.get("complete") is False:
                raise ShardError(
                    f"{manifest}: incomplete (prep-data is still running or was interrupted; "
                    "rerun the same `tlf prep-data` command to finish it)"
                )
            entries = meta.get("splits", {}).get(split, {}).get("shards", [])
            sums = [s.get("sha256") if isinstance(s, dict) else None for s in entries]
        else:
            meta = None
        self.shards = open_split(self.dir, split, meta)  # headers and sizes against the manifest's counts
        if not self.shards:
            raise ShardError(f"{self.dir}: no '{split}' shards (run `tlf prep-data` first)")
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.num_tokens = int(self.offsets[-1])
        r, ws = verify or (0, 1)
        self._unverified = (
            {k: s for k, s in enumerate(sums) if isinstance(s, str) and k % ws == r} if verify is not None else {}
        )

    def _verify(self, k: int) -> None:
        from data_prep.assets import sha256_file

        want, path = self._unverified.pop(k), self.shards[k].path
        got = sha256_file(path)
        if got != want:
            raise ShardError(
                f"{path}: sha256 {got[:16]}... differs from the manifest's {want[:16]}... (the shard "
                "changed after prep-data: a bad copy or disk; restore it or rerun prep-data; "
                "data.verify=false skips this check)"
            )

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, n: int) -> np.ndarray:
        """(n,) uint16 tokens from global offset start."""
        if start < 0 or start + n > self.num_tokens:
            raise IndexError(
                f"read [{start}, {start + n}) outside {self.dir} '{self.split}' ({self.num_tokens} tokens)"
            )
        out = np.empty(n, dtype=np.uint16)
        k = int(np.searchsorted(self.offsets, start, side="right") - 1)
        pos, filled = start - int(self.offsets[k]), 0
        while filled < n:
            if k in self._unverified:
                self._verify(k)
            take = min(n - filled, len(self.shards[k]) - pos)
            out[filled : filled + take] = self.shards[k].tokens[pos : pos + take]
            filled += take
            k, pos = k + 1, 0
        return out
