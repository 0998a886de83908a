"""train.deterministic: the switch that makes two runs of the same command, and a run killed and resumed,
produce bit-identical losses on the same machine.

On: torch.use_deterministic_algorithms(True) (ops without a deterministic kernel raise instead of silently
drifting; scatter/index_add and embedding backward take their deterministic paths), cuDNN deterministic with
benchmarking off, CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA (set before the first cuBLAS call), and on CPU one
intra-op thread per rank: with more than one, CPU reductions split their work by thread and the summation order
(hence the last bits of the loss) can differ from run to run. Off: nothing is changed and resume is as exact as any
rerun (see the README).
"""

from __future__ import annotations

import os

import torch

CPU_THREADS = 1  # the intra-op thread count the contract fixes on CPU
CUBLAS_WORKSPACE = ":4096:8"


def apply(on: bool, device_kind: str) -> dict:
    """Applies the contract when `on`; returns what it set (name -> value), {} when off."""
    if not on:
        return {}
    set_ = {}
    if device_kind == "cuda":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        set_["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    else:
        torch.set_num_threads(CPU_THREADS)
        set_["cpu_threads"] = CPU_THREADS
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    set_["deterministic_algorithms"] = True
    return set_
