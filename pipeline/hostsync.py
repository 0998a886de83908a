"""Counting host reads of tensors: the checkable stand-in for device -> host synchronisations on a CPU machine.

On a GPU, `.item()`, `.cpu()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)` of a device tensor wait for the
device's queue to drain. On a CPU machine nothing waits, so tests count the calls instead: inside
`count_host_reads()`, every such call made from a file under the given source roots (tlf's packages by
default) is recorded with its file, line and function. The hot paths keep host-side sizes in numpy (a
tensor's `.numpy()` is never a sync: it refuses device tensors), so the count is exactly the number of reads
that would synchronise on a GPU.

    with count_host_reads() as reads:
        model(x, y)
    len(reads)  # -> 1: the one read of all |A_i| of the pass
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROOTS = tuple(str(_ROOT / p) for p in ("pipeline", "data_prep", "evaluation"))
_METHODS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def count_host_reads(roots: tuple[str, ...] = DEFAULT_ROOTS):
    """Yields a list that collects (file, line, function, method) of each host read made from under roots."""
    reads: list[tuple[str, int, str, str]] = []
    saved = {m: getattr(torch.Tensor, m) for m in _METHODS}

    def wrap(name, orig):
        def counted(self, *a, **kw):
            f = sys._getframe(1)
            while f.f_code.co_filename == __file__:  # nested counters: look past the other's wrapper
                f = f.f_back
            if f.f_code.co_filename.startswith(roots):
                reads.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name, name))
            return orig(self, *a, **kw)
        return counted

    for m, orig in saved.items():
        setattr(torch.Tensor, m, wrap(m, orig))
    try:
        yield reads
    finally:
        for m, orig in saved.items():
            setattr(torch.Tensor, m, orig)
