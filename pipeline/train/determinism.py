"""train.deterministic: the switch that makes two runs of the same command, and a run killed and resumed,
produce bit-identical losses on the same machine.

On: torch.use_deterministic_algorithms(True) (ops without a deterministic kernel raise instead of silently
drifting; scatter/index_add and embedding backward take their deterministic paths), cuDNN deterministic with
benchmarking off, CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA (set before the first cuBLAS call), and on CPU one
intra-op thread per rank: with more than one, CPU reductions split their work by thread and the summation order
(hence the last bits of the loss) can differ from run to run. Off: nothing is changed and resume is as exact as any
rerun (docs/training.md "Determinism contract"), except that a run with it off in a process where an earlier run turned it on (a sweep, a
notebook, the tests) gets back the settings that were there before: a run's behaviour is its config's alone.

On CPU the contract turns off torch's filling of uninitialised memory (`torch.utils.deterministic.
fill_uninitialized_memory`, on by default under deterministic algorithms): it writes NaN into every `torch.empty`,
DeepSpeed's ZeRO buckets included, which made a 6-step tiny ZeRO-2 run 13x slower (67 s against 5 s). Nothing in the
train step reads memory it has not written; the bit-exact rerun, kill and resume tests are the check. On CUDA the
fill (a device memset) stays on.
"""

from __future__ import annotations

import os

import torch

CPU_THREADS = 1  # the intra-op thread count the contract fixes on CPU
CUBLAS_WORKSPACE = ":4096:8"


_before: dict | None = None  # the settings an earlier apply(True) in this process changed, as they were


def _settings() -> dict:
    return {
        "threads": torch.get_num_threads(),
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "fill": torch.utils.deterministic.fill_uninitialized_memory,
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def _restore(s: dict) -> None:
    torch.set_num_threads(s["threads"])
    torch.use_deterministic_algorithms(s["algorithms"])
    torch.utils.deterministic.fill_uninitialized_memory = s["fill"]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = s["cudnn"]
    if s["cublas"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = s["cublas"]


def apply(on: bool, device_kind: str) -> dict:
    """Applies the contract when `on`; returns what it set (name -> value), {} when off (having put back what an
    earlier apply(True) in this process changed)."""
    global _before
    if not on:
        if _before is not None:
            _restore(_before)
            _before = None
        return {}
    if _before is None:
        _before = _settings()
    set_ = {}
    if device_kind == "cuda":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        set_["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    else:
        torch.set_num_threads(CPU_THREADS)
        set_["cpu_threads"] = CPU_THREADS
        torch.utils.deterministic.fill_uninitialized_memory = False
        set_["fill_uninitialized_memory"] = False
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    set_["deterministic_algorithms"] = True
    return set_
