"""Test and benchmark utilities (no product code imports this file): `count_host_reads`, counting host reads of
tensors, `spread_router`, a router that acts like a trained one, and `train_case`, one training run in a worker
process for the studies. Tests import `bench.testkit`, bench scripts
`testkit` (bench/ is their own directory).

Counting host reads: the checkable stand-in for device -> host synchronisations on a CPU machine.

On a GPU, `.item()`, `.cpu()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)` of a device tensor wait for the
device's queue to drain. On a CPU machine nothing waits, so tests count the calls instead: inside
`count_host_reads()`, every such call made from a file under the given source roots (tlf's packages by
default) is recorded with its file, line and function. The hot paths keep host-side sizes in numpy (a
tensor's `.numpy()` is never a sync: it refuses device tensors), so the count is exactly the number of reads
that would synchronise on a GPU.

    with count_host_reads() as reads:
        model(x)
    len(reads)  # -> 1: the one read of all |A_i| of the pass
"""

from __future__ import annotations

import contextlib
import math
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


def spread_router(model, seed: int = 0, scale: float = 1.0):
    """Gives `model.router` weights that act like a
    trained router's, peaky exit distributions with token depths spread over 1..L, where the initialisation
    sends nearly every token to the same depth. fc1 is scaled to its input (h0 at the model's init std, or unit
    RMS with model.router_norm) so its pre-activations have std ~5*scale; fc2 ~ N(0, scale); fc2's bias falls
    linearly from 1 to -1 over the depths. Draws from its own generator (seed), not the global RNG. A model
    without a router is returned unchanged; returns the model."""
    from pipeline.model.looped import INIT_STD

    r = model.router
    if r is None:
        return model
    in_std = 1.0 if r.norm else INIT_STD
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(r.fc1.weight.shape, generator=g) * (5.0 * scale / (math.sqrt(r.fc1.in_features) * in_std))
    w2 = torch.randn(r.fc2.weight.shape, generator=g) * scale
    with torch.no_grad():
        r.fc1.weight.copy_(w1)
        r.fc2.weight.copy_(w2)
        r.fc2.bias.copy_(torch.linspace(1.0, -1.0, r.fc2.out_features))
    return model


@contextlib.contextmanager
def count_forwards(model):
    """Yields {"forwards": n, "tokens": t}: the model runs (calls of its token embedding `wte`, once per
    forward or hidden_states) and the token slots they took (padding included) while the block runs."""
    seen = {"forwards": 0, "tokens": 0}

    def hook(_mod, args):
        seen["forwards"] += 1
        seen["tokens"] += args[0].numel()

    handle = model.wte.register_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


STUDY_CASE = "study_case.json"  # a finished study run's spec and result, in its checkpoint dir


def train_case(spec: dict) -> dict:
    """A study's worker (own process, one thread): trains `spec["preset"]` with `spec["overrides"]` through the
    project's trainer; returns its run id and tracking URI (None without MLflow), checkpoint dir, wall and CPU
    seconds and final training loss, and, once the run has reached its last step (not stopped by a signal), writes
    them with the spec to `STUDY_CASE` in the checkpoint dir. With
    `spec["reuse"]` a run whose checkpoint dir holds that file for the same preset and overrides is not trained
    again: its result comes back with `"reused": True`; otherwise an earlier run there is moved aside, not
    overwritten."""
    import json
    import os
    import time

    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from pipeline.config import load_config
    from pipeline.train.trainer import run

    cfg = load_config(spec["preset"], spec["overrides"])
    done = Path(cfg.checkpoint.dir) / STUDY_CASE
    key = {"preset": spec["preset"], "overrides": list(spec["overrides"])}
    if spec.get("reuse") and done.is_file():
        saved = json.loads(done.read_text())
        if saved.get("spec") == key:
            return {**saved["result"], "reused": True}
    t0, c0 = time.time(), time.process_time()
    res = run(cfg, overwrite=True)  # a case trained again moves its dir's earlier run aside (tlf train --overwrite)
    out = {
        "run_id": res.run_id,
        "dir": cfg.checkpoint.dir,
        "uri": cfg.logging.tracking_uri,
        "wall_s": time.time() - t0,
        "cpu_s": time.process_time() - c0,
        "final_train_loss": res.losses[-1],
    }
    if res.stopped_by is None and res.step == cfg.schedule.max_steps:  # finished, not stopped by a signal
        done.write_text(json.dumps({"spec": key, "result": out}, indent=1))
    return out
