"""Peak memory of a region of code: CUDA max allocated on GPU; on CPU the process's peak resident set
(VmHWM), which Linux lets a process reset (`/proc/self/clear_refs` <- 5), so a region's own peak is
measured even after a larger start-up (imports, loading weights).

    base = region_start(dev)
    ...                                  # the work to measure
    peak_mib = region_peak_mib(dev, base)  # peak growth over the memory in use at region_start
"""
from __future__ import annotations

import resource

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def region_start(device: torch.device | str = "cpu") -> float:
    """Resets the peak counter; returns the memory in use now (MiB) as the region's base."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    rss = _status_kib("VmRSS")
    return (rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024.0


def region_peak_mib(device: torch.device | str, base: float) -> float:
    """Peak memory since region_start (MiB) above its base."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) / 2**20 - base
    hwm = _status_kib("VmHWM")
    peak = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024.0
    return peak - base
