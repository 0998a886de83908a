"""Per-split shard buffers and the manifest (docs/design.md §3).

`SplitWriter` fills one shard-sized uint16 buffer and writes it atomically when full, recording name,
token count, document count (EOTs: exactly one per document start) and sha256 of the file bytes.
`manifest()` builds manifest.json; it is rewritten atomically after every shard, with the resume state.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from data_prep.files import atomic_write_bytes
from data_prep.shards import DTYPE, FORMAT, HEADER_INTS, MAGIC, VERSION, shard_name
from data_prep.tokenizer import EOT

MANIFEST = "manifest.json"


def write_tokens(path: Path, tokens: np.ndarray) -> str:
    """Writes a uint16 array as one shard file (atomic); returns the file's sha256."""
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
    hb, body = header.tobytes(), memoryview(np.ascontiguousarray(tokens, dtype=np.uint16)).cast("B")
    h = hashlib.sha256(hb)
    h.update(body)
    atomic_write_bytes(path, [hb, body])
    return h.hexdigest()


class SplitWriter:
    """Token stream of one split -> shards of exactly `cap` tokens (the last may be shorter)."""

    def __init__(
        self, out: Path, name: str, split: str, cap: int, shards: list | None = None, pending: np.ndarray | None = None
    ):
        self.out, self.name, self.split, self.cap = out, name, split, cap
        self.shards = list(shards or [])
        self.buf = np.empty(cap, dtype=np.uint16)  # pages are touched only as they fill
        self.fill = 0
        if pending is not None and pending.size:
            self.buf[: pending.size] = pending
            self.fill = pending.size

    @property
    def committed(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def room(self) -> int:
        return self.cap - self.fill

    def append(self, toks: np.ndarray) -> None:
        """Appends tokens that fit in the current shard (no commit)."""
        n = toks.size
        assert n <= self.room()
        self.buf[self.fill : self.fill + n] = toks
        self.fill += n

    def add(self, toks: np.ndarray, on_commit) -> None:
        """Appends tokens, writing a shard each time the buffer fills; on_commit(tokens of toks used) after each."""
        pos = 0
        while pos < toks.size:
            take = min(toks.size - pos, self.room())
            self.append(toks[pos : pos + take])
            pos += take
            if self.fill == self.cap:
                self.commit()
                on_commit(pos)

    def pending(self) -> np.ndarray:
        return self.buf[: self.fill]

    def commit(self) -> None:
        """Writes the buffer as the next shard (no-op when empty)."""
        if not self.fill:
            return
        body = self.buf[: self.fill]
        fname = shard_name(self.name, self.split, len(self.shards))
        sha = write_tokens(self.out / fname, body)
        self.shards.append(
            {"name": fname, "tokens": int(self.fill), "docs": int(np.count_nonzero(body == EOT)), "sha256": sha}
        )
        self.fill = 0

    def summary(self) -> dict:
        return {"shards": self.shards, "tokens": self.committed, "docs": sum(s["docs"] for s in self.shards)}


def manifest(
    *,
    fingerprint: dict,
    inputs: list,
    writers: dict,
    counters: dict,
    complete: bool,
    resume: dict | None,
    tokenizer: dict,
    val_rule: str,
    shard_tokens: int,
) -> dict:
    splits = {s: w.summary() for s, w in writers.items() if w.shards}
    return {
        "format": FORMAT,
        "complete": complete,
        "source": {**fingerprint, "resolved": inputs},
        "tokenizer": tokenizer,
        "shard_format": {
            "header": "256 x int32: [0] magic, [1] version, [2] token count",
            "magic": MAGIC,
            "version": VERSION,
            "dtype": DTYPE,
            "eot": EOT,
            "eot_rule": "EOT before every document; a document may span shards",
            "shard_tokens": shard_tokens,
        },
        "val_rule": val_rule,
        "splits": splits,
        "total_tokens": sum(v["tokens"] for v in splits.values()),
        "documents": dict(counters),
        "resume": resume,
    }
