"""How much of a corpus goes to the validation split, and when that is too little to trust (docs/data.md).

The rule (prep-data's default for local files and Hub sources, `val_every=0`): documents are read in input order;
document i, of n tokens, goes to val when val holds fewer tokens than target(P + n), P being the tokens of the
documents before it, where target(P) is 10 % of P until val holds MIN_TOKENS, then 1 %, and never more than
MAX_TOKENS. The first document always goes to val, and val overshoots its target by at most one document. The
rule depends only on the input (integer arithmetic), so it is the same for any worker count and across resumes.

`short_note` is the one judgement of "too little": fewer than MIN_TOKENS tokens. prep-data
says it when it writes the split, training when its validation loss rests on such a split, `tlf eval` beside each
perplexity, `tlf compare` under its tables and `tlf export` on the model card.
"""

from __future__ import annotations

START_PERCENT = 10  # of the tokens so far, while val holds fewer than MIN_TOKENS
PERCENT = 1  # of the tokens so far, once it holds MIN_TOKENS
MIN_TOKENS = 10_000  # below this a validation figure is a rough one
MAX_TOKENS = 10_000_000  # enough for any validation loss; the rest trains

RULE = (
    f"by tokens: document i (0-based, kept documents in input order) of n tokens goes to val when val holds fewer "
    f"than target(P + n) tokens, P the tokens before it; target(P) = {START_PERCENT}% of P until val holds "
    f"{MIN_TOKENS:,}, then {PERCENT}%, at most {MAX_TOKENS:,}"
)


def target(produced: int) -> int:
    """The tokens val should hold once `produced` tokens (all splits) have been read."""
    start = min(MIN_TOKENS, produced * START_PERCENT // 100)
    return min(MAX_TOKENS, max(produced * PERCENT // 100, start))


def to_val(val_tokens: int, produced_before: int, n: int) -> bool:
    """Whether a document of n tokens, read after `produced_before` tokens of which `val_tokens` went to val, goes
    to val."""
    return val_tokens < target(produced_before + n)


def short_note(tokens: int, docs: int | None = None) -> str | None:
    """Why a validation figure resting on `tokens` tokens (of `docs` documents, when known) is a rough one, or None
    when there are enough."""
    if tokens >= MIN_TOKENS:
        return None
    what = f"{tokens:,} tokens" + (f" of {docs:,} document{'s' if docs != 1 else ''}" if docs is not None else "")
    return (
        f"rests on {what}, fewer than {MIN_TOKENS:,}: a rough figure "
        "(a larger corpus, or prep-data --val-every N sending every N-th document to val, gives more)"
    )
