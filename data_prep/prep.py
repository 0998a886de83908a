"""`prepare(cfg)`: documents -> GPT-2 tokens -> llm.c shards, resumable, same bytes for any worker count.

Flow: the source yields tasks (batches of raw records) in input order; a pool of tokenizer processes
works on a bounded number of them at once and results are consumed in submission order, so the token
stream is fixed by the input alone. Document number i (counting kept documents) goes to val when
i % val_every == 0, or with val_every=0 by the token rule of data_prep/valsplit.py (val_tokens: the tokens
routed to val so far), else to train; each split fills its own shard buffer.

Resume: after every shard, the manifest records a checkpoint at the document d in which that shard
ended: the source cursor of d, how many of d's tokens were already written, the counters (and val's
tokens) at d's start, and the other splits' unwritten tokens (saved atomically as
`.resume_<split>_<n>.bin`). A rerun with the same options seeks to d, drops the written tokens, restores
the buffers, and continues; the shards come out byte-identical to an uninterrupted run. Write order: shard, resume buffers, manifest.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import socket
import sys
from collections import deque
from pathlib import Path

import numpy as np

from data_prep import foldtask, valsplit
from data_prep.assets import ensure_assets
from data_prep.config import FOLD, PrepConfig, changed_options
from data_prep.files import check_writable, new_dirs_removed_on_error, write_json
from data_prep.shards import ShardError, ShardReader, read_manifest
from data_prep.hf import HubSource
from data_prep.sources import FileSource, resolve_inputs
from data_prep.tokenizer import EOT, MAX_UINT16_VOCAB, TOKENIZER, get_encoding
from data_prep.worker import PrepInputError, init_worker, tokenize_task
from data_prep.writer import MANIFEST, SplitWriter, manifest, write_tokens

SPLITS = ("train", "val")
MAX_BAD_EXAMPLES = 20


class PrepError(RuntimeError):
    """prep-data cannot go on (output directory conflict, damaged resume state); the message says why."""


# ---------------------------------------------------------------------------------------------------
# Ordered, bounded parallel map
# ---------------------------------------------------------------------------------------------------
def make_pool(workers: int, initializer=init_worker):
    """A pool of worker processes (None for workers=0), each started by `initializer` (default: load the
    tokenizer; None for work that needs none). Forked where possible: a spawned child would re-import the
    launching script (for `tlf`, every command's imports, torch included). Create it before any helper thread
    (progress bar, Hub client) starts."""
    if workers == 0:
        return None
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    return mp.get_context(method).Pool(workers, initializer=initializer)


@contextlib.contextmanager
def tokenizer_pool(workers: int, initializer=init_worker):
    """`make_pool` for a `with` block. The pool is shut down the quiet way, close() then join(), when the block
    ends normally or stops early (max_tokens; `ordered_results` has by then collected the tasks it had in
    flight), and terminated only when the block raises: terminating workers that may hold the task queue's lock
    is the one shutdown CPython's Pool can hang in, and it is kept for errors, where waiting is worse."""
    pool = make_pool(workers, initializer)
    if pool is None:
        yield None
        return
    try:
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


def ordered_results(tasks, pool, workers: int, text_field: str, skip_bad: bool):
    """(task, tokenize_task result) in task order; at most 2*workers+2 tasks in flight (bounded memory).
    An error in the reader is raised only after the tasks before it, so the first bad record is reported.
    Closed before the end (the caller has enough tokens), it first waits for the tasks still in flight, so the
    pool can be closed without terminating a worker mid-task; shutting the pool down is its owner's job
    (`tokenizer_pool`)."""

    def args(t):
        return (t.kind, t.records, t.where, text_field, skip_bad)

    if pool is None:
        for t in tasks:
            r = tokenize_task(*args(t))
            t.records = t.where = None
            yield t, r
        return
    q: deque = deque()
    try:
        it = iter(tasks)
        while True:
            try:
                t = next(it)
            except StopIteration:
                break
            except PrepInputError:  # a reader error comes after the records already read
                while q:
                    t0, r = q.popleft()
                    yield t0, r.get()
                raise
            q.append((t, pool.apply_async(tokenize_task, args(t))))
            t.records = t.where = None
            if len(q) >= 2 * workers + 2:
                t0, r = q.popleft()
                yield t0, r.get()
        while q:
            t0, r = q.popleft()
            yield t0, r.get()
    except GeneratorExit:  # stopped early: let the tasks in flight finish (each is one bounded batch)
        for _, r in q:
            r.wait()
        raise


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def tokenizer_info() -> dict:
    """The manifest's tokenizer entry; places the BPE files and sets TIKTOKEN_CACHE_DIR before workers start."""
    enc = get_encoding(TOKENIZER)
    if enc.n_vocab > MAX_UINT16_VOCAB:
        raise PrepError(f"tokenizer {enc.name} has {enc.n_vocab} ids; uint16 shards hold at most 65536")
    import tiktoken

    return {
        "name": enc.name,
        "library": "tiktoken",
        "library_version": tiktoken.__version__,
        "n_vocab": enc.n_vocab,
        "eot": EOT,
    }


def _generate_fold(cfg: PrepConfig, out: Path, overwrite: bool, log) -> tuple[dict, bool]:
    """source=depth-fold: written in one pass, the documents made by `workers` processes; an existing manifest is
    kept only if it matches. Returns (manifest, written)."""
    old = out / MANIFEST
    if old.is_file() and not overwrite:
        try:
            m = read_manifest(old)
        except ShardError as e:
            raise PrepError(f"{e}; use --overwrite to start again") from None
        if m.get("complete") and not changed_options(m["source"], cfg.fingerprint()):
            log(f"{out} is already complete ({m['total_tokens']:,} tokens); nothing to do")
            return m, False
        raise PrepError(f"{out}: holds shards of other options ({old}); use --overwrite or another --out")
    for f in out.glob("*.bin"):
        f.unlink()
    info = tokenizer_info()
    with tokenizer_pool(
        cfg.resolved_workers() if cfg.depth_docs > foldtask.CHUNK_DOCS else 0, initializer=None
    ) as pool:
        return foldtask.generate(cfg, out, info, log, pool), True


def make_source(cfg: PrepConfig, files: list[Path] | None = None):
    """The source for a PrepConfig: the demo corpora, local files (resolved from cfg.inputs unless given), or a Hub
    dataset."""
    if cfg.source in ("demo", "demo-enwiki"):
        path = Path(ensure_assets()[cfg.source])
        return FileSource([path], "text", "file", cfg.batch_bytes)
    if cfg.source == "files":
        return FileSource(files or resolve_inputs(cfg.inputs), cfg.text_field, cfg.txt_mode, cfg.batch_bytes)
    return HubSource(cfg)


class _Run:
    def __init__(self, cfg: PrepConfig, overwrite: bool, log):
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer_info()
        self.name = cfg.resolved_name()
        self.val_every = cfg.resolved_val_every()
        self.source = make_source(cfg)
        self.inputs = self.source.describe()
        self.fingerprint = cfg.fingerprint()
        self.val_rule = (
            "no val split"
            if self.val_every < 0
            else valsplit.RULE
            if self.val_every == 0
            else f"document i (0-based, kept documents in input order) goes to val when i % {self.val_every} == 0"
        )
        self.partials: dict[str, str] = {}
        self.seq = 0
        self._load(overwrite)

    # -- state --------------------------------------------------------------------------------------
    def _fresh(self):
        self.writers = {s: SplitWriter(self.out, self.name, s, self.cfg.shard_tokens) for s in SPLITS}
        self.doc = 0  # index of the next kept document
        self.produced = 0  # tokens in all splits so far (written or buffered)
        self.val_tokens = 0  # of which in val (the token rule's state)
        self.counters = {"records": 0, "kept": 0, "skipped_bad": 0, "skipped_empty": 0}
        self.bad_examples: list = []
        self.cursor = None
        self.drop = 0  # tokens of the first replayed document already written
        self.complete = False

    def _clean_stale(self, keep: set) -> None:
        for p in self.out.iterdir():
            n = p.name
            ours = re.fullmatch(
                rf"\.?({re.escape(self.name)}_(train|val)_\d{{6}}\.bin|\.?resume_(train|val)_\d{{6}}\.bin|"
                rf"manifest\.json)(\.tmp\d+)?",
                n,
            )
            if ours and not (n == MANIFEST) and n not in keep and p.is_file():
                p.unlink()

    def _load(self, overwrite: bool) -> None:
        self._fresh()
        mpath = self.out / MANIFEST
        if not mpath.is_file() or overwrite:
            if mpath.is_file():
                mpath.unlink()
            self._clean_stale(set())
            return
        try:
            m = read_manifest(mpath)
        except ShardError as e:
            raise PrepError(f"unreadable manifest: {e}; pass --overwrite to start again") from None
        try:
            self._resume_from(m)
        except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
            raise PrepError(
                f"{mpath}: damaged resume state ({type(e).__name__}: {e}); pass --overwrite to start again"
            ) from None

    def _resume_from(self, m: dict) -> None:
        diff = changed_options(m.get("source", {}), self.fingerprint)
        if m.get("source", {}).get("resolved") != self.inputs:
            diff.append("inputs (resolved files or their sizes)")
        if diff:
            raise PrepError(
                f"{self.out} already holds shards made with other options (differs in: {', '.join(diff)}); "
                "rerun the same command to resume, choose another --out, or pass --overwrite"
            )
        self.complete = bool(m.get("complete"))
        splits = m.get("splits", {})
        for s in SPLITS:
            shards = splits.get(s, {}).get("shards", [])
            for i, sh in enumerate(shards):
                try:
                    ShardReader(
                        self.out / sh["name"], (self.out / MANIFEST, f"splits.{s}.shards[{i}].tokens", sh["tokens"])
                    )
                except ShardError as e:
                    raise PrepError(f"cannot resume: {e}; pass --overwrite to start again") from None
            self.writers[s].shards = shards
        if self.complete:  # a kill between the final manifest and removing the resume buffers left them
            self.manifest = m
            self._clean_stale({sh["name"] for w in self.writers.values() for sh in w.shards})
            return
        r = m.get("resume") or {}
        self.doc, self.produced, self.val_tokens = r.get("doc", 0), r.get("produced", 0), r.get("val_tokens", 0)
        self.counters.update(r.get("counters", {}))
        self.bad_examples = r.get("bad_examples", [])
        self.cursor, self.drop = r.get("cursor"), r.get("drop", 0)
        for s, info in (r.get("partials") or {}).items():
            try:
                pend = ShardReader(self.out / info["file"]).tokens
            except ShardError as e:
                raise PrepError(f"cannot resume: {e}; pass --overwrite to start again") from None
            self.writers[s] = SplitWriter(
                self.out, self.name, s, self.cfg.shard_tokens, self.writers[s].shards, np.array(pend)
            )
            self.partials[s] = info["file"]
            self.seq = max(self.seq, int(info["file"].rsplit("_", 1)[1].split(".")[0]) + 1)
        keep = {sh["name"] for w in self.writers.values() for sh in w.shards} | set(self.partials.values())
        self._clean_stale(keep)
        if self.doc or self.produced:
            self.log(f"resuming {self.out} at document {self.doc} ({self.produced:,} tokens already in shards)")

    def _manifest(self, complete: bool, resume: dict | None) -> dict:
        counters = dict(self.counters)
        if self.bad_examples:
            counters["bad_examples"] = self.bad_examples
        return manifest(
            fingerprint=self.fingerprint,
            inputs=self.inputs,
            writers=self.writers,
            counters=counters,
            complete=complete,
            resume=resume,
            tokenizer=self.tokenizer,
            val_rule=self.val_rule,
            shard_tokens=self.cfg.shard_tokens,
        )

    def _checkpoint(self, split: str, doc: int, cursor: dict, used: int, start: tuple, counters: dict) -> None:
        """After a shard of `split` ended `used` tokens into document `doc`, which started at `start` = (tokens
        produced, of which in val): save what resume needs."""
        partials = {}
        old = dict(self.partials)
        for s, w in self.writers.items():
            if s != split and w.fill:
                fname = f".resume_{s}_{self.seq:06d}.bin"
                self.seq += 1
                sha = write_tokens(self.out / fname, w.pending())
                partials[s] = {"file": fname, "tokens": int(w.fill), "sha256": sha}
        resume = {
            "doc": doc,
            "cursor": cursor,
            "drop": used,
            "produced": start[0],
            "val_tokens": start[1],
            "counters": counters,
            "bad_examples": self.bad_examples[:],
            "partials": partials,
        }
        write_json(self.out / MANIFEST, self._manifest(False, resume), sort_keys=True)
        self.partials = {s: p["file"] for s, p in partials.items()}
        for f in old.values():
            if f not in self.partials.values():
                (self.out / f).unlink(missing_ok=True)

    # -- main loop ----------------------------------------------------------------------------------
    def split_of(self, d: int, n: int) -> str:
        """The split of document d, of n tokens, read after self.produced tokens; counts val's tokens."""
        if self.val_every == 0:
            val = valsplit.to_val(self.val_tokens, self.produced, n)
        else:
            val = self.val_every > 0 and d % self.val_every == 0
        self.val_tokens += n if val else 0
        return "val" if val else "train"

    def _runs(self, toks_kept: int, lens: np.ndarray) -> list[tuple[str, int, int]]:
        """The documents of a task (their token counts `lens`, all kept), as runs of consecutive documents of one
        split: (split, first token, end token) slices of the task's tokens (no per-token masks: memcpy only)."""
        k = lens.size
        if k == 0:
            return []
        if self.val_every in (-1, 1):
            return [("val" if self.val_every == 1 else "train", 0, toks_kept)]
        if self.val_every > 0:
            is_val = (self.doc + np.arange(k)) % self.val_every == 0
        else:  # the token rule: each document's split depends on the ones before it
            is_val, produced, val = np.zeros(k, dtype=bool), self.produced, self.val_tokens
            for i, n in enumerate(lens.tolist()):
                is_val[i] = valsplit.to_val(val, produced, n)
                produced, val = produced + n, val + (n if is_val[i] else 0)
        ends = np.cumsum(lens)
        cut = np.flatnonzero(is_val[1:] != is_val[:-1]) + 1  # first document of each new run
        firsts, lasts = np.r_[0, cut], np.r_[cut, k] - 1
        return [
            ("val" if is_val[a] else "train", int(ends[a] - lens[a]), int(ends[b]))
            for a, b in zip(firsts.tolist(), lasts.tolist())
        ]

    def run(self, progress: bool) -> tuple[dict, bool]:
        """(the final manifest, whether this run wrote it: False for an output already complete)."""
        if self.complete:
            self.log(f"{self.out} is already complete ({self.manifest['total_tokens']:,} tokens); nothing to do")
            return self.manifest, False
        if hasattr(self.source, "check"):  # a remote source answers before anything is written or drawn
            self.source.check()
        fresh = self.doc == 0 and self.produced == 0
        if fresh:
            write_json(self.out / MANIFEST, self._manifest(False, None), sort_keys=True)
        try:
            return self._produce(fresh, progress), True
        except BaseException:
            if fresh and self.counters["kept"] == 0:  # failed before its first document: no manifest left behind
                (self.out / MANIFEST).unlink(missing_ok=True)
            raise

    def _produce(self, fresh: bool, progress: bool) -> dict:
        cfg = self.cfg
        workers = cfg.resolved_workers()
        with tokenizer_pool(workers) as pool:
            self._tokenize_all(pool, workers, progress)
        if self.counters["kept"] == 0:
            (self.out / MANIFEST).unlink(missing_ok=True)
            what = ", ".join(str(i.get("path") or i.get("dataset")) for i in self.inputs)
            extra = f" ({self.counters['skipped_bad']} bad records skipped)" if self.counters["skipped_bad"] else ""
            raise PrepInputError(f"empty input: {what} produced no documents{extra}")
        for w in self.writers.values():
            w.commit()
        m = self._manifest(True, None)
        write_json(self.out / MANIFEST, m, sort_keys=True)
        for f in self.partials.values():
            (self.out / f).unlink(missing_ok=True)
        if self.counters["skipped_bad"]:
            self.log(f"skipped {self.counters['skipped_bad']} bad records, e.g. {self.bad_examples[0]}")
        return m

    def _tokenize_all(self, pool, workers: int, progress: bool) -> None:
        """Tokenises the source's tasks through `pool` and routes their documents until the source ends or
        max_tokens is reached."""
        cfg = self.cfg
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.max_tokens or None,
                initial=self.produced,
                unit="tok",
                unit_scale=True,
                dynamic_ncols=True,
                desc=f"prep-data {self.name}",
                file=sys.stderr,
                smoothing=0.05,
            )
        self.first = True
        results = ordered_results(self.source.tasks(self.cursor), pool, workers, cfg.text_field, cfg.skip_bad)
        try:
            for task, (toks, lens, bad) in results:
                before = self.produced
                stop = self._task(task, toks, lens, bad)
                if bar is not None:
                    bar.update(self.produced - before)
                    if not cfg.max_tokens and task.progress:
                        bar.total = max(int(self.produced / task.progress), self.produced)
                    bar.set_postfix(docs=self.counters["kept"], refresh=False)
                if stop:
                    break
        finally:
            results.close()
            if bar is not None:
                bar.close()

    def _note_bad(self, bad: list) -> None:
        room = MAX_BAD_EXAMPLES - len(self.bad_examples)
        if room > 0:
            self.bad_examples += [m for _, m in bad[:room]]

    def _task(self, task, toks: np.ndarray, lens: np.ndarray, bad: list) -> bool:
        """Routes one task's documents; returns True once max_tokens is reached."""
        kept = lens > 0
        k = int(kept.sum())
        total = int(toks.size)
        cap = self.cfg.max_tokens
        fast = not self.first and not (cap and self.produced + total >= cap)
        if fast:
            runs = self._runs(total, lens[kept])
            need = {"train": 0, "val": 0}
            for s, a, b in runs:
                need[s] += b - a
            fast = all(self.writers[s].room() > n for s, n in need.items())
        if fast:  # no shard ends inside this task: no checkpoint needed
            for s, a, b in runs:
                self.writers[s].append(toks[a:b])
            self.val_tokens += need["val"]
            self.doc += k
            self.produced += total
            self.counters["records"] += lens.size
            self.counters["kept"] += k
            self.counters["skipped_bad"] += int((lens < 0).sum())
            self.counters["skipped_empty"] += int((lens == 0).sum())
            self._note_bad(bad)
            return False
        return self._task_slow(task, toks, lens, bad)

    def _task_slow(self, task, toks: np.ndarray, lens: np.ndarray, bad: list) -> bool:
        pos, nbad = 0, 0
        for i, n in enumerate(lens.tolist()):
            if n <= 0:
                if n < 0:
                    self._note_bad(bad[nbad : nbad + 1])
                    nbad += 1
                self.counters["records"] += 1
                self.counters["skipped_bad" if n < 0 else "skipped_empty"] += 1
                continue
            doc_toks = toks[pos : pos + n]
            pos += n
            d, start, start_counters = self.doc, (self.produced, self.val_tokens), dict(self.counters)
            cap = self.cfg.max_tokens
            if cap:
                doc_toks = doc_toks[: max(0, cap - self.produced)]
            split = self.split_of(d, doc_toks.size)
            self.produced += doc_toks.size
            self.counters["records"] += 1
            self.counters["kept"] += 1
            self.doc += 1
            drop = self.drop if self.first else 0
            self.first = False
            cursor = None

            def on_commit(used, split=split, d=d, i=i, drop=drop, st=start, sc=start_counters):
                nonlocal cursor
                cursor = cursor or task.cursor(i)
                self._checkpoint(split, d, cursor, drop + used, st, sc)

            self.writers[split].add(doc_toks[drop:], on_commit)
            if cap and self.produced >= cap:
                return True
        self.first = False
        return False


