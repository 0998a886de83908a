"""torch.compile applied from outside the model (`train.compile`): each layer of the shared block is compiled
once with dynamic shapes, so the compacted length |A_i| of a loop (which changes every loop and every step)
does not recompile. PyTorch still specialises sizes 0 and 1, so a layer holds a bounded handful of graphs
(loop 1 uncompacted or a compacted loop; a one-row modulation table, i.e. a shortcut pass of S = 1; a loop
with a single active token per row) and compiles nothing new once it has met them. The model's code stays
plain eager PyTorch; this module is the only place that knows."""

from __future__ import annotations


def apply_compile(model, backend: str | object = "inductor") -> None:
    """Compiles every layer of `model` in place (`nn.Module.compile`, dynamic shapes). A layer is called with
    (x (B, Tm, d), mod, mask, attend): Tm varies, the modulation is a broadcast row or table rows by index."""
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=True)


def compile_count() -> int:
    """Graphs compiled so far in this process (dynamo's counter): stays flat once a run is warm."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
