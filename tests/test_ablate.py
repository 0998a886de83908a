"""`tlf ablate`: the Figure 3/4 ablations on a tiny checkpoint; numbers and figures written."""

import json

import numpy as np
import torch
from click.testing import CliRunner
from helpers import spread_router

from data_prep.shards import write_shard
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.model import LoopedLM
from pipeline.model.io import save_model


def test_ablate_tiny_checkpoint(tmp_path):
    torch.manual_seed(0)
    cfg = load_config("tiny/t-loopformer", ["model.block_size=32", f"data.dir={tmp_path / 'val'}"])
    model = LoopedLM(cfg.model)
    spread_router(model)  # a router that spreads tokens over depths, as a trained one does
    save_model(tmp_path / "ckpt", model, cfg)
    (tmp_path / "val").mkdir()
    write_shard(tmp_path / "val" / "v_val_000000.bin", np.random.default_rng(0).integers(0, 50256, 600))
    r = CliRunner().invoke(
        main,
        [
            "ablate",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "out"),
            "--ppl-tokens",
            "256",
            "--thresholds",
            "0.2,0.5,0.8",
            "--prompt-lens",
            "8,16,64",
            "--repeats",
            "1",
            "--tpot-steps",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "out" / "ablate.json").read_text())
    rc = res["router_cache"]
    assert set(rc) == {"router_on/cache_on", "router_on/cache_off", "router_off/cache_on", "router_off/cache_off"}
    assert rc["router_off/cache_on"]["mean_depth"] == 4.0 and rc["router_on/cache_on"]["mean_depth"] < 4.0
    assert rc["router_on/cache_on"]["ppl"] == rc["router_on/cache_off"]["ppl"]  # the cache changes speed only
    depths = [s["mean_depth"] for s in res["threshold_sweep"]]
    assert depths == sorted(depths, reverse=True) and depths[0] > depths[-1]  # higher theta, fewer loops
    assert set(res["execution"]) == {"compact", "dense"}
    assert all(v["train_step_peak_mb"] > 0 for v in res["execution"].values())
    assert list(res["ttft_ms"]["router_on"]) == ["8", "16"]  # 64 > context 32: left out
    for f in ("fig3_router_cache.png", "fig4_gather_scatter.png", "fig3_threshold.png", "fig4_ttft.png"):
        assert (tmp_path / "out" / f).stat().st_size > 0
