"""The kill-trial tool (bench/faults.py) in reduced form: SIGKILL `tlf train` inside the final export and at a
seeded random moment; each rerun of the same command resumes from the newest complete checkpoint and ends with
exactly the uninterrupted run's losses."""
from __future__ import annotations

import pytest

from bench.faults import train_trials


@pytest.mark.slow
def test_train_kill_trials_do_not_diverge(tmp_path):
    res = train_trials(2, seed=0, work=tmp_path, steps=4, interval=2)
    assert res["trials"] == 2 and res["divergences"] == 0, res["records"]
    final = res["records"][0]
    assert final["killed"] and "final export" in final["kill"]
    assert final["newest_complete"] == 2 and final["resumed_from"] == 2  # the previous checkpoint, loadable
