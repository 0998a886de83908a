"""Every memory reading of tlf: the trainer's per-step metrics (`memory_metrics`) and the peak of a region of
code: CUDA max allocated on GPU; on CPU the process's peak resident set (VmHWM), which Linux lets a process
reset (`/proc/self/clear_refs` <- 5), so a region's own peak is measured even after a larger start-up
(imports, loading weights).

    base = region_start(dev)
    ...                                  # the work to measure
    peak_mib = region_peak_mib(dev, base)  # peak growth over the memory in use at region_start
"""

from __future__ import annotations

import resource

import torch


def _status_mib(*fields: str) -> list[float]:
    """The given /proc/self/status memory fields (MiB) from one read; a field it lacks (or no /proc) is the
    process's peak resident set so far (getrusage)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in fields:
                    found[name] = int(rest.split()[0])
    except OSError:
        pass
    return [found.get(f, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024.0 for f in fields]


def rss_mib() -> float:
    """The process's resident set now (MiB; its peak so far where /proc is missing)."""
    return _status_mib("VmRSS")[0]


def peak_rss_mib() -> float:
    """The process's peak resident set (MiB) since it started or since the last region_start."""
    return _status_mib("VmHWM")[0]


def memory_metrics(device: str) -> dict:
    """The trainer's memory metrics: CUDA max allocated/reserved (GB) on GPU; resident and peak resident set
    (GB) on CPU."""
    if device == "cuda":
        return {
            "mem/cuda_max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
            "mem/cuda_max_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
        }
    peak, rss = _status_mib("VmHWM", "VmRSS")
    return {"mem/peak_rss_gb": peak / 1024.0, "mem/rss_gb": rss / 1024.0}


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
    return rss_mib()


def region_peak_mib(device: torch.device | str, base: float) -> float:
    """Peak memory since region_start (MiB) above its base."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) / 2**20 - base
    return peak_rss_mib() - base


class SavedTensors:
    """Counts the bytes autograd keeps for backward inside a `with` block: every tensor saved for the backward
    pass, once per storage (views of one storage count once), attributed to the `label` current when it was
    first saved. Set `label` from hooks (e.g. a forward pre-hook per loop) to get a breakdown.

        acc = SavedTensors()
        with acc:
            loss = objective(x, y).loss  # the training objective around the network
        acc.total, acc.by_label  # bytes, {label: bytes}
    """

    def __init__(self) -> None:
        self.label = None
        self.by_label: dict = {}
        self._seen: set = set()
        self._ctx = None

    @property
    def total(self) -> int:
        return sum(self.by_label.values())

    def _pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        key = (s._cdata, t.device)  # the storage itself: also for meta tensors (no data pointer)
        if key not in self._seen and s.nbytes() > 0:
            self._seen.add(key)
            self.by_label[self.label] = self.by_label.get(self.label, 0) + s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def tensor_peak_mib(fn) -> float:
    """Runs fn() and returns the peak growth of live tensor bytes (MiB) while it ran, from the profiler's
    allocation events: the CPU counterpart of CUDA's max_memory_allocated, exact and repeatable (the process's
    resident set also counts freed memory the C allocator keeps, which varies run to run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20
