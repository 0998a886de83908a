"""`tlf prep-data --source depth-fold`: the fold task, whose every scored answer needs a known number of loops
(docs/data.md "The fold task").

A fixed binary operation g on m symbols (a Latin square drawn from `rule_seed`: every row and every column a
permutation, so one operand alone says nothing of the result) is folded from the left over a segment of cells:

    y_0 = x_0,  y_j = g(y_(j-1), x_j),  answer y_k for a segment of k + 1 cells x_0 .. x_k

Layout "ordered" (the default): a document is one segment per level k = 1..L, in this order (so the level is a
function of the position), the level-k segment opened by W_k = k:

    W_k x_0 .. x_k A    (x_j = SYM + symbol, A = SYM + y_k)

so the scored positions can be found from the tokens of any window (`levels_at`: the position k + 1 after a W_k),
as the loader and `tlf eval` need. With model.block_size = doc_length(L) a window is one document and the level
is also a function of the position, which is all a router reading h0 sees at x_k (a symbol).

Layout "slots" (prep-data fold_layout=slots): a document is one slot of L + 3 tokens, one segment of a level k
drawn uniformly from 1..L, then PAD. In the ordered layout the step g is learnt where the level-1 query sits and
has to be found again, from the level-2 answer alone, at the level-2 segment's cells, which sit at other positions
after other tokens (measured: no network that composed failed to carry the step there). In slots every segment
starts alike, so cell x_j of a level-k segment is where a level-j query is, with the same tokens (in law) before
it; its opener is W for every level (a level-k opener would let the network compute the step differently at the
higher levels' cells), so the loader finds the level by counting the slot's tokens before its padding, in windows
of whole slots.

Only A is scored (its target is predicted at x_k). One step of the fold is one attention read of the left
neighbour plus a table look-up, so with one layer per loop cell j's prefix y_j is ready after j loops and a
level-k answer needs d* = k loops; g is not associative, so the fold cannot be re-bracketed (no doubling), and a
model that reads the k + 1 cells at once must hold the m^(k+1)-entry table of the k-fold composition instead of
g's m^2. Every prefix is a fixed point of the step (y_j = g(y_(j-1), x_j) again), so running more loops than d*
does no harm to a model that learnt the step.

`need`: the per-token depth an oracle router would give: cell x_j of a level-k segment is read by x_(j+1) in
loop j + 1, so it must still be looping then (depth j + 1 for j < k), the query x_k needs k, W and A one loop.
`need(L, visible=True)`: the same when a token that has exited stays readable by later loops through its frozen
state (model.exited_keys=frozen): cell x_j then holds y_j after j loops whether or not it runs more, so x_0 and
x_1 need one loop, x_j (j >= 1) j loops, the query x_k k. The manifest's `mean_need` and `mean_need_frozen` are
their means, the budget targets that match the task.

Deterministic: the source's document i is drawn from numpy's default_rng((seed, i)) and g from `rule_seed`, so
the shards are byte-identical for the same options, whatever the number of worker processes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from data_prep.files import write_json
from data_prep.shards import ShardError, read_manifest
from data_prep.writer import MANIFEST, SplitWriter, manifest

W = 1  # the slots layout's opener of every segment; the ordered layout's level-k segment opens with W_k = k
SYM = 16  # symbol s is token SYM + s
MAX_LEVELS = SYM - 1  # the openers W_k = k stay below the symbols
MAX_SYMBOLS = 256


# What a prep config or a data directory of the removed depth-hops source (the other synthetic task) is told
HOPS_REMOVED = (
    "the depth-hops task was removed (at no size were its loops both needed and learnable); "
    "use the fold task, source=depth-fold (docs/data.md 'The fold task')"
)
RULES = ("cyclic", "random")
LAYOUTS = ("ordered", "slots")
PAD = 0  # fills a slot after its answer (layout "slots"); never scored, never an opener


def rule(m: int, rule_seed: int = 0, kind: str = "cyclic") -> np.ndarray:
    """g as an (m, m) table, g[y, x], a Latin square.

    "cyclic": q[(p[y] + r[x]) % m] with random permutations p, r, q: an isotope of the cyclic group Z_m. Its
    k-fold is q(h(...h(h(p x_0 + r x_1) + r x_2)...) + r x_k) with one permutation h = p q: structured, so a model
    may hold the k-fold in far fewer parameters than its m^(k+1) entries.
    "random": rows drawn one by one, each a perfect matching of the columns to the symbols their column has not
    used yet (a random augmenting-path matching; one always exists, as what is left is a regular bipartite
    graph). Not uniform over Latin squares, but with no group behind it: the k-fold is a table without a
    shorter description a model could find."""
    if kind not in RULES:
        raise ValueError(f"fold rule must be one of {RULES}, got {kind!r}")
    rng = np.random.default_rng((rule_seed, 99))
    if kind == "cyclic":
        p, r, q = rng.permutation(m), rng.permutation(m), rng.permutation(m)
        return q[(p[:, None] + r[None, :]) % m]
    g = np.empty((m, m), dtype=np.int64)
    free = np.ones((m, m), dtype=bool)  # free[x, s]: symbol s not yet used in column x
    for y in range(m):
        owner = -np.ones(m, dtype=np.int64)  # owner[s]: the column holding symbol s in this row
        for x in rng.permutation(m):
            _augment(int(x), free, owner, np.zeros(m, dtype=bool), rng)
        g[y, owner] = np.arange(m)
        free[owner, np.arange(m)] = False
    return g


def _augment(x: int, free: np.ndarray, owner: np.ndarray, seen: np.ndarray, rng) -> bool:
    """Kuhn's augmenting path from column x over its free symbols in random order."""
    for s in rng.permutation(np.flatnonzero(free[x] & ~seen)):
        seen[s] = True
        if owner[s] < 0 or _augment(int(owner[s]), free, owner, seen, rng):
            owner[s] = x
            return True
    return False


