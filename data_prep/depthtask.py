"""`tlf prep-data --source depth-hops`: a synthetic task whose every scored target needs a known number of steps.

Pointer chasing over a random permutation f of n symbols (Saunshi et al. 2025 train looped models on its
cousin, p-hop induction). One document (one sequence) is
    EOT, a1 f(a1), a2 f(a2), ..., an f(an),  x1 M_k1 y1,  x2 M_k2 y2, ...
the n pairs in random order (the context), then Q queries: a start symbol x, a marker M_k naming the level
k, and the answer y = f^k(x). Levels 1..L are mixed in every document (each at least once, the rest drawn
uniformly, in random order). Answering level k takes k sequential look-ups, so d* = k.

The loss mask is carried by the tokens: the target at position t+1 is scored iff token t is a marker, and
its level is the marker's k (`levels_at`). The marker sits at the predicting position, so a router that
reads only h0 (token identity + position) sees the level. Context tokens (pairs, x, markers, y as input)
are not scored: a loader passes the ignore index for them (the fused head objective already skips it).

Token ids: symbols SYM_BASE..SYM_BASE+n-1, markers MARK_BASE+1..MARK_BASE+L (GPT-2 ids, any fit uint16).
Deterministic in `seed`: document i is drawn from numpy's default_rng((seed, i)), so any document can be
regenerated alone and the shards are byte-identical for the same options.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from data_prep.tokenizer import EOT

SYM_BASE = 1000  # symbol j is token SYM_BASE + j
MARK_BASE = 2000  # the level-k marker is token MARK_BASE + k
MAX_SYMBOLS = MARK_BASE - SYM_BASE
MAX_LEVELS = 64


def doc_length(n: int, queries: int) -> int:
    """Tokens in one document, its EOT included."""
    return 1 + 2 * n + 3 * queries


def make_document(seed: int, index: int, n: int, levels: int, queries: int) -> np.ndarray:
    """Document `index` of the stream for `seed`: (doc_length,) int64 tokens."""
    rng = np.random.default_rng((seed, index))
    perm = rng.permutation(n)  # f(a) = perm[a]
    order = rng.permutation(n)
    ks = np.concatenate([np.arange(1, levels + 1), rng.integers(1, levels + 1, queries - levels)])
    ks = rng.permutation(ks)
    xs = rng.integers(0, n, queries)
    out = np.empty(doc_length(n, queries), dtype=np.int64)
    out[0] = EOT
    out[1:1 + 2 * n:2] = SYM_BASE + order
    out[2:2 + 2 * n:2] = SYM_BASE + perm[order]
    q = out[1 + 2 * n:].reshape(queries, 3)  # (Q, 3): x, M_k, y
    for i, (x, k) in enumerate(zip(xs, ks)):
        y = x
        for _ in range(k):
            y = perm[y]
        q[i] = (SYM_BASE + x, MARK_BASE + k, SYM_BASE + y)
    return out


def levels_at(tokens: np.ndarray, max_level: int = MAX_LEVELS) -> np.ndarray:
    """Level of the target each position predicts: (T,) int, k where token t is marker M_k (its target,
    token t+1, is scored with d* = k), 0 elsewhere (not scored). Works on any window of the stream."""
    t = np.asarray(tokens).astype(np.int64)
    k = t - MARK_BASE
    return np.where((k >= 1) & (k <= max_level), k, 0)


def task_of(directory) -> dict | None:
    """The `depth_task` entry of DIRECTORY's manifest (None for any other source or no manifest)."""
    from data_prep.shards import read_manifest
    m = Path(directory) / "manifest.json"
    return read_manifest(m).get("depth_task") if m.is_file() else None


def fingerprint(cfg) -> dict:
    """The options that decide the bytes, resolved (manifest `source`; a rerun with the same is a no-op)."""
    from data_prep.config import OUTPUT_KEYS
    fp = {k: getattr(cfg, k) for k in OUTPUT_KEYS}
    fp.update(val_every=cfg.resolved_val_every(), name=cfg.resolved_name())
    return fp


def generate(cfg, out: Path, tokenizer: dict, log) -> dict:
    """Writes train/val shards + manifest.json for cfg (source=depth-hops); returns the manifest."""
    from data_prep.files import write_json
    from data_prep.writer import MANIFEST, SplitWriter, manifest
    name, val_every = cfg.resolved_name(), cfg.resolved_val_every()
    writers = {s: SplitWriter(out, name, s, cfg.shard_tokens) for s in ("train", "val")}
    n, L, Q = cfg.depth_symbols, cfg.depth_levels, cfg.depth_queries
    docs = cfg.depth_docs
    if cfg.max_tokens:
        docs = min(docs, cfg.max_tokens // doc_length(n, Q)) if docs else cfg.max_tokens // doc_length(n, Q)
    counts = {"train": 0, "val": 0}
    for i in range(docs):
        split = "val" if val_every > 0 and i % val_every == 0 else "train"
        writers[split].add(make_document(cfg.seed, i, n, L, Q).astype(np.uint16), lambda _: None)
        counts[split] += 1
    for w in writers.values():
        w.commit()
    rule = ("no val split" if val_every < 0 else
            f"document i (0-based, generated in order) goes to val when i % {val_every} == 0")
    task = {"task": "pointer chasing (f^k(x) over a random permutation per document)", "symbols": n,
            "levels": L, "queries_per_doc": Q, "doc_tokens": doc_length(n, Q), "seed": cfg.seed,
            "sym_base": SYM_BASE, "mark_base": MARK_BASE,
            "scored": "target t+1 is scored iff token t is a marker MARK_BASE+k; its level d* is k"}
    m = manifest(fingerprint=fingerprint(cfg), inputs=[task], writers=writers,
                 counters={"kept": docs, **counts}, complete=True, resume=None, tokenizer=tokenizer,
                 val_rule=rule, shard_tokens=cfg.shard_tokens)
    m["depth_task"] = task
    write_json(out / MANIFEST, m)
    log(f"depth-hops: {docs} documents of {doc_length(n, Q)} tokens, levels 1..{L}, seed {cfg.seed}; train with "
        f"model.block_size={doc_length(n, Q)} so that each window is one whole document")
    return m
