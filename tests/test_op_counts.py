"""Op counts of one training step (bench/step_profile.py on CPU) for tiny loopformer and t-loopformer under every
execution strategy (`model.execution`): how many aten ops tlf's step dispatches and how many of them do work (the
CPU stand-in for GPU kernel launches), in the loops and in all, the host reads of tlf's own code, and over steps
on fresh batches (the router's depths varying as in training) the computed loop lengths each loop position met
and the loops' padded FLOPs ÷ executed FLOPs. The counts depend on the code path only (not on the machine or its
load: the router, shortcut schedule and batches are seeded), so a change that adds ops or syncs to the step
shows here. They must not exceed the committed baseline; after a change that lowers them (or a torch upgrade that
moves them), regenerate it with the command the file names. The compiled graphs and graph breaks of each
strategy are held by tests/test_compile.py."""

import json
import math
from pathlib import Path

import pytest
import torch

BASELINE = Path(__file__).resolve().parent / "fixtures" / "op_counts.json"
CASES = ["loopformer", "t-loopformer compact", "t-loopformer sorted", "t-loopformer bucketed", "t-loopformer dense"]
NOT_GROW = ("ops_per_step", "kernel_ops_per_step", "loop_kernel_ops_per_step", "host_reads_per_step")


@pytest.fixture(scope="module")
def counts():
    from bench.step_profile import baseline_counts

    threads = torch.get_num_threads()
    try:
        return baseline_counts()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base():
    return json.loads(BASELINE.read_text())


def test_the_baseline_holds_every_strategy(base):
    from bench.step_profile import cases, strategies

    assert list(base["counts"]) == CASES == list(cases("tiny", ["loopformer", "t-loopformer"], list(strategies())))


@pytest.mark.parametrize("case", CASES)
def test_step_op_counts_do_not_grow(counts, base, case):
    got, want = counts[case], base["counts"][case]
    assert got.keys() == want.keys()
    worse = {k: (got[k], want[k]) for k in NOT_GROW if got[k] > want[k]}
    assert not worse, (
        f"{case}: more ops or host reads per step than the baseline (got, baseline): {worse}; torch "
        f"{torch.__version__} (baseline: {base['torch']}). If intended, regenerate: {base['command']}"
    )


def test_the_router_costs_one_host_read_per_step(counts):
    """A routed step reads the host once more than loopformer's (its forward's one read of every loop's |A_i|)
    under every strategy that lays work out by those counts; the dense reference reads nothing; every step makes
    the trainer's one read."""
    assert counts["loopformer"]["host_reads_per_step"] == 1
    assert counts["t-loopformer dense"]["host_reads_per_step"] == 1
    for s in ("compact", "sorted", "bucketed"):
        assert counts[f"t-loopformer {s}"]["host_reads_per_step"] == 2, s


def test_bucketed_computes_a_handful_of_lengths(counts):
    """bucketed's computed lengths are multiples of ceil(T / BUCKETS) (or T): at most BUCKETS per loop position,
    where compact meets one per distinct max |A_i|; dense and loopformer compute T everywhere."""
    from pipeline.config import load_config
    from pipeline.model.looped import BUCKETS

    T = load_config("tiny/t-loopformer").model.block_size
    b = counts["t-loopformer bucketed"]
    assert b["distinct_shapes_max"] <= BUCKETS
    assert all(S % math.ceil(T / BUCKETS) == 0 or S == T for v in b["shapes"].values() for S in v), b["shapes"]
    assert b["distinct_shapes"] < counts["t-loopformer compact"]["distinct_shapes"]
    for c in ("loopformer", "t-loopformer dense"):
        assert counts[c]["distinct_shapes"] == 1 and all(v == [T] for v in counts[c]["shapes"].values()), c
    assert counts["t-loopformer sorted"]["shapes"] == counts["t-loopformer compact"]["shapes"]


def test_padded_over_executed_flops(counts):
    """Computed slots against active tokens, at each loop's matmul FLOPs: compact and sorted pad only the rows
    shorter than a loop's longest (the same lengths), bucketed a little more, dense computes every token."""
    r = {c: counts[c]["padded_over_executed"] for c in CASES}
    assert r["loopformer"] == 1.0
    assert 1.0 <= r["t-loopformer compact"] == r["t-loopformer sorted"] <= 1.05, r
    assert r["t-loopformer compact"] <= r["t-loopformer bucketed"] <= 1.15, r
    assert r["t-loopformer dense"] >= 1.3, r
