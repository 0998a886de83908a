"""Checkpoints and exports written by older tlf still resume and load:

- tests/fixtures/pre_objective (tests/fixtures/make_pre_objective.py at commit 8ea8a61): DeepSpeed files whose state
  dicts hold the network's bare names, under ZeRO-0 and ZeRO-2, and stored configs with the objective under `model`;
- tests/fixtures/pre_recipes (tests/fixtures/make_pre_recipes.py at commit 23b34fc): stored configs with the router's
  recipe under `model` and flat `objective.router_*` keys, under the budget recipe (ZeRO-0, ZeRO-2) and under the
  recipe that became `kinds` (its training state holds the kinds' table)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fixtures.make_pre_objective import MODEL, RUN
from fixtures.make_pre_recipes import CASES
from fixtures.make_pre_recipes import RUN as RECIPES_RUN
from pipeline.config import load_config
from test_train import make_shards, one_thread  # noqa: F401 (one_thread: autouse fixture)

FIX = Path(__file__).resolve().parent / "fixtures" / "pre_objective"
OBJECTIVE = ["objective.lambda_short=0.2"]  # the fixture's objective setting, as this config names it
RECIPES_FIX = FIX.parent / "pre_recipes"
# each pre_recipes case as today's presets and keys name it: (preset, overrides)
TODAY = {
    "budget": (
        "tiny/t-loopformer-budget",
        [
            *[o for o in CASES["budget"][1] if not o.startswith(("model.router_", "objective.router_"))],
            "objective.router.target_depth=2.5",
            "objective.router.entropy_weight=0.05",
        ],
    ),
    "kinds": ("fold/kinds", CASES["kinds"][1][:6]),  # the small network; the rest is the preset's
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10, seq_len=16, vocab=64)


def _cfg(tmp: Path, data: Path, *extra: str):
    model = [o for o in MODEL if "router_recipe" not in o] + ["objective.router.target_depth=0"]  # (the middle)
    more = [f"data.dir={data}", f"checkpoint.dir={tmp}", *extra]
    return load_config("tiny/t-loopformer-budget", model + OBJECTIVE + RUN + more)


@pytest.mark.parametrize("stage", [0, 2])
def test_an_old_checkpoint_resumes_bit_exact(tmp_path, data, stage, capfd):
    from pipeline.train.trainer import GLOBAL_RNG, OLD_SCHEDULE, run

    old = json.loads((FIX / f"zero{stage}" / "losses.json").read_text())
    ck = shutil.copytree(FIX / f"zero{stage}" / "global_step2", tmp_path / "old" / "global_step2")
    res = run(_cfg(tmp_path / "run", data, f"train.zero_stage={stage}", f"checkpoint.resume={ck}"))
    # step 3 is computed from the old weights alone: bit for bit the old code's loss. Step 4 also runs the update
    # from the old optimiser state, whose last bit depends on the CPU's kernels: the fixture's losses were made on
    # another machine, and on an AVX-512 AMD EPYC the ZeRO-2 update gave step 4 one float32 ulp away (5.1224895 for
    # 5.1224899), with DeepSpeed 0.17.6, 0.18.9, 0.19.7 and 0.19.8, and with the code of 798b3d2, which passed this
    # test on the CI machine. The tolerance allows a last-bit difference, not a different update.
    assert res.start_step == 2 and res.losses[0] == old[2]
    assert res.losses[1] == pytest.approx(old[3], rel=1e-6, abs=0)
    # its shortcut schedules are drawn as the old code drew them (per micro-batch from torch's RNG: the losses
    # above), said once, and the checkpoints the run writes keep that rule for the next resume
    assert (capfd.readouterr().out).count(OLD_SCHEDULE) == 1
    state = torch.load(tmp_path / "run" / "global_step4" / "rank0_state.pt", weights_only=True)
    assert state["schedule"] == GLOBAL_RNG


def test_an_old_checkpoint_resumes_on_another_zero_stage(tmp_path, data):
    """ZeRO-2 -> ZeRO-0: the resharding path reads the old DeepSpeed files by parameter name."""
    from pipeline.train.trainer import run

    old = json.loads((FIX / "zero2" / "losses.json").read_text())
    ck = shutil.copytree(FIX / "zero2" / "global_step2", tmp_path / "old" / "global_step2")
    res = run(_cfg(tmp_path / "run", data, "train.zero_stage=0", f"checkpoint.resume={ck}"))
    assert res.start_step == 2 and res.losses == pytest.approx(old[2:], rel=1e-6, abs=0)


def test_an_old_export_loads_and_exports_under_the_same_names(tmp_path):
    from safetensors.torch import load_file

    from pipeline.export import export
    from pipeline.model.io import load_model

    src = FIX / "zero0" / "global_step2"
    model, cfg = load_model(src)
    assert cfg.model.d_model == 16 and cfg.objective.lambda_short == 0.2  # the config upgraded as it is read
    old = load_file(str(src / "model" / "model.safetensors"))
    new = load_file(str(export(str(src), str(tmp_path / "st")) / "model.safetensors"))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in old)
    assert set(model.state_dict()) - set(old) == {"lm_head.weight"}  # tied: stored once, as wte.weight


@pytest.mark.parametrize("case", ["budget_zero0", "budget_zero2", "kinds_zero0"])
def test_a_checkpoint_from_before_the_recipes_resumes_bit_exact(tmp_path, data, case):
    """Today's preset of each recipe resumes the old run: its stored config reads as today's (a resume refuses a
    different network), the kinds' table comes back, and step 3, computed from the old weights and table alone, is
    the old code's loss bit for bit (step 4 to the last bit of the optimiser update: see above)."""
    from pipeline.train.trainer import Trainer

    name, stage = case.rsplit("_zero", 1)
    old = json.loads((RECIPES_FIX / case / "losses.json").read_text())
    ck = shutil.copytree(RECIPES_FIX / case / "global_step2", tmp_path / "old" / "global_step2")
    preset, over = TODAY[name]
    more = [
        f"train.zero_stage={stage}",
        f"data.dir={data}",
        f"checkpoint.dir={tmp_path / 'run'}",
        f"checkpoint.resume={ck}",
    ]
    trainer = Trainer.build(load_config(preset, over + RECIPES_RUN + more))
    saved = torch.load(ck / "rank0_state.pt", weights_only=True)["objective"]
    assert trainer.engine.module.state().keys() == saved.keys() == ({"kind_rate"} if name == "kinds" else set())
    assert all(torch.equal(trainer.engine.module.state()[k], v) for k, v in saved.items())
    res = trainer.fit()
    assert res.start_step == 2 and res.losses[0] == old[2]
    assert res.losses[1] == pytest.approx(old[3], rel=1e-6, abs=0)


@pytest.mark.parametrize("case", ["budget_zero0", "kinds_zero0"])
def test_an_export_from_before_the_recipes_loads_as_todays_config(case):
    from pipeline.model.io import load_model

    model, cfg = load_model(RECIPES_FIX / case / "global_step2")
    r = cfg.objective.router
    assert cfg.model.router_norm and cfg.model.router_forecast == (r.recipe == "kinds")
    if r.recipe == "budget":
        assert (r.target_depth, r.entropy_weight, cfg.objective.lambda_short) == (2.5, 0.05, 0.2)
    else:
        assert (r.recipe, r.target_depth, r.hard_weight, r.hard_gate, r.withhold) == ("kinds", 1.1, 1.0, 0.9, 0.8)
    assert model.router.norm and model.router.fc1.out_features == model.cfg.d_model // 4
