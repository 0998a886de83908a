"""The small helpers that exist once: config machinery, files, device, launcher argv, memory, Hub probe,
router spreading. Each is checked where it lives (that nobody re-implements them is kept by review and `duplicates`;
the layering test checks only the direction of imports)."""

import json
import os
import time

import numpy as np
import pytest
import torch
from helpers import spread_router as helpers_spread

from bench.testkit import spread_router
from data_prep import configlib
from data_prep.config import load_prep_config
from data_prep.files import read_json, write_json
from data_prep.hf import hub_problem
from pipeline import config as pconfig
from pipeline.config import load_config
from pipeline.device import resolve_device
from pipeline.memory import memory_metrics
from pipeline.model import LoopedLM
from pipeline.cli import strip_local_rank


def test_one_config_machinery_for_both_configs(tmp_path):
    assert pconfig.ConfigError is configlib.ConfigError and pconfig.apply_overrides is configlib.apply_overrides
    with pytest.raises(
        configlib.ConfigError,
        match=r"command line \(shard_tokns=5\): unknown config key "
        r"'shard_tokns' \(did you mean 'shard_tokens'\?\)",
    ):
        load_prep_config(values={"source": "demo", "out": str(tmp_path)}, overrides=["shard_tokns=5"])
    with pytest.raises(configlib.ConfigError, match=r"'train.seed' expects int, got 'x'"):
        load_config("tiny/t-loopformer", ["train.seed=x"])


def test_write_json_is_atomic_and_plain(tmp_path):
    p = write_json(
        tmp_path / "new" / "r.json", {"b": np.float32(0.5), "a": torch.tensor(3), "p": tmp_path}, sort_keys=True
    )
    text = p.read_text()
    assert json.loads(text) == {"a": 3, "b": 0.5, "p": str(tmp_path)} and text.index('"a"') < text.index('"b"')
    assert [q.name for q in p.parent.iterdir()] == ["r.json"]  # no temp file left behind
    assert read_json(p)["a"] == 3


def test_read_json_error_names_the_file(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    with pytest.raises(configlib.ConfigError, match=rf"^{bad}: invalid JSON \("):
        read_json(bad, error=configlib.ConfigError)


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(pconfig.ConfigError, match=r"^train.device=cuda but torch sees no CUDA device$"):
        resolve_device("cuda", "train.device")
    with pytest.raises(pconfig.ConfigError, match=r"^--device must be auto, cpu or cuda, got 'gpu'$"):
        resolve_device("gpu", "--device")
    with pytest.raises(pconfig.ConfigError, match=r"got 'cuda:1'"):
        resolve_device("cuda:1")  # an index only where the caller can use one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1", indexed=True) == "cuda:1"


def test_strip_local_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert strip_local_rank(["train", "--local_rank=3", "tiny/base", "x=1"]) == ["train", "tiny/base", "x=1"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.setenv("LOCAL_RANK", "1")  # the launcher's environment wins
    assert strip_local_rank(["--local-rank", "5", "train", "--local_rank=2"]) == ["train"]
    assert os.environ["LOCAL_RANK"] == "1"


def test_memory_metrics_on_cpu():
    m = memory_metrics("cpu")
    assert set(m) == {"mem/peak_rss_gb", "mem/rss_gb"} and 0 < m["mem/rss_gb"] <= m["mem/peak_rss_gb"] + 1e-9


def test_hub_probe_offline_and_unreachable(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert hub_problem(5.0) == "HF_DATASETS_OFFLINE is set (offline mode)"
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    t = time.monotonic()
    why = hub_problem(2.0)
    assert why and "Error" in why and time.monotonic() - t < 5


@pytest.mark.parametrize("recipe", ["paper", "budget"])
def test_spread_router_spreads_depths_reproducibly(recipe):
    cfg = load_config(f"tiny/t-loopformer{'-budget' if recipe == 'budget' else ''}").model
    torch.manual_seed(0)
    a, b = LoopedLM(cfg), LoopedLM(cfg)
    state = torch.get_rng_state()
    spread_router(a, seed=3), spread_router(b, seed=3)
    assert torch.equal(torch.get_rng_state(), state)  # its own generator: the global RNG is untouched
    assert all(torch.equal(p, q) for p, q in zip(a.router.parameters(), b.router.parameters()))
    idx = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    c = LoopedLM(cfg)
    with torch.no_grad():
        init = c.router(c.embed(idx)).depth(cfg.loops, cfg.router_threshold).float()
        depth = a.router(a.embed(idx)).depth(cfg.loops, cfg.router_threshold).float()
    assert sorted(depth.unique().tolist()) == list(range(1, cfg.loops + 1))  # every depth 1..L occurs
    if recipe == "paper":  # (the budget recipe's own init already spreads depths)
        assert depth.std() > 1.5 * init.std()  # more spread than the near-uniform initialisation
    assert helpers_spread(LoopedLM(cfg)).router.fc2.weight.std() > 2 * a.router.fc2.weight.std()  # tests: peakier


def test_spread_router_leaves_a_model_without_router_alone():
    torch.manual_seed(0)
    m = LoopedLM(load_config("tiny/loopformer").model)
    before = [p.clone() for p in m.parameters()]
    assert spread_router(m) is m and all(torch.equal(p, q) for p, q in zip(before, m.parameters()))
