"""`tlf sweep`: the plan for all eight variants, and a real (tiny) sweep end to end."""
import numpy as np
from click.testing import CliRunner

from data_prep.shards import write_shard
from pipeline.cli import main
from pipeline.config import VARIANTS


def test_sweep_prints_every_launch_command():
    r = CliRunner().invoke(main, ["sweep", "paper", "--print", "--launcher", "deepspeed --num_gpus 8 --hostfile hosts",
                                  "--eval-args", "--loops 2,4,8", "train.zero_stage=2"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 2 * len(VARIANTS) + 1
    for v, line in zip(VARIANTS, lines):
        assert line == (f"deepspeed --num_gpus 8 --hostfile hosts $(which tlf) train paper/{v} "
                        f"checkpoint.dir=runs/sweep-paper/checkpoints/{v} logging.experiment=sweep-paper train.zero_stage=2")
    assert lines[len(VARIANTS)].startswith("tlf eval runs/sweep-paper/checkpoints/base --out runs/sweep-paper/eval/base "
                                           "--loops 2,4,8")
    assert lines[-1] == "tlf compare --experiment sweep-paper --out runs/sweep-paper/compare"


def test_sweep_rejects_bad_input_before_running():
    r = CliRunner().invoke(main, ["sweep", "tiny", "--print", "model.loopz=2"])
    assert r.exit_code == 2 and "unknown config key 'model.loopz'" in r.output
    r = CliRunner().invoke(main, ["sweep", "tiny", "--print", "--variants", "loopformer,nope"])
    assert r.exit_code == 2 and "'nope' is not one of" in r.output


def test_tiny_sweep_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "t_train_000000.bin", rng.integers(0, 50256, 20000))
    write_shard(tmp_path / "shards" / "t_val_000000.bin", rng.integers(0, 50256, 4000))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = CliRunner().invoke(main, ["sweep", "tiny", "--variants", "t-loopformer", "--out", "sw", "--tracking-uri", uri,
                                  "--eval-args", "--tasks none --no-latency --ppl-tokens 512 --loops 2,4",
                                  "schedule.max_steps=3", "train.eval_interval=0", f"data.dir={tmp_path / 'shards'}"])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "sw" / "compare" / "compare.md").read_text()
    assert "t-loopformer (M=2)" in md and "t-loopformer (M=4)" in md
    assert (tmp_path / "sw" / "compare" / "loss_curves.png").is_file()