def doc_length(L: int) -> int:
    """Tokens in one document: segments of k + 3 tokens for k = 1..L."""
    return sum(k + 3 for k in range(1, L + 1))


def documents(g: np.ndarray, rng: np.random.Generator, n: int, L: int, typed: bool = False) -> np.ndarray:
    """n documents of the ordered layout (n, doc_length(L)) int64, cells drawn from rng, segment k opened by
    W_k = k; typed: the cells x_1..x_k are input tokens SYM + m + x, the first cell x_0 and the answer stay state
    tokens SYM + y (the same draws either way)."""
    return np.concatenate([segments(g, rng, n, k, k, typed) for k in range(1, L + 1)], 1)


def segments(g: np.ndarray, rng: np.random.Generator, n: int, k: int, opener: int, typed: bool) -> np.ndarray:
    """n level-k segments (n, k + 3): opener x_0 .. x_k A, the k + 1 cells drawn from rng."""
    m = len(g)
    x = rng.integers(0, m, (n, k + 1))
    y = x[:, 0]
    for j in range(1, k + 1):
        y = g[y, x[:, j]]
    cells = SYM + x + np.r_[0, np.full(k, m if typed else 0)]
    return np.concatenate([np.full((n, 1), opener), cells, (SYM + y)[:, None]], 1)


def levels(L: int) -> np.ndarray:
    """(doc_length(L),) level of the target each position of an ordered document predicts: k at the last cell of
    the level-k segment (its target A is scored), 0 elsewhere."""
    out = []
    for k in range(1, L + 1):
        out += [0] * (k + 1) + [k, 0]
    return np.array(out)


def need(L: int, visible: bool = False) -> np.ndarray:
    """(doc_length(L),) the loops each token of an ordered document needs (module docstring): the oracle router's
    depth; visible: when exited tokens stay readable through their frozen state."""
    out = []
    for k in range(1, L + 1):
        cells = [1] + list(range(1, k)) if visible else [j + 1 for j in range(k)]  # x_0 .. x_(k-1)
        out += [1] + cells + [k, 1]
    return np.array(out)


# ----------------------------------------------------------------------------------------- layout "slots"
# One segment per document, its level k drawn uniformly from 1..L, in a slot of L + 3 tokens (W x_0 .. x_k A,
# then PAD): every slot starts the same way whatever its level, the opener W included, so the context cell x_j of
# a level-k segment sits at the slot position of a level-j query with the same tokens (in law) before it, and the
# step g learnt for the level-1 answers is the one the level-k segment's cells need. Windows of a multiple of
# L + 3 tokens hold whole slots of independently drawn levels.
def slot_length(L: int) -> int:
    return L + 3


def slot_need(L: int, visible: bool = False) -> float:
    """Mean loops per token of the slots layout over its uniform level (module docstring `need`): a level-k slot
    needs k for its query, j + 1 for its cell x_j (j < k; visible: x_j needs j, x_0 and x_1 one), one elsewhere."""
    # a level-k slot: the ordered layout's level-k segment (its last k + 3 needs), then L - k PAD at one loop each
    total = sum(int(need(k, visible)[-(k + 3) :].sum()) + L - k for k in range(1, L + 1))
    return total / L / slot_length(L)


