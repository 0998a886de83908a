"""The shortcut schedule is keyed to the optimizer step (`step_shortcut`, `Trainer.shortcut`): every micro-batch of
step s gets the schedule of (train.seed, s), whatever the grad-accum, world size or rank, and torch's global RNG is
not read. tests/test_reshard.py checks what it is for: a run resumed on another world size and ZeRO stage gives
the uninterrupted run's losses."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.schedule import step_shortcut
from test_train import make_shards, one_thread, tiny_cfg  # noqa: F401 (one_thread: autouse fixture)


def test_the_schedule_of_a_step_is_a_function_of_seed_and_step():
    L = 8
    before = torch.get_rng_state()
    steps = [step_shortcut(L, 1337, s) for s in range(1, 41)]
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is neither read nor moved
    for s, k in enumerate(steps, 1):
        assert k.dtype == torch.long and bool((k >= 1).all()) and int(k.sum()) == L and 1 <= k.numel() <= L - 1
        assert torch.equal(k, step_shortcut(L, 1337, s))  # the same draw every time it is asked for
    assert len({tuple(k.tolist()) for k in steps}) >= 20  # 40 steps, 127 compositions: steps differ
    assert len({k.numel() for k in steps}) == L - 1  # every S in 1..L-1 occurs
    other = [tuple(step_shortcut(L, 1338, s).tolist()) for s in range(1, 41)]
    assert sum(a != tuple(b.tolist()) for a, b in zip(other, steps)) >= 25  # another seed, other schedules


@pytest.mark.parametrize("split", ["2x1", "1x2"])
def test_every_micro_batch_of_a_step_gets_the_steps_schedule(tmp_path, monkeypatch, split):
    """Global batch 2 as micro-batch 2 x grad-accum 1 and as 1 x 2: each step's micro-batches get the same
    schedule, the one of (train.seed, step), which is not read from torch's RNG (reseeding it changes nothing);
    the rule is saved in the checkpoint."""
    from pipeline.train.objective import Objective
    from pipeline.train.trainer import STEP_KEYED, Trainer

    got = []
    orig = Objective.forward

    def forward(self, idx, targets, shortcut=None, **k):
        if not idx.is_meta:  # not the planner's trace (tlf plan) at the start
            got.append(shortcut)
            torch.manual_seed(len(got))  # whatever the global RNG holds, the schedule is the step's
        return orig(self, idx, targets, shortcut, **k)

    monkeypatch.setattr(Objective, "forward", forward)
    mb, accum = map(int, split.split("x"))
    data = make_shards(tmp_path / "data", windows=8)
    extra = [f"train.micro_batch_size={mb}", f"train.grad_accum_steps={accum}", "model.loops=6"]
    cfg = tiny_cfg(tmp_path / "ck", data, *extra, "schedule.max_steps=5", "train.eval_interval=0")
    res = Trainer.build(cfg, callbacks=None).fit()
    assert len(res.losses) == 5 and len(got) == 5 * accum
    want = [step_shortcut(6, cfg.train.seed, s) for s in range(1, 6)]
    assert all(torch.equal(k, want[i // accum]) for i, k in enumerate(got)), (got, want)
    assert len({tuple(k.tolist()) for k in want}) > 1
    saved = torch.load(tmp_path / "ck" / "global_step4" / "rank0_state.pt", weights_only=True)
    assert saved["schedule"] == STEP_KEYED
