"""The one device resolver: `auto` picks CUDA when torch sees it, else the CPU (training, generation,
evaluation, the harness plug-in and the ablations all take their device through it)."""

from __future__ import annotations

import re

import torch

from pipeline.config import ConfigError

# The one --device help text (tlf eval, ablate, generate: the same default and choices everywhere).
DEVICE_HELP = "auto (cuda when torch sees one, else cpu), cpu, cuda or cuda:N."


def resolve_device(device: str | None, key: str = "device", indexed: bool = False) -> str:
    """'auto' (or None/'') -> 'cuda' if available else 'cpu'; 'cpu' and 'cuda' pass ('cuda:N' too when indexed).
    Anything else, or CUDA asked for where torch sees none, is a ConfigError naming `key`."""
    if not device or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    ok = device in ("cpu", "cuda") or (indexed and re.fullmatch(r"cuda:\d+", device) is not None)
    if not ok:
        raise ConfigError(f"{key} must be auto, cpu or cuda{' (or cuda:N)' if indexed else ''}, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={device} but torch sees no CUDA device")
    return device
