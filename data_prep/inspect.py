"""`tlf data inspect DIR`: the manifest summary, a header check of every shard, decoded samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_prep.shards import EOT, ShardError, ShardReader, manifest_shards, read_manifest
from data_prep.writer import MANIFEST


def _obj(x) -> dict:
    """x when it is a JSON object, else {} (a field of the wrong shape is shown as missing, not a traceback)."""
    return x if isinstance(x, dict) else {}


def _shard_paths(d: Path, meta: dict | None) -> dict[str, list[Path]]:
    if meta is not None:
        return {s: [d / n for n in manifest_shards(meta, s)] for s in meta.get("splits", {})}
    out: dict[str, list[Path]] = {}
    for p in sorted(d.glob("*_*_[0-9][0-9][0-9][0-9][0-9][0-9].bin")):
        out.setdefault(p.stem.split("_")[-2], []).append(p)
    return out


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
    paths = _shard_paths(d, meta)
    if not any(paths.values()):
        raise ShardError(f"{d}: no shards")
    enc = None
    for split, ps in paths.items():
        readers = [ShardReader(p) for p in ps]  # checks magic, version, size
        n = sum(len(r) for r in readers)
        docs = sum(int(np.count_nonzero(r.tokens == EOT)) for r in readers)
        lines.append(f"split {split}: {len(ps)} shards, {n:,} tokens, {docs:,} documents")
        if verify and meta is not None:
            from data_prep.assets import sha256_file

            for sh, p in zip(meta["splits"][split]["shards"], ps):
                got = sha256_file(p)
                want = _obj(sh).get("sha256")
                if got != want:
                    raise ShardError(f"{p}: sha256 {got} does not match the manifest's {want}")
            lines.append(f"  sha256 verified for {len(ps)} shards")
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
