"""`tlf prep-data --source depth-hops`: a synthetic task whose every scored target needs a known number of loops.

Root finding by pointer chasing (a cousin of the p-hop induction Saunshi et al. 2025 train looped models on).
Each document draws R random chains of L + 1 symbols
    v_L -> v_(L-1) -> ... -> v_1 -> v_0 (the root, which points to itself)
over n = R (L + 1) symbols and is one sequence of tokens
    BOS, S(f(0)), S(f(1)), ..., S(f(n-1)),  then Q queries "ASK S(x) S(root(x))"
- the context is the parent array: the token at position 1 + a is the symbol of a's parent f(a). One step along
  a chain is one attention look-up (attend to the entry of the current symbol, read the parent written there),
  so a model with one layer per loop needs d* = k loops for a query whose start is k steps from its root;
  levels are k = 1..L;
- symbols are numbered by distance, farthest first (distance-L nodes get labels 0..R-1 in random order,
  distance L-1 the next R, ..., the roots the last R), so under causal attention no entry sees its parent's
  entry: no token can shortcut a chain by pointer doubling. Which node of the next distance is a node's parent
  is drawn afresh per document, so the chains exist only in the context;
- a query is ASK then the start symbol S(x); the answer is the root's symbol. S(x) is the predicting position
  and its label group names the level, so a router that reads only h0 (token identity + position) sees d*.
  The start is the same token, hence the same embedding, that the array uses for x and that the tied head
  maps to x's output: a hop's result lands in the space the next hop queries with;
- Q <= R queries, each on a different chain (a later query cannot reuse an earlier answer), levels 1..L mixed in
  every document (each level once per block of L queries, in random order);
- a root is its own parent, so a model that runs more loops than a query needs still answers it (no counting);
  one that runs fewer can only guess among the roots not yet answered (at best 1 / (R - Q + 1)).

Scored targets: the target of position t is scored iff token t - 1 is ASK (`levels_at`); every other target
gets the ignore index -1 from the loader, which the fused head objective skips exactly. What each token needs,
for a router's budget (`need_at`, the manifest's `mean_need`): a level-k query k loops; the array entry of a
node at distance j >= 1, L - j + 1 loops (a level-L query reads it in loop L - j + 1, and only tokens still
looping are visible to a loop's attention); everything else (BOS, the roots' entries, ASK, answers) 1.

`order="near"` (make_document and layout; bench/depth_probe.py grid 5 only, not a prep-data option) numbers the
labels nearest the root first instead, so every entry comes after its parent's: a model may then follow chains by
pointer doubling (each loop, every entry replaces its pointer by its pointer's pointer) and a level-k query needs
1 + ceil(log2 k) loops of one layer rather than k. `need_at` and `mean_need` describe the default order only.

Token ids are small, so a task model can use a small vocabulary: BOS 1, ASK 2, S(s) = SYM_BASE + s;
`layout(R, L)["vocab_needed"]` is one past the largest. Deterministic in `seed`: document i is drawn from
numpy's default_rng((seed, i)), so any document can be regenerated alone and the shards are byte-identical for
the same options.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

BOS = 1
ASK = 2
SYM_BASE = 16  # symbol s (an answer) is token SYM_BASE + s
MAX_LEVELS = 16
MAX_CHAINS = 64


ORDERS = ("far", "near")  # labels numbered farthest from the root first (no doubling) or nearest first


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"depth-hops label order must be one of {ORDERS}, got {order!r}")


def layout(R: int, L: int, order: str = "far") -> dict:
    """The task's token ranges for R chains and L levels (stored in the manifest as `depth_task`)."""
    _check_order(order)
    n = R * (L + 1)
    return {
        "chains": R,
        "levels": L,
        "order": order,
        "symbols": n,
        "bos": BOS,
        "ask": ASK,
        "sym_base": SYM_BASE,
        "vocab_needed": SYM_BASE + n,
    }


def doc_length(R: int, L: int, queries: int) -> int:
    """Tokens in one document, its BOS included."""
    return 1 + R * (L + 1) + 3 * queries


