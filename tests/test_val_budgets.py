"""Validation at several loop budgets: each train.eval_interval logs val/M{M}/loss for every budget of
train.eval_loops (default 1, 2, 4, ... below L, and L), and for a routed model val/M{M}/mean_depth and loop work;
val/loss stays the pass at M = L; each figure equals the model's own pass at that budget on the same batches, and
an extra validation split gets its own val/<dir>/M{M}/loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import pytest

from pipeline.config import ConfigError
from pipeline.train.validation import default_budgets, evaluate
from test_train import make_shards, tiny_cfg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


def test_default_budgets_span_1_to_L():
    assert [default_budgets(L) for L in (1, 2, 3, 4, 8, 12)] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 4, 8],
        [1, 2, 4, 8, 12],
    ]


def test_a_budget_past_model_loops_is_named(tmp_path, data):
    with pytest.raises(ConfigError, match=r"train\.eval_loops: budget 4 must be an integer in 1\.\.model\.loops \(3\)"):
        tiny_cfg(tmp_path, data, "train.eval_loops=[1,4]")


@pytest.mark.parametrize("preset", ["tiny/t-loopformer", "tiny/loopformer"])
def test_each_budget_is_the_models_own_pass_on_the_same_batches(tmp_path, data, preset):
    """evaluate() at budgets 1..3 of the trainer's validation loaders equals LoopedLM's pass at each budget on the
    loader's batches (mean of the batches' mean cross-entropy; a routed pass's mean depth, and depth / L)."""
    from pipeline.train.trainer import Trainer

    cfg = tiny_cfg(tmp_path / "ck", data, "train.eval_interval=100", "train.eval_batches=2", preset=preset)
    t = Trainer.build(cfg, callbacks=[])
    got = evaluate(t.engine, t.val, 2, t.device, [1, 2, 3], 3)
    routed = t.model.router is not None
    for M in (1, 2, 3):
        losses, depths = [], []
        with torch.no_grad():
            for x, y in t.val[0][1].batches(2):
                out = t.model(x, loops=M)
                losses.append(F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-1).item())
                depths.append(out.depth.float().mean().item())
        assert got[f"val/M{M}/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
        if routed:
            assert got[f"val/M{M}/mean_depth"] == pytest.approx(sum(depths) / len(depths), rel=1e-6)
            assert got[f"val/M{M}/loop_work"] == pytest.approx(got[f"val/M{M}/mean_depth"] / 3)
        else:
            assert f"val/M{M}/mean_depth" not in got
    assert got["val/loss"] == got["val/M3/loss"]


def test_training_logs_every_budget_and_each_extra_split(tmp_path, data):
    """Through the trainer's loop: metrics.jsonl holds val/M{M}/loss at each evaluation (default budgets of L = 3)
    for the main split and an extra one, with depth and loop work for the routed model."""
    from pipeline.tracking import read_metrics
    from pipeline.train.trainer import run

    extra = make_shards(tmp_path / "other", windows=4, seed=1)
    cfg = tiny_cfg(
        tmp_path / "ck",
        data,
        "schedule.max_steps=4",
        "train.eval_interval=2",
        f"data.extra_val_dirs=[{extra}]",
    )
    run(cfg)
    rows = [r for r in read_metrics(tmp_path / "ck" / "metrics.jsonl") if "val/loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        for M in (1, 2, 3):
            assert {f"val/M{M}/loss", f"val/M{M}/mean_depth", f"val/M{M}/loop_work", f"val/other/M{M}/loss"} <= set(r)
        assert r["val/loss"] == r["val/M3/loss"] and r["val/M1/mean_depth"] == 1.0


def test_compare_draws_the_elastic_curve_over_training(tmp_path, data):
    """`tlf compare --run-dir` of a t-loopformer and a loopformer run: each logged validation step is one line of
    (loop work, loss) over the budgets 1..3, the routed run's work its logged mean depth / L, the other's M / L;
    the plot is written."""
    from click.testing import CliRunner

    from evaluation.compare import elastic_points, local_runs, select
    from pipeline.cli import main
    from pipeline.tracking import read_metrics
    from pipeline.train.trainer import run

    dirs = []
    for preset in ("tiny/t-loopformer", "tiny/loopformer"):
        d = tmp_path / preset.split("/")[1]
        run(tiny_cfg(d, data, "schedule.max_steps=4", "train.eval_interval=2", preset=preset))
        dirs.append(d)
    pts = elastic_points(select(local_runs([str(d) for d in dirs]), None), None)
    assert set(pts) == {"t-loopformer", "loopformer"} and all(list(p) == [2, 4] for p in pts.values())
    assert [w for w, _ in pts["loopformer"][4]] == [1 / 3, 2 / 3, 1.0]
    last = read_metrics(dirs[0] / "metrics.jsonl")[-1]
    assert pts["t-loopformer"][4] == [(last[f"val/M{m}/loop_work"], last[f"val/M{m}/loss"]) for m in (1, 2, 3)]
    r = CliRunner().invoke(main, ["compare", *(f"--run-dir={d}" for d in dirs), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "cmp" / "elastic_over_training.png").is_file()