def slot_levels(tokens: np.ndarray, L: int) -> np.ndarray:
    """(..., T) the level of the slot each token lies in, for windows of whole slots (T a multiple of L + 3,
    starting at a slot): a level-k slot holds k + 3 tokens before its padding."""
    t = np.asarray(tokens).astype(np.int64)
    w = slot_length(L)
    if t.shape[-1] % w:
        raise ValueError(f"slots layout: windows must be whole slots of {w} tokens, got {t.shape[-1]}")
    k = (t.reshape(*t.shape[:-1], -1, w) != PAD).sum(-1) - 3  # (..., slots)
    return np.repeat(k, w, axis=-1)


def slot_documents(g: np.ndarray, rng: np.random.Generator, n: int, L: int, typed: bool = False) -> np.ndarray:
    """n slots (n, slot_length(L)) int64, each W x_0 .. x_k A PAD..: the n levels drawn from rng first, then
    the segments of each level in turn."""
    ks = rng.integers(1, L + 1, n)
    out = np.full((n, slot_length(L)), PAD, dtype=np.int64)
    for k in range(1, L + 1):
        rows = np.flatnonzero(ks == k)
        out[rows, : k + 3] = segments(g, rng, len(rows), k, W, typed)
    return out


# ------------------------------------------------------------------------------------ the prep-data source
def layout(
    m: int, L: int, rule_seed: int = 0, rule_kind: str = "cyclic", typed: bool = False, kind: str = "ordered"
) -> dict:
    """The task's description (stored in the manifest as `depth_task`, with `kind` "fold"); kind: the document
    layout, "ordered" (one segment per level, 1..L) or "slots" (one segment of a drawn level per slot)."""
    if kind not in LAYOUTS:
        raise ValueError(f"fold layout must be one of {LAYOUTS}, got {kind!r}")
    slots = kind == "slots"
    return {
        "kind": "fold",
        "task": "left fold of a Latin-square operation g over a segment of k + 1 cells, "
        + ("one segment of a uniformly drawn level per slot of L + 3 tokens" if slots else "one segment per level"),
        "layout": kind,
        "levels": L,
        "symbols": m,
        "rule": rule_kind,
        "cells": "typed" if typed else "shared",
        "rule_seed": rule_seed,
        "sym_base": SYM,
        "vocab_needed": SYM + (2 * m if typed else m),
        "doc_tokens": slot_length(L) if slots else doc_length(L),
        "mean_need": round(slot_need(L) if slots else float(need(L).mean()), 4),
        "mean_need_frozen": round(slot_need(L, True) if slots else float(need(L, visible=True).mean()), 4),
    }


def make_document(
    seed: int, index: int, g: np.ndarray, L: int, typed: bool = False, kind: str = "ordered"
) -> np.ndarray:
    """Document `index` of the source's stream for `seed`: (doc_length(L),) int64, openers W_k = k; kind "slots":
    one slot (slot_length(L),), opener W."""
    rng = np.random.default_rng((seed, index))
    if kind == "slots":
        return slot_documents(g, rng, 1, L, typed)[0]
    return documents(g, rng, 1, L, typed=typed)[0]


def levels_at(tokens: np.ndarray, task: dict) -> np.ndarray:
    """Level of the target each position predicts: (..., T) int, k at the last cell x_k of a level-k segment
    (the position k + 1 after its opener W_k; its target A is scored with d* = k), 0 elsewhere. Works on any
    window of the source's stream: a segment whose opener lies before the window is not scored. Layout "slots":
    windows of whole slots (`slot_levels`), the query of a level-k slot at slot position k + 1."""
    if task.get("layout") == "slots":
        L = int(task["levels"])
        k = slot_levels(tokens, L)
        return np.where(np.arange(k.shape[-1]) % slot_length(L) == k + 1, k, 0)
    t = np.asarray(tokens).astype(np.int64)
    out = np.zeros(t.shape, dtype=np.int64)
    T = t.shape[-1]
    for k in range(1, int(task["levels"]) + 1):
        opener = t[..., : max(T - k - 1, 0)] == k  # (..., T - k - 1): W_k at p, so x_k at p + k + 1 < T
        out[..., k + 1 :][opener] = k
    return out


