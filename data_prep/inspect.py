"""`tlf data inspect DIR`: the manifest summary, a header check of every shard, decoded samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_prep.shards import EOT, ShardError, ShardReader, open_split, read_manifest
from data_prep.writer import MANIFEST


def _obj(x) -> dict:
    """x when it is a JSON object, else {} (a field of the wrong shape is shown as missing, not a traceback)."""
    return x if isinstance(x, dict) else {}


def _split_readers(d: Path, meta: dict | None) -> dict[str, list[ShardReader]]:
    """Each split's shard readers: headers and sizes checked, against the manifest's token counts when it has one."""
    if meta is not None:
        return {s: open_split(d, s, meta) for s in meta.get("splits", {})}
    out: dict[str, list[ShardReader]] = {}
    for p in sorted(d.glob("*_*_[0-9][0-9][0-9][0-9][0-9][0-9].bin")):
        out.setdefault(p.stem.split("_")[-2], []).append(ShardReader(p))
    return out


def _verify(split: str, meta: dict, readers: list[ShardReader]) -> str:
    """The --verify line of a split: every shard's sha256 against the manifest's (a mismatch is a ShardError);
    shards the manifest records no sha256 for are counted, not checked."""
    from data_prep.assets import sha256_file

    unrecorded = 0
    for sh, r in zip(meta["splits"][split]["shards"], readers):
        want = _obj(sh).get("sha256")
        if want is None:
            unrecorded += 1
            continue
        got = sha256_file(r.path)
        if got != want:
            raise ShardError(f"{r.path}: sha256 {got} does not match the manifest's {want}")
    line = f"  sha256 verified for {len(readers) - unrecorded} shards"
    if unrecorded:
        line += f"; warning: {unrecorded} shards have no sha256 in the manifest (not verified)"
    return line


def inspect(directory: str | Path, samples: int = 3, chars: int = 300, verify: bool = False) -> str:
    """A human-readable report; raises ShardError naming the file for a bad manifest or shard."""
    d = Path(directory)
    if not d.is_dir():
        raise ShardError(f"{d}: not a directory")
    mpath = d / MANIFEST
    meta = None
    lines = [f"directory: {d}"]
    if mpath.is_file():
        meta = read_manifest(mpath)
        src = _obj(meta.get("source"))
        what = src.get("source")
        extra = src.get("inputs") or [name for r in src.get("resolved") or [] if (name := _obj(r).get("dataset"))]
        tok = _obj(meta.get("tokenizer"))
        lines += [
            f"source: {what}" + (f" {extra}" if extra else ""),
            f"tokenizer: {tok.get('name')} (tiktoken {tok.get('library_version')})",
            f"complete: {meta.get('complete')}"
            + ("" if meta.get("complete") else "  (prep-data was interrupted: rerun it to resume)"),
            f"validation rule: {meta.get('val_rule')}",
            f"documents: {json.dumps({k: v for k, v in _obj(meta.get('documents')).items() if k != 'bad_examples'})}",
        ]
    else:
        lines.append("manifest: none (shards found by name)")
    splits = _split_readers(d, meta)  # checks magic, version, size, and each count against the manifest's
    if not any(splits.values()):
        raise ShardError(f"{d}: no shards")
    enc = None
    for split, readers in splits.items():
        n = sum(len(r) for r in readers)
        docs = sum(int(np.count_nonzero(r.tokens == EOT)) for r in readers)
        lines.append(f"split {split}: {len(readers)} shards, {n:,} tokens, {docs:,} documents")
        if verify and meta is not None:
            lines.append(_verify(split, meta, readers))
        if samples and readers:
            if enc is None:
                from data_prep.tokenizer import get_encoding

                enc = get_encoding()
            toks = readers[0].tokens[: 1 << 20]
            if len(toks) and int(toks.max()) >= enc.n_vocab:
                raise ShardError(
                    f"{readers[0].path}: token id {int(toks.max())} is outside the tokenizer's vocabulary "
                    f"({enc.n_vocab} ids); not a shard of this tokenizer, or corrupt"
                )
            starts = np.flatnonzero(toks == EOT)
            for j, s in enumerate(starts[:samples]):
                end = starts[j + 1] if j + 1 < len(starts) else len(toks)
                text = enc.decode(toks[s + 1 : min(end, s + 1 + chars)].tolist())
                lines.append(f"  [{split} doc {j}, {end - s - 1} tokens] {text[:chars]!r}")
    return "\n".join(lines)
