"""Data mixtures (data.dirs, data.weights): the sources' shares of the sequences within sampling error of the
weights; each step's sequences the same whatever the world size and grad-accum; a resumed loader (on another
world size too) continues at the same sequence; through the trainer a resumed run's losses equal an uninterrupted
one's, val/loss is the sources' weighted mean and the tokens each source gave are logged; a bad mixture is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.shards import ShardError
from pipeline.config import ConfigError
from test_train import make_shards, tiny_cfg


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("mix")
    return [make_shards(root / "a", windows=40, seed=1), make_shards(root / "b", windows=7, seed=2)]


def cfg_of(tmp, dirs, *extra, weights=(0.75, 0.25)):
    return tiny_cfg(
        tmp,
        dirs[0],
        f"data.dirs=[{dirs[0]},{dirs[1]}]",
        f"data.weights=[{weights[0]},{weights[1]}]",
        *extra,
    )


def loader(cfg, rank=0, ws=1):
    from pipeline.train.mixture import MixtureLoader

    return MixtureLoader(cfg, rank, ws, None)


def rows(batches) -> list[bytes]:
    return [r.numpy().tobytes() for x, _ in batches for r in x]


def test_shares_are_the_weights_within_sampling_error(tmp_path, dirs):
    """800 steps of 16 sequences: each source's share within 4 binomial standard deviations of its weight, and
    the tokens logged per source are those sequences' tokens."""
    cfg = cfg_of(tmp_path, dirs, "train.micro_batch_size=16", "train.global_batch_size=16")
    ld = loader(cfg)
    for _ in range(800):
        ld.next()
    n = 800 * 16
    tokens = ld.tokens
    share = tokens["a"] / (n * 32)
    assert abs(share - 0.75) < 4 * np.sqrt(0.75 * 0.25 / n), share
    assert tokens["a"] + tokens["b"] == n * 32


@pytest.mark.parametrize("mb,accum,ws", [(1, 4, 1), (2, 1, 2), (1, 2, 2)])
def test_each_steps_sequences_do_not_depend_on_the_layout(tmp_path, dirs, mb, accum, ws):
    """Global batch 4: the sequences of each step, in order, are the same for 1 rank x 4, and for the layouts
    (micro-batch, grad-accum, ranks) given, ranks' slices interleaved per micro-batch."""
    ref_cfg = cfg_of(tmp_path, dirs, "train.micro_batch_size=4", "train.global_batch_size=4")
    ref = loader(ref_cfg)
    want = rows(ref.next() for _ in range(30))
    cfg = cfg_of(tmp_path, dirs, f"train.micro_batch_size={mb}", "train.global_batch_size=4")
    ranks = [loader(cfg, r, ws) for r in range(ws)]
    got = []
    for _ in range(30 * accum):
        got += rows(ld.next() for ld in ranks)
    assert got == want


def test_a_restored_loader_continues_at_the_same_sequence_on_any_world_size(tmp_path, dirs):
    cfg = cfg_of(tmp_path, dirs, "train.micro_batch_size=4", "train.global_batch_size=4")
    a = loader(cfg)
    for _ in range(13):
        a.next()
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint holds it
    want = rows(a.next() for _ in range(20))
    b = loader(cfg)
    b.load_state_dict(state)
    assert rows(b.next() for _ in range(20)) == want
    two = cfg_of(tmp_path, dirs, "train.micro_batch_size=2", "train.global_batch_size=4")
    ranks = [loader(two, r, 2) for r in range(2)]
    for ld in ranks:
        ld.load_state_dict(state)
    assert [r for _ in range(20) for r in rows(ld.next() for ld in ranks)] == want
    other = cfg_of(tmp_path, dirs, "train.micro_batch_size=4", "train.global_batch_size=4", weights=(0.5, 0.5))
    with pytest.raises(ShardError, match="weights was"):
        loader(other).load_state_dict(state)


