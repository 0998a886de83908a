"""Activation checkpointing applied from outside (pipeline/train/ac.py) through the trainer: the same losses as
without it, checkpoints and exports with the usual parameter names, and a resumed run may change the mode."""

from __future__ import annotations

import numpy as np

from tests.test_train import make_shards, one_thread, tiny_cfg  # noqa: F401 (one_thread: autouse fixture)


def test_trainer_applies_ac_from_outside(tmp_path):
    from pipeline.model import LoopedLM
    from pipeline.model.io import load_model
    from pipeline.train.trainer import run

    data = make_shards(tmp_path / "shards", windows=10)
    few = ["schedule.max_steps=3", "checkpoint.interval=3", "train.eval_interval=0"]
    ref = run(tiny_cfg(tmp_path / "none", data, *few))
    for mode in ("loop", "layer"):
        got = run(tiny_cfg(tmp_path / mode, data, *few, f"train.activation_checkpointing={mode}"))
        np.testing.assert_allclose(got.losses, ref.losses, rtol=0, atol=1e-6, err_msg=mode)
        model, cfg = load_model(tmp_path / mode)  # the export loads into a plain model: names unchanged
        assert model.state_dict().keys() == LoopedLM(cfg.model).state_dict().keys()
    # a checkpoint written without checkpointing resumes with it (the state dict does not know)
    more = run(
        tiny_cfg(
            tmp_path / "none",
            data,
            "schedule.max_steps=4",
            "checkpoint.interval=3",
            "train.eval_interval=0",
            "train.activation_checkpointing=loop",
        )
    )
    assert more.start_step == 3 and more.step == 4 and np.isfinite(more.losses).all()
