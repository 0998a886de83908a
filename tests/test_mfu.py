"""MFU is reported only where a peak is known: logging.peak_flops, or an A100's on CUDA by default; a CPU run
without it logs no `mfu` (the console and `tlf compare` show none, rather than `MFU 0.00%` against an A100)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config import load_config
from pipeline.model.looped import LoopedLM
from pipeline.plan.hardware import gpu
from pipeline.train.callbacks import Speed
from pipeline.train.trainer import StepWork


def _mfu(device_kind: str, *overrides: str) -> dict:
    cfg = load_config("tiny/t-loopformer", list(overrides))
    sp = Speed()
    sp.trainer = SimpleNamespace(
        cfg=cfg,
        model=LoopedLM(cfg.model),
        tokens_per_step=1000,
        ws=1,
        device_kind=device_kind,
        work=StepWork(float(cfg.model.loops), 1),
    )
    sp.pre_train()
    metrics: dict = {}
    sp.post_step(1, metrics)
    return metrics


def test_no_mfu_on_cpu_unless_a_peak_is_given():
    assert "mfu" not in _mfu("cpu") and _mfu("cpu")["tokens_per_s"] > 0
    given, cuda = _mfu("cpu", "logging.peak_flops=1e9"), _mfu("cuda")  # the default peak on CUDA: an A100's
    per_token = [m["mfu"] / m["tokens_per_s"] for m in (given, cuda)]  # = flops per token / peak (no timing)
    assert per_token[0] > 0 and per_token[0] == pytest.approx(per_token[1] * gpu("a100-80gb").peak_flops / 1e9)
