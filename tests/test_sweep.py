"""`tlf sweep`: the plan for all eight variants (seven trainings: naive-loop-ee reads the base-loop checkpoint),
the orchestrator it shares with the demo, and a real (tiny) sweep end to end."""

import os
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from data_prep.shards import write_shard
from pipeline import demo, orchestrate
from pipeline.cli import main
from pipeline.config import VARIANTS

TRAINED = [v for v in VARIANTS if v != "naive-loop-ee"]


def test_sweep_prints_every_launch_command():
    r = CliRunner().invoke(
        main,
        [
            "sweep",
            "paper",
            "--print",
            "--launcher",
            "deepspeed --num_gpus 8 --hostfile hosts",
            "--eval-args",
            "--loops 2,4,8",
            "train.zero_stage=2",
        ],
    )
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == len(TRAINED) + len(VARIANTS) + 1
    for v, line in zip(TRAINED, lines):
        assert line == (
            f"deepspeed --num_gpus 8 --hostfile hosts $(which tlf) train paper/{v} "
            f"checkpoint.dir=runs/sweep-paper/checkpoints/{v} logging.experiment=sweep-paper train.zero_stage=2"
        )
    evals = lines[len(TRAINED) : -1]
    assert evals[0].startswith(
        "tlf eval runs/sweep-paper/checkpoints/base --out runs/sweep-paper/eval/base --loops 2,4,8"
    )
    assert [e.split()[2].rsplit("/", 1)[1] for e in evals] == [
        "base-loop" if v == "naive-loop-ee" else v for v in VARIANTS
    ]  # each variant's trained checkpoint
    assert (
        "tlf eval runs/sweep-paper/checkpoints/base-loop --variant naive-loop-ee --out runs/sweep-paper/eval/"
        "naive-loop-ee --loops 2,4,8"
    ) in r.output
    assert lines[-1] == "tlf compare --experiment sweep-paper --out runs/sweep-paper/compare"


def test_naive_loop_ee_alone_still_trains_base_loop_once():
    r = CliRunner().invoke(main, ["sweep", "tiny", "--print", "--variants", "naive-loop-ee,base-loop"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert [x for x in lines if " train " in x] == [
        "tlf train tiny/base-loop checkpoint.dir=runs/sweep-tiny/checkpoints/base-loop logging.experiment=sweep-tiny"
    ]
    assert [x.split(" --out ")[0] for x in lines if " eval " in x] == [
        "tlf eval runs/sweep-tiny/checkpoints/base-loop --variant naive-loop-ee",
        "tlf eval runs/sweep-tiny/checkpoints/base-loop",
    ]


def test_demo_and_sweep_run_through_the_one_orchestrator(monkeypatch, tmp_path):
    plans = []
    monkeypatch.setattr(orchestrate, "run", lambda stages, announce, fail: plans.append(stages) or [])
    r = CliRunner().invoke(
        main, ["sweep", "tiny", "--variants", "base-loop,naive-loop-ee", "--out", str(tmp_path / "sw")]
    )
    assert r.exit_code == 0, r.output
    demo.main(["--variants", "base-loop,naive-loop-ee", "--work", str(tmp_path / "demo")])
    demo.main(["--fold", "--work", str(tmp_path / "demo")])
    (sweep, shown, fold) = plans  # make demo-fold is the same plan on the fold task (fold presets)
    assert [s.args[0] for s in fold] == ["prep-data", "train", "train", "eval", "eval", "compare"]
    assert [s.title for s in fold[1:]] == [
        "train fold/loopformer",
        "train fold/t-loopformer-expected",
        "eval fold/loopformer",
        "eval fold/t-loopformer-expected",
        "compare",
    ]
    for stages, scale in ((sweep, "tiny"), (shown[2:], "small")):  # the demo first makes its two data sets
        assert [s.title for s in stages] == [
            f"train {scale}/base-loop",
            f"eval {scale}/base-loop",
            f"eval {scale}/naive-loop-ee (the base-loop checkpoint)",
            "compare",
        ]
        assert [s.args[0] for s in stages] == ["train", "eval", "eval", "compare"]
    assert [s.args[0] for s in shown[:2]] == ["prep-data", "prep-data"]


def test_sweep_rejects_bad_input_before_running():
    r = CliRunner().invoke(main, ["sweep", "tiny", "--print", "model.loopz=2"])
    assert r.exit_code == 2 and "unknown config key 'model.loopz'" in r.output
    r = CliRunner().invoke(main, ["sweep", "tiny", "--print", "--variants", "loopformer,nope"])
    assert r.exit_code == 2 and "'nope' is not one of" in r.output


def test_tiny_sweep_runs_end_to_end(tmp_path, monkeypatch):
    """Its stages run as `make demo` runs them: without the packages the demo's set-up leaves out."""
    monkeypatch.chdir(tmp_path)
    blocker = Path(__file__).parent / "fixtures" / "demo_packages"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")])))
    rng = np.random.default_rng(0)
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "t_train_000000.bin", rng.integers(0, 512, 20000))
    write_shard(tmp_path / "shards" / "t_val_000000.bin", rng.integers(0, 512, 4000))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = CliRunner().invoke(
        main,
        [
            "sweep",
            "tiny",
            "--variants",
            "t-loopformer",
            "--out",
            "sw",
            "--tracking-uri",
            uri,
            "--eval-args",
            "--tasks none --no-latency --ppl-tokens 512 --loops 2,4",
            "schedule.max_steps=3",
            "model.vocab_size=512",  # the tiny preset's 50304 rows of LM head cost most of a step here
            "train.eval_interval=0",
            f"data.dir={tmp_path / 'shards'}",
        ],
    )
    assert r.exit_code == 0, r.output
    md = (tmp_path / "sw" / "compare" / "compare.md").read_text()
    assert "t-loopformer (M=2)" in md and "t-loopformer (M=4)" in md
    assert (tmp_path / "sw" / "compare" / "loss_curves.png").is_file()
