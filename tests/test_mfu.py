"""MFU is reported only where a peak is known: logging.peak_flops, or on CUDA the GPU table's row for the device
(an A100's if it is not there); a CPU run without it logs no `mfu` (the console and `tlf compare` show none,
rather than `MFU 0.00%` against an A100)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.config import load_config
from pipeline.model.looped import LoopedLM
from pipeline.hardware import detect, gpu
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


def test_the_default_peak_is_this_gpus(monkeypatch):
    """On an H200 the default MFU is against the H200's 989e12, not an A100's 312e12 (which read 3.2x too high:
    66.9 % for a step at 21 %, bench/README `## plan_check`); a device not in the table falls back to an A100's."""
    import pipeline.train.callbacks as cb

    a100 = _mfu("cuda", "logging.peak_flops=312e12")
    monkeypatch.setattr(cb, "this_gpu", lambda: gpu("h200"))
    h200 = _mfu("cuda")
    assert h200["mfu"] / h200["tokens_per_s"] == pytest.approx(a100["mfu"] / a100["tokens_per_s"] * 312e12 / 989e12)
    monkeypatch.setattr(cb, "this_gpu", lambda: None)
    other = _mfu("cuda")
    assert other["mfu"] / other["tokens_per_s"] == pytest.approx(a100["mfu"] / a100["tokens_per_s"])


@pytest.mark.parametrize(
    "name,mem,row",
    [
        ("NVIDIA H200", 143e9, "h200"),
        ("NVIDIA H100 80GB HBM3", 85e9, "h100-80gb"),
        ("NVIDIA A100-SXM4-80GB", 85e9, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", 42e9, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", 42e9, "a100-40gb"),
        ("Tesla V100-SXM2-16GB", 17e9, None),
    ],
)
def test_a_cuda_device_finds_its_row(name, mem, row):
    assert detect(name, mem) == (gpu(row) if row else None)
