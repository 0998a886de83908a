"""The C allocator under CPU training (glibc only).

Tensors on the CPU are plain `malloc` blocks. glibc serves large blocks with mmap and returns them to the
system when freed, but raises that mmap threshold each time such a block is freed, so a training loop ends up
serving its activations from the heap. When the sizes change every step, as t-loopformer's compacted loops do
(each loop's |A_i| moves with the router), the heap fragments and the process's resident set grows far above
the tensors alive: measured on the demo's small/t-loopformer (budget router, 60 steps), peak RSS 1.85–1.91 GB
with the default against 1.20 GB with a fixed 128 KiB threshold, at the same CPU time within noise
(user + sys 68.5 / 53.9 s default, 65.3 / 59.6 s fixed, interleaved runs). `tlf train` on CPU therefore fixes
the threshold at start (`MALLOC_MMAP_THRESHOLD_` in the environment, read by glibc at process start, wins).
GPU memory is PyTorch's caching allocator and is not affected.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
THRESHOLD = 128 * 1024


def fix_cpu_malloc_threshold(threshold: int = THRESHOLD) -> bool:
    """Fixes glibc's mmap threshold (which also stops its dynamic raising). Returns whether it was set here:
    False on a non-glibc C library or when the user set MALLOC_MMAP_THRESHOLD_ themselves."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to fix
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))
