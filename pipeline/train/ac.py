"""Activation checkpointing applied from outside the model (`train.activation_checkpointing`), the way
`pipeline/train/compile.py` applies torch.compile: the model's code is plain single-device PyTorch and never
asks whether it is checkpointed.

    loop   the shared block (all J layers, `model.layers`) is one checkpointed unit: backward keeps only each
           loop's input and recomputes the loop (docs/training.md "Activation checkpointing and compile")
    layer  each layer is a checkpointed unit
    none   nothing changes

`apply_ac` replaces the forward of those modules on the instance with a non-reentrant
`torch.utils.checkpoint` of the original forward, used only while autograd records (validation and evaluation
under no_grad run the plain forward). Parameter names and state dicts are unchanged, so checkpoints move
freely between runs with and without it.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "loop", "layer")


def _checkpointed(forward):
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    run.tlf_checkpointed = True
    return run


def apply_ac(model, mode: str) -> None:
    """Checkpoints `model` in place: mode "loop" (the shared block `model.layers` per loop), "layer" (each
    layer) or "none". Applying twice is an error (a unit would be recomputed twice)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return
    units = [model.layers] if mode == "loop" else list(model.layers)
    units_all = [model.layers, *model.layers]
    if any(getattr(u.forward, "tlf_checkpointed", False) for u in units_all):
        raise ValueError("activation checkpointing is already applied to this model")
    for u in units:
        u.forward = _checkpointed(u.forward)


def checkpointed_mode(model) -> str:
    """The mode `apply_ac` applied to `model` ("none" if it was not)."""
    if getattr(model.layers.forward, "tlf_checkpointed", False):
        return "loop"
    if any(getattr(layer.forward, "tlf_checkpointed", False) for layer in model.layers):
        return "layer"
    return "none"