def task_of(directory) -> dict | None:
    """The `depth_task` entry of DIRECTORY's manifest (None for any other source or no manifest). A directory made
    by the removed depth-hops source is a ShardError (one line): its tasks are scored by another rule."""
    m = Path(directory) / MANIFEST
    task = read_manifest(m).get("depth_task") if m.is_file() else None
    if task is not None and task.get("kind") != "fold":
        raise ShardError(f"{m}: made by prep-data's depth-hops source: {HOPS_REMOVED}")
    return task


def check_window(task: dict | None, T: int, directory) -> None:
    """Raises ShardError (one line) when windows of T tokens cannot be scored for `task`, DIRECTORY's depth_task:
    the slots layout counts each slot's tokens, so a window must be whole slots."""
    if task and task.get("layout") == "slots" and T % int(task["doc_tokens"]):
        w = int(task["doc_tokens"])
        raise ShardError(
            f"{directory}: model.block_size={T}: the fold task's slots layout needs a multiple of its slot ({w} tokens)"
        )


CHUNK_DOCS = 4096  # documents a pool task makes


def generate(cfg, out: Path, tokenizer: dict, log, pool=None) -> dict:
    """Writes train/val shards + manifest.json for cfg (a PrepConfig of source=depth-fold); returns the manifest.
    Documents are made in chunks by `pool`'s processes (None: in this one), in order: the bytes do not depend on
    the pool (document i is a function of the seed and i alone). Document i goes to val when
    i % val_every == 0; the manifest holds the task's `layout` as `depth_task`."""
    L, kind = cfg.depth_levels, cfg.fold_layout
    g = rule(cfg.fold_symbols, cfg.fold_rule_seed, cfg.fold_rule)
    task = {**layout(cfg.fold_symbols, L, cfg.fold_rule_seed, cfg.fold_rule, cfg.fold_typed, kind), "seed": cfg.seed}
    task["scored"] = "the target after the last cell x_k of a level-k segment " + (
        "(slot position k + 1)" if kind == "slots" else "(k + 1 after its opener W_k = k)"
    )
    doc = functools.partial(make_document, seed=cfg.seed, g=g, L=L, typed=cfg.fold_typed, kind=kind)
    T, val_every = int(task["doc_tokens"]), cfg.resolved_val_every()
    docs = min(cfg.depth_docs, cfg.max_tokens // T) if cfg.max_tokens else cfg.depth_docs
    writers = {s: SplitWriter(out, cfg.resolved_name(), s, cfg.shard_tokens) for s in ("train", "val")}
    counts = {"train": 0, "val": 0}
    tasks = [(doc, a, min(a + CHUNK_DOCS, docs)) for a in range(0, docs, CHUNK_DOCS)]
    chunks = map(_chunk, tasks) if pool is None else pool.imap(_chunk, tasks)  # in order
    for (_, a, _), rows in zip(tasks, chunks):
        for i, row in enumerate(rows, a):
            split = "val" if val_every > 0 and i % val_every == 0 else "train"
            writers[split].add(row, lambda _: None)
            counts[split] += 1
    for w in writers.values():
        w.commit()
    rule_text = (
        "no val split"
        if val_every < 0
        else f"document i (0-based, generated in order) goes to val when i % {val_every} == 0"
    )
    m = manifest(
        fingerprint=cfg.fingerprint(),
        inputs=[task],
        writers=writers,
        counters={"kept": docs, **counts},
        complete=True,
        resume=None,
        tokenizer=tokenizer,
        val_rule=rule_text,
        shard_tokens=cfg.shard_tokens,
    )
    m["depth_task"] = task
    write_json(out / MANIFEST, m)
    window = f"a multiple of {T} (whole slots)" if kind == "slots" else f"{T} (one window is one document)"
    cells = ", typed cells" if cfg.fold_typed else ""
    log(
        f"{cfg.source}: {docs} documents of {T} tokens, {cfg.fold_symbols} symbols ({cfg.fold_rule} rule{cells}), "
        f"levels 1..{L}, {kind} layout, seed {cfg.seed}; train with model.block_size={window} and "
        f"model.vocab_size >= {task['vocab_needed']}; mean need {task['mean_need']:.3f} loops per token"
    )
    return m


def _chunk(args) -> np.ndarray:
    """(stop - start, T) uint16: documents start..stop-1 of doc (a picklable partial taking index=)."""
    doc, start, stop = args
    return np.stack([doc(index=i) for i in range(start, stop)]).astype(np.uint16)
