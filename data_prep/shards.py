"""The one shard format and the one shard reader (docs/design.md §3), shared by prep-data, training and evaluation.

A shard is llm.c-compatible: a header of 256 int32 — [0] magic 20240520, [1] version 1, [2] token
count — then that many uint16 tokens. Files are `<name>_<split>_<index:06d>.bin`. Every file is
written atomically (temp name, fsync, rename), so a shard on disk is either complete or absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from data_prep.files import atomic_write_bytes, read_json
from data_prep.tokenizer import EOT  # noqa: F401  (the document separator of every shard)

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


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
    """One shard as a read-only memmap; checks magic, version and that the count matches the file size."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ShardError(f"{self.path}: shard not found")
        size = self.path.stat().st_size
        if size < HEADER_BYTES:
            raise ShardError(f"{self.path}: truncated header ({size} bytes < {HEADER_BYTES})")
        header = np.fromfile(self.path, dtype=np.int32, count=HEADER_INTS)
        if header[0] != MAGIC:
            raise ShardError(f"{self.path}: wrong magic {header[0]} (expected {MAGIC}); not a token shard")
        if header[1] != VERSION:
            raise ShardError(f"{self.path}: unsupported shard version {header[1]} (expected {VERSION})")
        n = int(header[2])
        expected = HEADER_BYTES + 2 * n
        if size != expected:
            raise ShardError(
                f"{self.path}: header says {n} tokens ({expected} bytes) but the file has {size} bytes "
                "(truncated or corrupt)"
            )
        self.num_tokens = n
        self.tokens = (
            np.memmap(self.path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))
            if n
            else np.zeros(0, dtype=np.uint16)
        )

    def __len__(self) -> int:
        return self.num_tokens


def read_manifest(path: str | os.PathLike) -> dict:
    """A manifest.json as a dict, checked for the shape every reader relies on (a mapping whose `splits` maps a
    split to {"shards": [{"name": ...} or name, ...]}); anything else is a ShardError naming the file and key."""
    path = Path(path)
    meta = read_json(path, ShardError)
    if not isinstance(meta, dict):
        raise ShardError(f"{path}: top level must be a JSON object, not {type(meta).__name__}")
    splits = meta.get("splits", {})
    if not isinstance(splits, dict):
        raise ShardError(f"{path}: key 'splits' must be an object of splits, not {type(splits).__name__}")
    for split, info in splits.items():
        shards = info.get("shards", []) if isinstance(info, dict) else None
        if not isinstance(shards, list) or not all(
            isinstance(s, str) or (isinstance(s, dict) and isinstance(s.get("name"), str)) for s in shards
        ):
            raise ShardError(
                f"{path}: key 'splits.{split}.shards' must be a list of shard names or {{\"name\": ...}} objects"
            )
    return meta


def manifest_shards(meta: dict, split: str) -> list[str]:
    """The shard file names of `split` in a manifest checked by read_manifest."""
    return [s["name"] if isinstance(s, dict) else s for s in meta.get("splits", {}).get(split, {}).get("shards", [])]


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
            paths = [self.dir / n for n in manifest_shards(meta, split)]
            entries = meta.get("splits", {}).get(split, {}).get("shards", [])
            sums = [s.get("sha256") if isinstance(s, dict) else None for s in entries]
        else:
            paths = sorted(self.dir.glob(f"*_{split}_*.bin"))
        if not paths:
            raise ShardError(f"{self.dir}: no '{split}' shards (run `tlf prep-data` first)")
        self.shards = [ShardReader(p) for p in paths]
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
