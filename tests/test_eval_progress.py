"""`tlf eval` a user can watch: one progress bar with an ETA on stderr over every budget's task examples and
perplexity windows (drawn only on a terminal, off with --no-progress), and a task whose data cannot be reached
skipped with one warning line, marked in results.json and table1.md (an error with --strict)."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from data_prep.shards import write_shard
from evaluation import evaluate
from evaluation.evaluate import run
from evaluation.tasks import TaskUnavailable
from helpers import perturbed_tiny
from pipeline.model.io import save_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalprogress")
    m, cfg = perturbed_tiny()
    save_model(root / "model", m, cfg)
    (root / "val").mkdir()
    write_shard(root / "val" / "v_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 300))
    return root


def ov(root, tasks="[copa,race,sciq]", **kw):
    return [
        f"eval.tasks={tasks}",
        "eval.limit=3",
        "eval.source=offline",
        f"eval.race_file={root / 'no-race.jsonl'}",
        f"data.dir={root / 'val'}",
        "data.extra_val_dirs=[]",
        "eval.ppl_tokens=130",
        "eval.latency=false",
        "eval.mlflow=false",
        "eval.depth=false",
        f"eval.out_dir={root / 'out'}",
        *[f"eval.{k}={v}" for k, v in kw.items()],
    ]


def test_an_unreachable_task_is_skipped_with_one_line_and_marked(ckpt):
    lines = []
    res = run(ckpt / "model", ov(ckpt), loops="2,4", log=lines.append)
    warn = [ln for ln in lines if "warning" in ln and "rests on" not in ln]  # (not the 130 perplexity tokens')
    assert len(warn) == 1 and "skipping race" in warn[0] and "\n" not in warn[0]
    assert list(res["skipped_tasks"]) == ["race"] and "no offline copy" in res["skipped_tasks"]["race"]
    assert all(set(b["tasks"]) == {"copa", "sciq"} for b in res["budgets"])  # the others ran, at every budget
    assert json.loads((ckpt / "out" / "results.json").read_text())["skipped_tasks"] == res["skipped_tasks"]
    table = (ckpt / "out" / "table1.md").read_text()
    row = table.splitlines()[2].split(" | ")
    assert row.count("skipped") == 1 and "Race: race skipped" in table


def test_strict_makes_an_unreachable_task_an_error(ckpt):
    with pytest.raises(TaskUnavailable, match="race: no offline copy"):
        run(ckpt / "model", ov(ckpt, strict="true"), log=lambda m: None)
    from pipeline.cli import main

    r = CliRunner().invoke(main, ["eval", str(ckpt / "model"), *ov(ckpt, tasks="[race]"), "--strict"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "race: no offline copy" in r.output


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_covers_every_budget_task_and_window(ckpt, monkeypatch):
    seen = {}

    class Watched(evaluate.Progress):
        def close(self):
            seen.update(n=self.bar.n, total=self.bar.total)
            super().close()

    monkeypatch.setattr(evaluate, "Progress", Watched)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    run(ckpt / "model", ov(ckpt), loops="2,4", log=lambda m: None)
    drawn = term.getvalue()
    assert "eval M=2 copa" in drawn and "eval M=4 ppl val" in drawn and "%|" in drawn and "<" in drawn  # ETA
    # 2 budgets x (3 copa + 3 sciq examples + the perplexity windows of 130 tokens): all done at the end
    assert seen["total"] > 2 * 6 and seen["n"] == pytest.approx(seen["total"])


def test_no_bar_off_a_terminal_or_with_no_progress(ckpt, monkeypatch):
    pipe = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", pipe)
    run(ckpt / "model", ov(ckpt, tasks="[copa]"), log=lambda m: None)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    run(ckpt / "model", ov(ckpt, tasks="[copa]", progress="false"), log=lambda m: None)
    assert pipe.getvalue() == "" and term.getvalue() == ""
