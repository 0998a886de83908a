"""The tokenizer worker: one task (a batch of raw records from one input) in, GPT-2 tokens out.

Runs in a pool process (or inline with workers=0). A record becomes a document's text here (JSON
parsing, UTF-8 decoding), so the reading process only moves bytes. Every document is written as
[EOT] + encode_ordinary(text). Problems name the record (file:line or file row N).
"""

from __future__ import annotations

import array
import json

import numpy as np

from data_prep.tokenizer import EOT

_ENC = None


class PrepInputError(ValueError):
    """Bad input (malformed line, missing text field, truncated file, ...); the message names where."""


def init_worker() -> None:
    global _ENC
    from data_prep.tokenizer import get_encoding

    _ENC = get_encoding()


def _encoder():
    if _ENC is None:
        init_worker()
    return _ENC


def record_text(kind: str, rec, text_field: str, where: str) -> str:
    """The text of one record, or raises PrepInputError naming where."""
    if kind == "json":
        try:
            obj = json.loads(rec)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PrepInputError(f"{where}: malformed JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise PrepInputError(f"{where}: JSON line is a {type(obj).__name__}, not an object")
        if text_field not in obj:
            keys = ", ".join(list(obj)[:8]) or "none"
            raise PrepInputError(f"{where}: no text field '{text_field}' (keys: {keys}); set text_field")
        text = obj[text_field]
    elif kind == "raw":
        try:
            text = rec.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PrepInputError(f"{where}: not valid UTF-8 ({e})") from None
    else:  # "str": already text (parquet column, Hub row); None is a missing value
        text = rec
        if text is None:
            raise PrepInputError(f"{where}: text field '{text_field}' is null")
    if not isinstance(text, str):
        raise PrepInputError(f"{where}: text field '{text_field}' holds {type(text).__name__}, not a string")
    return text


def tokenize_task(kind: str, records: list, where: list[str], text_field: str, skip_bad: bool):
    """-> (tokens uint16 array, per-record lengths int64, [(where, message)] of skipped bad records).

    A length is the document's token count with its EOT, 0 for an empty text, -1 for a skipped bad record.

    `where` holds a label per record (file:line, file row N) for messages."""
    enc = _encoder()
    out = array.array("H")
    lens = np.zeros(len(records), dtype=np.int64)
    bad = []
    for i, rec in enumerate(records):
        loc = where[i]
        try:
            text = record_text(kind, rec, text_field, loc)
        except PrepInputError as e:
            if not skip_bad:
                raise
            bad.append((loc, str(e)))
            lens[i] = -1
            continue
        if not text.strip():
            continue  # empty document: nothing to learn from, not an error
        ids = enc.encode_ordinary(text)
        n0 = len(out)
        out.append(EOT)
        try:
            out.extend(ids)
        except OverflowError:
            big = max(ids)
            raise PrepInputError(
                f"{loc}: token id {big} does not fit uint16 (0..65535); tokenizer {enc.name} has {enc.n_vocab} ids"
            ) from None
        lens[i] = len(out) - n0
    return np.frombuffer(out, dtype=np.uint16) if len(out) else np.zeros(0, np.uint16), lens, bad
