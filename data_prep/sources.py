"""Document sources: local files (jsonl, jsonl.zst, parquet, txt) and the demo corpora.

A source yields `Task`s: a batch of raw records from one input file, in input order, with what is
needed to name each record in errors (file:line, file row N) and to resume at any record (a cursor:
file index, line/row number, and the byte offset for plain files, so resuming seeks instead of
re-reading). Readers stream: memory is bounded by the batch size, never the corpus.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.worker import PrepInputError

SUFFIXES = (".jsonl", ".jsonl.zst", ".parquet", ".txt", ".txt.zst")


@dataclass
class Task:
    kind: str  # "json" (bytes lines), "raw" (bytes text), "str" (text)
    records: list
    where: list  # a label per record for messages
    locs: list  # 1-based line / row number per record
    file: int = 0  # input index
    offsets: list | None = None  # byte offset of each record (plain files), for seeking on resume
    progress: float | None = None  # fraction of the input done after this task
    extra: dict = field(default_factory=dict)  # source-specific resume state (Hub iterator state)

    def cursor(self, i: int) -> dict:
        """Where record i starts, for resuming there."""
        c = {"file": self.file, "loc": self.locs[i], "offset": self.offsets[i] if self.offsets else None}
        c.update(self.extra)
        if self.extra:
            c["skip"] = i
        return c

    def nbytes(self) -> int:
        return sum(len(r) for r in self.records if r is not None)


def fmt_of(path: Path) -> str | None:
    name = path.name.lower()
    for s in SUFFIXES:
        if name.endswith(s):
            return s
    return None


def resolve_inputs(specs: list[str]) -> list[Path]:
    """Files, globs and directories (recursive) -> input files, each group sorted, duplicates dropped."""
    out: list[Path] = []
    for spec in specs:
        p = Path(os.path.expanduser(spec))
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and fmt_of(f) and not f.name.startswith("."))
            what = f"directory {spec}"
        elif any(c in spec for c in "*?["):
            files = sorted(
                Path(f)
                for f in glob.glob(os.path.expanduser(spec), recursive=True)
                if Path(f).is_file() and fmt_of(Path(f))
            )
            what = f"glob {spec}"
        elif p.is_file():
            if not fmt_of(p):
                raise PrepInputError(f"{spec}: unsupported input format (expected {', '.join(SUFFIXES)})")
            files, what = [p], spec
        else:
            raise PrepInputError(f"input not found: {spec}")
        if not files:
            raise PrepInputError(f"empty input: {what} holds no {', '.join(SUFFIXES)} files")
        for f in files:
            if f not in out:
                out.append(f)
    return out


# ---------------------------------------------------------------------------------------------------
# Byte streams
# ---------------------------------------------------------------------------------------------------
class _Counter:
    """Raw (compressed) bytes read so far, for progress."""

    pos = 0


def _zst_chunks(path: Path, counter: _Counter):
    """Decompressed chunks of a (multi-frame) .zst file; a truncated or corrupt stream is an error
    (python-zstandard's stream reader silently stops at a cut frame, so frames are tracked here)."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    d, produced = None, 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                break
            counter.pos += len(chunk)
            while chunk:
                if d is None:
                    d = dctx.decompressobj()
                try:
                    out = d.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise PrepInputError(
                        f"{path}: corrupt zstd stream after {produced} decompressed bytes ({e})"
                    ) from None
                produced += len(out)
                if out:
                    yield out
                if d.eof:
                    chunk, d = d.unused_data, None
                else:
                    chunk = b""
    if d is not None and not d.eof:
        raise PrepInputError(
            f"{path}: truncated zstd stream (ends inside a frame after {produced} decompressed "
            "bytes); the file is incomplete, re-download or re-compress it"
        )


def _split_lines(chunks):
    """(line without its newline, bytes it took including the newline) from a stream of byte chunks;
    splitting whole chunks in C (much faster than line-by-line reads of long lines)."""
    rest: list = []
    for chunk in chunks:
        parts = chunk.split(b"\n")
        if len(parts) == 1:
            rest.append(chunk)
            continue
        if rest:
            parts[0] = b"".join(rest) + parts[0]
        rest = [parts[-1]] if parts[-1] else []
        for p in parts[:-1]:
            yield p, len(p) + 1
    if rest:
        tail = b"".join(rest)
        yield tail, len(tail)


def _plain_chunks(path: Path, offset: int, counter: _Counter):
    with open(path, "rb") as fh:
        fh.seek(offset)
        counter.pos = offset
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                return
            counter.pos += len(chunk)
            yield chunk


def _lines(path: Path, start_line: int, offset: int | None, counter: _Counter):
    """(1-based line number, byte offset or None for .zst, line bytes without the newline or a trailing
    carriage return) from start_line; plain files seek to offset (the byte offset of start_line)."""
    zst = fmt_of(path).endswith(".zst")
    if zst:
        chunks, n, pos = _zst_chunks(path, counter), 1, 0
    else:
        chunks, n, pos = _plain_chunks(path, offset or 0, counter), (start_line if offset else 1), offset or 0
    for line, size in _split_lines(chunks):
        if n >= start_line:
            yield n, (None if zst else pos), (line[:-1] if line.endswith(b"\r") else line)
        n += 1
        pos += size


# ---------------------------------------------------------------------------------------------------
# File sources
# ---------------------------------------------------------------------------------------------------
class FileSource:
    """Local inputs in order; records are jsonl lines, parquet rows or txt documents (txt_mode)."""

    def __init__(self, files: list[Path], text_field: str = "text", txt_mode: str = "file", batch_bytes: int = 1 << 20):
        self.files = files
        self.text_field = text_field
        self.txt_mode = txt_mode
        self.batch_bytes = batch_bytes
        self.sizes = [f.stat().st_size for f in files]
        self.total = sum(self.sizes) or 1

    def describe(self) -> list[dict]:
        return [{"path": str(f), "bytes": s} for f, s in zip(self.files, self.sizes)]

    def tasks(self, cursor: dict | None = None):
        start_file = cursor["file"] if cursor else 0
        for fi in range(start_file, len(self.files)):
            c = cursor if cursor and fi == start_file else None
            path, done_before = self.files[fi], sum(self.sizes[:fi])
            counter = _Counter()
            fmt = fmt_of(path)
            if fmt == ".parquet":
                gen = self._parquet(path, fi, c)
            elif fmt.startswith(".jsonl"):
                gen = self._line_records(path, fi, c, counter, "json", "line")
            elif self.txt_mode == "file":
                gen = self._whole(path, fi, counter)
            else:
                gen = self._line_records(path, fi, c, counter, "raw", self.txt_mode)
            for task in gen:
                if task.progress is None:
                    task.progress = (done_before + min(counter.pos, self.sizes[fi])) / self.total
                yield task

    def _batcher(self, kind, fi, offsets: bool):
        return Task(kind, [], [], [], fi, [] if offsets else None)

    def _line_records(self, path, fi, c, counter, kind, mode):
        """jsonl lines (mode line, kind json) or txt lines/paragraphs (kind raw)."""
        start, offset = (c["loc"], c["offset"]) if c else (1, 0)
        plain = not fmt_of(path).endswith(".zst")
        task, size = self._batcher(kind, fi, plain), 0
        para, para_loc, para_off = [], None, None

        def add(rec, loc, off):
            nonlocal size
            task.records.append(rec)
            task.locs.append(loc)
            task.where.append(f"{path}:{loc}")
            if plain:
                task.offsets.append(off)
            size += len(rec)

        for n, off, line in _lines(path, start, offset if plain else None, counter):
            if mode == "paragraph":
                if line.strip():
                    if not para:
                        para_loc, para_off = n, off
                    para.append(line)
                    continue
                if not para:
                    continue
                add(b"\n".join(para), para_loc, para_off)
                para = []
            else:
                if kind == "json" and not line.strip():
                    continue  # blank lines in jsonl are not records
                add(line, n, off)
            if size >= self.batch_bytes:
                yield task
                task, size = self._batcher(kind, fi, plain), 0
        if para:
            add(b"\n".join(para), para_loc, para_off)
        if task.records:
            task.progress = None
            yield task

    def _whole(self, path, fi, counter):
        if fmt_of(path).endswith(".zst"):
            data = b"".join(_zst_chunks(path, counter))
        else:
            data = path.read_bytes()
            counter.pos = len(data)
        yield Task("raw", [data], [str(path)], [1], fi, [0])

    def _parquet(self, path, fi, c):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise PrepInputError(f"{path}: not a readable parquet file ({e})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise PrepInputError(
                f"{path}: no column '{self.text_field}' (columns: {', '.join(names[:12])}); set text_field"
            )
        ftype = pf.schema_arrow.field(self.text_field).type
        if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
            raise PrepInputError(f"{path}: column '{self.text_field}' has type {ftype}, not string")
        first = (c["loc"] - 1) if c else 0  # 0-based row to start at
        groups, row0 = [], 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if groups or row0 + n > first:
                groups.append(g)
            else:  # a whole row group before the cursor: skipped without reading
                row0 += n
        total = max(pf.metadata.num_rows, 1)
        row, task, size = row0, self._batcher("str", fi, False), 0
        if not groups:
            return
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field], row_groups=groups):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if row <= first:
                        continue
                    task.records.append(text)
                    task.locs.append(row)
                    task.where.append(f"{path} row {row}")
                    size += len(text) if text else 0
                if size >= self.batch_bytes:
                    task.progress = (sum(self.sizes[:fi]) + self.sizes[fi] * row / total) / self.total
                    yield task
                    task, size = self._batcher("str", fi, False), 0
        except (pa.ArrowInvalid, OSError) as e:
            raise PrepInputError(f"{path}: corrupt parquet file near row {row} ({e})") from None
        if task.records:
            yield task
