"""Inference: recursion-wise KV cache, gather-scatter prefill, early-exit decode and sampling (docs/design.md §2)."""

from pipeline.inference.cache import RecursionKVCache
from pipeline.inference.decode import Decoder
from pipeline.inference.generate import SAMPLING, Generation, generate, sample

__all__ = ["RecursionKVCache", "Decoder", "Generation", "SAMPLING", "generate", "sample"]