def make_document(seed: int, index: int, R: int, L: int, queries: int, order: str = "far") -> np.ndarray:
    """Document `index` of the stream for `seed`: (doc_length,) int64 tokens. order "far": distance j holds
    labels (L - j) R .. (L - j + 1) R - 1 (the module docstring); "near": labels j R .. (j + 1) R - 1, so every
    entry comes after its parent's and a model may follow chains by pointer doubling."""
    _check_order(order)
    rng, n = np.random.default_rng((seed, index)), R * (L + 1)
    group = (lambda j: L - j) if order == "far" else (lambda j: j)
    # chain[c, j]: the symbol at distance j from chain c's root
    chain = np.stack([group(j) * R + rng.permutation(R) for j in range(L + 1)], axis=1)  # (R, L + 1)
    parent = np.empty(n, dtype=np.int64)
    parent[chain[:, 1:]] = chain[:, :-1]
    parent[chain[:, 0]] = chain[:, 0]
    out = np.empty(doc_length(R, L, queries), dtype=np.int64)
    out[0] = BOS
    out[1 : 1 + n] = SYM_BASE + parent  # the parent array, farthest-from-the-root labels first
    ks = np.concatenate([rng.permutation(L) + 1 for _ in range(-(-queries // L))])[:queries]
    cs = rng.permutation(R)[:queries]  # one chain per query
    q = out[1 + n :].reshape(queries, 3)  # (Q, 3): ASK, S(x), S(root)
    q[:, 0] = ASK
    q[:, 1] = SYM_BASE + chain[cs, ks]  # level k: k steps from the root
    q[:, 2] = SYM_BASE + chain[cs, 0]
    return out


def levels_at(tokens: np.ndarray, task: dict) -> np.ndarray:
    """Level of the target each position predicts: (..., T) int, k where token t - 1 is ASK and token t the
    start S(x) of a level-k query (its target, token t+1, is scored with d* = k), 0 elsewhere (not scored).
    Works on any window of the stream (the first position of a window is never scored). A manifest's task of
    another kind (`depth_task["kind"]`: "fold", data_prep/foldtask.py) is scored by its own rule."""
    if task.get("kind", "hops") == "fold":
        from data_prep.foldtask import levels_at as fold_levels_at

        return fold_levels_at(tokens, task)
    t, R, L = np.asarray(tokens).astype(np.int64), int(task["chains"]), int(task["levels"])
    sym = t - int(task["sym_base"])
    asked = np.zeros(t.shape, dtype=bool)
    asked[..., 1:] = t[..., :-1] == int(task["ask"])
    dist = L - sym // R if task.get("order", "far") == "far" else sym // R  # labels g R.. hold distance L - g or g
    return np.where(asked & (sym >= 0) & (sym < R * (L + 1)), dist, 0)


def check_window(task: dict | None, T: int, directory) -> None:
    """Raises ShardError (one line) when windows of T tokens cannot be scored for `task`, DIRECTORY's depth_task:
    the fold task's slots layout counts each slot's tokens, so a window must be whole slots."""
    if task and task.get("kind") == "fold" and task.get("layout") == "slots" and T % int(task["doc_tokens"]):
        from data_prep.shards import ShardError

        w = int(task["doc_tokens"])
        raise ShardError(
            f"{directory}: model.block_size={T}: the fold task's slots layout needs a multiple of its slot ({w} tokens)"
        )


def need_at(tokens: np.ndarray, task: dict) -> np.ndarray:
    """Loops each position needs (..., T) int >= 1, as the module docstring says. Takes whole documents
    (..., doc_length): an entry's distance is read from its position (labels are numbered by distance)."""
    if task.get("order", "far") != "far":
        raise ValueError("need_at describes the default label order ('far') only")
    t = np.asarray(tokens).astype(np.int64)
    R, L = int(task["chains"]), int(task["levels"])
    need = np.maximum(levels_at(t, task), 1)
    dist = np.repeat(np.arange(L, -1, -1), R)  # distance of symbol a = the entry at document offset 1 + a
    need[..., 1 : 1 + R * (L + 1)] = np.where(dist >= 1, L - dist + 1, 1)
    return need


def mean_need(R: int, L: int, queries: int) -> float:
    """Mean loops a token needs over a document (the budget target that matches the task)."""
    levels = (queries // L) * L * (L + 1) / 2 + (queries % L) * (L + 1) / 2  # expected sum of the query levels
    entries = R * sum(L - j + 1 for j in range(1, L + 1)) + R  # the roots' entries at 1
    ones = 1 + 2 * queries  # BOS, ASK and answers
    return float((entries + ones + levels) / doc_length(R, L, queries))


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


def generate(cfg, out: Path, tokenizer: dict, log, pool=None) -> dict:
    """Writes train/val shards + manifest.json for cfg (source=depth-hops or depth-fold); returns the manifest.
    Documents are made in chunks by `pool`'s processes (None: in this one), in order: the bytes do not depend on
    the pool (document i is a function of the seed and i alone)."""
    if cfg.source == "depth-fold":
        from data_prep import foldtask

        L = cfg.depth_levels
        g = foldtask.rule(cfg.fold_symbols, cfg.fold_rule_seed, cfg.fold_rule)
        kind = cfg.fold_layout
        task = {
            **foldtask.layout(cfg.fold_symbols, L, cfg.fold_rule_seed, cfg.fold_rule, cfg.fold_typed, kind),
            "seed": cfg.seed,
        }
        task["scored"] = "the target after the last cell x_k of a level-k segment " + (
            "(slot position k + 1)" if kind == "slots" else "(k + 1 after its opener W_k = k)"
        )
        doc = functools.partial(foldtask.make_document, seed=cfg.seed, g=g, L=L, typed=cfg.fold_typed, kind=kind)
        cells = ", typed cells" if cfg.fold_typed else ""
        what = f"{cfg.fold_symbols} symbols ({cfg.fold_rule} rule{cells}), levels 1..{L}, {kind} layout"
    else:
        R, L, Q = cfg.depth_chains, cfg.depth_levels, cfg.depth_queries
        task = {
            "task": "root finding by pointer chasing (R chains of L+1 symbols, fresh chains per document)",
            **layout(R, L),
            "queries_per_doc": Q,
            "doc_tokens": doc_length(R, L, Q),
            "seed": cfg.seed,
            "mean_need": round(mean_need(R, L, Q), 4),
            "scored": "target t+1 is scored iff token t-1 is ASK; its level d* is the distance of token t's symbol "
            "from its root",
        }
        doc = functools.partial(make_document, seed=cfg.seed, R=R, L=L, queries=Q)
        what = f"{R} chains, levels 1..{L}"
    return _write(cfg, out, tokenizer, log, task, doc, what, pool)


CHUNK_DOCS = 4096  # documents a pool task makes


def _chunk(args) -> np.ndarray:
    """(stop - start, T) uint16: documents start..stop-1 of doc (a picklable partial taking index=)."""
    doc, start, stop = args
    return np.stack([doc(index=i) for i in range(start, stop)]).astype(np.uint16)


def _write(cfg, out: Path, tokenizer: dict, log, task: dict, doc, what: str, pool=None) -> dict:
    """The shards and manifest of a synthetic depth task: document i is doc(index=i), every split's stream one
    document after another; the manifest holds `task` as `depth_task`."""
    from data_prep.files import write_json
    from data_prep.writer import MANIFEST, SplitWriter, manifest

    name, val_every = cfg.resolved_name(), cfg.resolved_val_every()
    writers = {s: SplitWriter(out, name, s, cfg.shard_tokens) for s in ("train", "val")}
    T = int(task["doc_tokens"])
    window = (
        f"a multiple of {T} (whole slots)" if task.get("layout") == "slots" else f"{T} (one window is one document)"
    )
    docs = cfg.depth_docs
    if cfg.max_tokens:
        docs = min(docs, cfg.max_tokens // T)
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
    rule = (
        "no val split"
        if val_every < 0
        else f"document i (0-based, generated in order) goes to val when i % {val_every} == 0"
    )
    m = manifest(
        fingerprint=fingerprint(cfg),
        inputs=[task],
        writers=writers,
        counters={"kept": docs, **counts},
        complete=True,
        resume=None,
        tokenizer=tokenizer,
        val_rule=rule,
        shard_tokens=cfg.shard_tokens,
    )
    m["depth_task"] = task
    write_json(out / MANIFEST, m)
    log(
        f"{cfg.source}: {docs} documents of {T} tokens, {what}, seed {cfg.seed}; train with "
        f"model.block_size={window} and model.vocab_size >= {task['vocab_needed']}; "
        f"mean need {task['mean_need']:.3f} loops per token"
    )
    return m