def test_through_the_trainer(tmp_path, dirs):
    """A 6-step run, and a 3-step run resumed to 6: the same losses after step 3; val/loss is 0.75 val/a + 0.25
    val/b at each budget; data/tokens/<dir> counts each source's tokens."""
    from pipeline.tracking import read_metrics
    from pipeline.train.trainer import run

    common = ("schedule.decay=constant", "train.eval_interval=3", "train.deterministic=true")
    full = run(cfg_of(tmp_path / "full", dirs, *common, "schedule.max_steps=6"))
    run(cfg_of(tmp_path / "cut", dirs, *common, "schedule.max_steps=3"))
    resumed = run(cfg_of(tmp_path / "cut", dirs, *common, "schedule.max_steps=6"))
    assert resumed.start_step == 3 and resumed.losses == full.losses[3:]
    last = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl")][-1]
    assert last["val/loss"] == pytest.approx(0.75 * last["val/a"] + 0.25 * last["val/b"], rel=1e-12)
    assert last["val/M2/loss"] == pytest.approx(0.75 * last["val/a/M2/loss"] + 0.25 * last["val/b/M2/loss"])
    assert last["data/tokens/a"] + last["data/tokens/b"] == 6 * 2 * 32


@pytest.mark.parametrize(
    "extra,message",
    [
        (["data.weights=[1.0]"], "data.dirs has 2 directories and data.weights 1 weights"),
        (["data.weights=[0.5,0.6]"], "sum to 1.1, not 1"),
        (["data.curriculum=0.9", "train.eval_interval=5"], "data.curriculum is for one fold-task data.dir"),
    ],
)
def test_a_bad_mixture_is_named(tmp_path, dirs, extra, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        cfg_of(tmp_path, dirs, *extra)


def test_sources_of_another_tokenizer_are_named(tmp_path, dirs):
    from pipeline.train.data import build_loaders

    other = make_shards(tmp_path / "c", windows=8, seed=3)
    (other / "manifest.json").write_text(json.dumps({"tokenizer": {"name": "cl100k_base", "n_vocab": 100277}}))
    (dirs[0].parent / "a" / "manifest.json").write_text(json.dumps({"tokenizer": {"name": "gpt2", "n_vocab": 50257}}))
    try:
        with pytest.raises(ShardError, match="cl100k_base.*a mixture needs one tokenizer"):
            build_loaders(cfg_of(tmp_path, [dirs[0], other]), 0, 1)
    finally:
        (dirs[0].parent / "a" / "manifest.json").unlink()


def two_rank_part(tmp: str) -> dict:
    """On each rank of the shared 2-rank run (tests/two_ranks.py): a 4-step mixture run of global batch 2 (one
    sequence per rank), its losses and the tokens each source gave, for the test to hold against one rank."""
    import torch.distributed as dist

    from pipeline.tracking import read_metrics
    from pipeline.train.ds import init_distributed
    from pipeline.train.trainer import run

    rank, _, _ = init_distributed("cpu")  # (the launcher's process group, made by the parts before)
    root = Path(tmp) / "mix_data"
    if rank == 0:
        make_shards(root / "a", windows=40, seed=1), make_shards(root / "b", windows=7, seed=2)
    dist.barrier()
    over = ("schedule.max_steps=4", "train.eval_interval=0", "train.micro_batch_size=1", "train.global_batch_size=2")
    res = run(cfg_of(Path(tmp) / "mix_run", [root / "a", root / "b"], *over))
    last = read_metrics(Path(tmp) / "mix_run" / "metrics.jsonl")[-1] if rank == 0 else {}
    return {"losses": res.losses, "tokens": {k: v for k, v in last.items() if k.startswith("data/tokens/")}}


@pytest.mark.slow
def test_two_gloo_ranks_train_the_mixture_one_rank_does(two_ranks, tmp_path):
    """The same mixture on 2 gloo ranks (micro-batch 1 each) and on 1 rank (micro-batch 2): the same sequences
    per step, so the losses agree within fp32 rounding of the gradient all-reduce, and so do the sources' tokens."""
    from pipeline.tracking import read_metrics
    from pipeline.train.trainer import run

    r0, r1 = two_ranks.part("mixture")
    root = two_ranks.tmp / "mix_data"
    over = ("schedule.max_steps=4", "train.eval_interval=0", "train.micro_batch_size=2", "train.global_batch_size=2")
    one = run(cfg_of(tmp_path / "one", [root / "a", root / "b"], *over))
    assert r0["losses"] == r1["losses"] and r0["losses"] == pytest.approx(one.losses, rel=1e-5)
    last = read_metrics(tmp_path / "one" / "metrics.jsonl")[-1]
    assert r0["tokens"] == {k: v for k, v in last.items() if k.startswith("data/tokens/")} != {}
