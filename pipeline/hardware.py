"""The GPU table: one row per device, each figure with its source. Training reads the peak of this CUDA device's
row for MFU (`this_gpu`; logging.peak_flops=0), `tlf plan --gpu NAME` plans for any row.

peak_flops: dense (no sparsity) bf16 tensor-core FLOP/s; memory: capacity in bytes as the vendor states it
(GB = 1e9 bytes); bandwidth: memory bandwidth in bytes/s; bf16: whether `train.precision=auto` picks bf16 there.
The CPU row is this project's CI machine class, for planning the CPU runs the tests make (its FLOP/s is an
order of magnitude, not a datasheet; training reports no MFU on CPU unless `logging.peak_flops` is set:
docs/training.md "MFU").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory: float  # bytes
    bandwidth: float  # bytes/s
    bf16: bool
    source: str


GPUS = {
    g.name: g
    for g in [
        GPU(
            "a100-40gb",
            312e12,
            40e9,
            1.555e12,
            True,
            "NVIDIA A100 Tensor Core GPU Datasheet (A100 40GB SXM: BF16 312 TFLOPS dense, 40 GB HBM2, 1,555 GB/s)",
        ),
        GPU(
            "a100-80gb",
            312e12,
            80e9,
            2.039e12,
            True,
            "NVIDIA A100 Tensor Core GPU Datasheet (A100 80GB SXM: BF16 312 TFLOPS dense, 80 GB HBM2e, 2,039 GB/s)",
        ),
        GPU(
            "h100-80gb",
            989e12,
            80e9,
            3.35e12,
            True,
            "NVIDIA H100 Tensor Core GPU Datasheet (H100 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
            "80 GB HBM3, 3.35 TB/s)",
        ),
        GPU(
            "h200",
            989e12,
            141e9,
            4.8e12,
            True,
            "NVIDIA H200 Tensor Core GPU Datasheet (H200 SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, "
            "141 GB HBM3e, 4.8 TB/s)",
        ),
        GPU(
            "cpu",
            1e12,
            16e9,
            20e9,
            False,
            "not a datasheet: an order-of-magnitude CPU host (1 TFLOP/s fp32, 16 GB, 20 GB/s) for planning CPU runs",
        ),
    ]
}


def gpu(name: str) -> GPU:
    """The row NAME, or a one-line error listing the known names."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)} (pipeline/hardware.py)")
    return GPUS[name]


def detect(device_name: str, memory_bytes: float) -> GPU | None:
    """The row of a CUDA device by its name (torch.cuda.get_device_name) and memory (total_memory, bytes): the
    A100's two sizes apart by memory; None for a device the table does not hold."""
    n = device_name.upper()
    if "H200" in n:
        return GPUS["h200"]
    if "H100" in n:
        return GPUS["h100-80gb"]
    if "A100" in n:
        return GPUS["a100-80gb" if memory_bytes > 60e9 else "a100-40gb"]
    return None


def this_gpu() -> GPU | None:
    """`detect` for the current CUDA device (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return detect(
        torch.cuda.get_device_name(), torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    )