def prepare(cfg: PrepConfig, overwrite: bool = False, log=None) -> dict:
    """Runs (or resumes, or recognises as complete) prep-data for cfg; returns the final manifest."""
    return prepare_status(cfg, overwrite, log)[0]


def tiny_val(m: dict, val_every: int) -> str | None:
    """The warning for a manifest whose val split is too small to trust (`valsplit.short_note`: too few tokens or
    documents), naming the rule that made it; None when it is large enough or there is none by choice."""
    val, train = m["splits"].get("val"), m["splits"].get("train")
    if val_every < 0:
        return None
    note = valsplit.short_note(val["tokens"], val["docs"]) if val else "is empty"
    if note is None:
        return None
    rule = "by tokens (docs/data.md)" if val_every == 0 else f"every {val_every}-th document (--val-every)"
    held = f"; train holds {train['tokens']:,} tokens of {train['docs']:,} documents" if train else ""
    return (
        f"warning: the val split {note}; val chosen {rule}{held}. The validation loss, tlf eval's perplexity, "
        "tlf compare and the model card repeat this"
    )


def prepare_status(cfg: PrepConfig, overwrite: bool = False, log=None) -> tuple[dict, bool]:
    """`prepare`, also saying whether it wrote the manifest (False: the output was already complete); warns
    (`tiny_val`) when the val split of text it wrote is too small to trust (the fold task's short documents are
    not judged by it). One prep-data at a time per output directory (an exclusive lock on OUT/.lock)."""
    log = log or (lambda m: print(m, file=sys.stderr))
    out = Path(cfg.out)
    had_lock = (out / ".lock").exists()
    with new_dirs_removed_on_error(out):  # failed before writing anything: nor the directories it made
        check_writable(out, "--out", make=True)
        try:
            m, wrote = _locked(cfg, out, overwrite, log)
        except BaseException:
            if not had_lock and {p.name for p in out.iterdir()} <= {".lock"}:  # nothing left behind
                (out / ".lock").unlink(missing_ok=True)
            raise
    warn = tiny_val(m, cfg.resolved_val_every()) if wrote and cfg.source != FOLD else None
    if warn:
        log(warn)
    return m, wrote


def _locked(cfg: PrepConfig, out: Path, overwrite: bool, log) -> tuple[dict, bool]:
    import fcntl

    with open(out / ".lock", "a+") as lock:  # the holder writes its pid and host into the lock file
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            who = lock.read().strip() or "unknown pid"
            raise PrepError(f"{out}: another prep-data is writing there ({who} holds {out / '.lock'})") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            if cfg.source == FOLD:
                return _generate_fold(cfg, out, overwrite, log)
            return _Run(cfg, overwrite, log).run(cfg.progress)
        finally:
            lock.truncate(0)  # released: an empty lock file (a killed holder's pid stays until the next run)
