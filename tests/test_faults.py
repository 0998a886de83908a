"""The kill-trial tool (bench/faults.py) in reduced form, for every stage: SIGKILL at seeded moments (inside a
checkpoint save, the final export, a shard write, a random step, a unit of evaluation: events of the run, never
elapsed time, so every trial is killed mid-run however loaded the machine), rerun the same command, and demand the
uninterrupted run's output exactly: shard bytes for prep-data, losses for train (1 process and 2 gloo ranks under
the launcher, process group killed), results.json for eval."""

from __future__ import annotations

import pytest

from bench.faults import eval_trials, prep_trials, train_trials


def _clean(res: dict, n: int) -> None:
    assert res["trials"] == n and res["divergences"] == 0, res["records"]


@pytest.mark.slow
def test_train_kill_trials_do_not_diverge(tmp_path):
    res = train_trials(2, seed=0, work=tmp_path, steps=4, interval=2)
    _clean(res, 2)
    final = res["records"][0]
    assert final["killed"] and "final export" in final["kill"]
    assert final["newest_complete"] == 2 and final["resumed_from"] == 2  # the previous checkpoint, loadable


@pytest.mark.slow
def test_two_rank_train_kill_trials_do_not_diverge(tmp_path):
    # one trial: the process group killed inside the final export, each rank's shards part-written. A group killed
    # during a step is the one-process trials' case with the launcher added, and a rank killed during a step under
    # torchrun is tests/test_restart.py's; `python bench/faults.py --stages train2` runs every kind.
    res = train_trials(1, seed=0, work=tmp_path, steps=4, interval=2, ranks=2)
    _clean(res, 1)
    (t,) = res["records"]
    assert t["killed"] and "final export" in t["kill"] and t["resumed_from"] == 2


@pytest.mark.slow
def test_prep_data_kill_trials_do_not_diverge(tmp_path):
    res = prep_trials(3, seed=0, work=tmp_path, docs=600, shard_tokens=8000)
    _clean(res, 3)
    recs = res["records"]
    assert {t["workers"] for t in recs} == {0, 1, 2} and {t["input"] for t in recs} == {"jsonl", "jsonl.zst"}
    assert all(t["killed"] for t in recs) and "inside token-file write" in recs[0]["kill"]
    assert "right after token-file write" in recs[2]["kill"]  # an event of the run, not a moment in time


@pytest.mark.slow
def test_eval_kill_trials_do_not_diverge(tmp_path):
    res = eval_trials(2, seed=0, work=tmp_path, tasks="copa")  # units: copa and perplexity at 2 budgets, the write
    _clean(res, 2)
    assert res["killed"] == 2  # each at an event of the run (a unit of work, the results write), not a time
    assert res["records"][0]["kill"] == "as results.json is written" and not res["records"][0]["results_json_at_kill"]
