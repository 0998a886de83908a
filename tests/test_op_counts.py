"""Op counts of one training step (bench/step_profile.py on CPU): how many aten ops tlf's step dispatches and how
many of them do work (the CPU stand-in for GPU kernel launches), in the loops and in all, and the host reads of
tlf's own code, for tiny loopformer and t-loopformer. The counts depend on the code path only (not on the
machine or its load: the router, shortcut schedule and batch are seeded), so a change that adds ops or syncs to
the step shows here. They must not exceed the committed baseline; after a change that lowers them (or a torch
upgrade that moves them), regenerate it with the command the file names."""

import json
from pathlib import Path

import pytest
import torch

BASELINE = Path(__file__).resolve().parent / "fixtures" / "op_counts.json"


@pytest.fixture(scope="module")
def counts():
    from bench.step_profile import baseline_counts

    threads = torch.get_num_threads()
    try:
        return baseline_counts()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", ["loopformer", "t-loopformer"])
def test_step_op_counts_do_not_grow(counts, variant):
    base = json.loads(BASELINE.read_text())
    got, want = counts[variant], base["counts"][variant]
    assert got.keys() == want.keys()
    worse = {k: (got[k], want[k]) for k in want if got[k] > want[k]}
    assert not worse, (
        f"{variant}: more ops or host reads per step than the baseline (got, baseline): {worse}; torch "
        f"{torch.__version__} (baseline: {base['torch']}). If intended, regenerate: {base['command']}"
    )


def test_the_router_costs_one_host_read_per_step(counts):
    """t-loopformer's step reads the host once more than loopformer's (its forward's one read of every loop's
    |A_i|); both make the trainer's one read per step."""
    assert counts["loopformer"]["host_reads_per_step"] == 1
    assert counts["t-loopformer"]["host_reads_per_step"] == 2
