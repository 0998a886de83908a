"""Files a user may receive from elsewhere are loaded without unpickling arbitrary objects."""

from __future__ import annotations

import pytest
import torch

from pipeline.train import checkpoint as ckpt


class _Trap:
    """Unpickling this creates a file: the sign that someone ran torch.load(weights_only=False) on it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_rank_state_loads_weights_only_and_a_trap_is_an_error_naming_the_file(tmp_path):
    d = tmp_path / "global_step2"
    d.mkdir()
    # the trainer's own state (RNG states as tensors and plain types) round-trips under weights_only=True
    state = {"step": 2, "world_size": 1, "rng": ckpt.rng_state(), "loader": {"micro": 4}, "mlflow_run_id": None}
    torch.save(state, d / "rank0_state.pt")
    back = ckpt.read_state(d, 0, 1)
    a = torch.rand(3)
    ckpt.set_rng_state(back["rng"])
    import random

    import numpy as np

    got = (torch.rand(3), random.random(), np.random.random())
    ckpt.set_rng_state(state["rng"])
    assert torch.equal(got[0], torch.rand(3)) and got[1] == random.random() and got[2] == np.random.random()
    assert torch.equal(a, got[0])  # restoring rewound the generator to where the state was taken
    # a booby-trapped file: refused, named, nothing executed
    marker = tmp_path / "unpickled"
    torch.save({"step": 2, "world_size": 1, "trap": _Trap(str(marker))}, d / "rank0_state.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"rank0_state\.pt: not a readable training state"):
        ckpt.read_state(d, 0, 1)
    assert not marker.exists()
