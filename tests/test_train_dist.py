"""Two gloo ranks on CPU under the real DeepSpeed launcher: ZeRO 1/2/3 learn a repeated batch, resume is bit-exact
with 2 ranks, and `tlf train` itself runs under the launcher (SIGTERM saves and exits; the module form resumes).

This file is also the worker script: `deepspeed --no_local_rank --num_gpus 2 tests/test_train_dist.py OUT DATA TMP`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, clean_env, make_shards

from pipeline.train.ds import free_port

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
DIST = ["train.micro_batch_size=2", "train.global_batch_size=4"]  # 2 ranks x 2 sequences


def _launcher(*args: str) -> list[str]:
    return [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(free_port()), *args]


# ------------------------------------------------------------------------------------------ the worker
def worker(out: str, data_rep: str, data_many: str, tmp: str) -> None:
    import torch

    from pipeline.config import load_config
    from pipeline.train.cli import _exit
    from pipeline.train.trainer import run

    rank = int(os.environ["RANK"])
    result = {}

    def cfg(d: str, data: str, *extra: str):
        return load_config("tiny/t-loopformer", TINY + DIST + [f"data.dir={data}", f"checkpoint.dir={tmp}/{d}", *extra])

    for stage in (1, 2, 3):  # a tiny repeated batch (the split holds exactly one global batch): loss must fall
        res = run(
            cfg(
                f"z{stage}",
                data_rep,
                f"train.zero_stage={stage}",
                "schedule.max_steps=10",
                "checkpoint.interval=0",
                "train.eval_interval=0",
            )
        )
        result[f"z{stage}"] = res.losses
    for stage in (1, 3):  # bit-exact resume with 2 ranks
        extra = [f"train.zero_stage={stage}", "schedule.max_steps=6", "checkpoint.interval=3", "train.eval_interval=3"]
        full = run(cfg(f"full{stage}", data_many, *extra))
        part = run(cfg(f"part{stage}", data_many, *extra, f"checkpoint.resume={tmp}/full{stage}/global_step3"))
        result[f"resume{stage}"] = {
            "full": full.losses,
            "part": part.losses,
            "full_val": full.val_losses[6],
            "part_val": part.val_losses[6],
            "start": part.start_step,
        }
    st = torch.load(f"{tmp}/full1/global_step6/rank{rank}_state.pt", weights_only=False)
    result["rank_state"] = {"rank": st["rank"], "micro": st["loader"]["micro"]}
    all_results = [None, None]
    torch.distributed.all_gather_object(all_results, result)
    if rank == 0:
        Path(out).write_text(json.dumps(all_results))
    _exit(0)


# ------------------------------------------------------------------------------------------- the tests
def shm_buffers() -> set[str]:
    """DeepSpeed's CPU all-reduce buffers in /dev/shm (one per rank of a run on one machine)."""
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def test_two_gloo_ranks_zero_1_2_3_learn_and_resume_bit_exact(tmp_path):
    import torch

    from pipeline.model.io import load_model

    rep = make_shards(tmp_path / "rep", windows=4)  # one global batch, repeated every step
    many = make_shards(tmp_path / "many", windows=14, seed=1)
    out = tmp_path / "out.json"
    before = shm_buffers()
    p = subprocess.run(
        _launcher("--no_local_rank", __file__, str(out), str(rep), str(many), str(tmp_path / "ck")),
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    assert shm_buffers() <= before  # DeepSpeed's shared-memory all-reduce buffers do not outlive the run
    r0, r1 = json.loads(out.read_text())
    for stage in (1, 2, 3):
        losses = r0[f"z{stage}"]
        assert len(losses) == 10 and losses == r1[f"z{stage}"]  # the logged loss is the mean over ranks
        assert losses[-1] < 0.7 * losses[0], (stage, losses)
    # ZeRO stages agree on the same data (fp32; docs/design.md §6 saw ~1e-6)
    assert max(abs(a - b) for a, b in zip(r0["z1"], r0["z3"])) < 1e-4
    for stage in (1, 3):
        r = r0[f"resume{stage}"]
        assert r["start"] == 3 and r["part"] == r["full"][3:] and r["part_val"] == r["full_val"]
    assert r0["rank_state"] == {"rank": 0, "micro": 6} and r1["rank_state"] == {"rank": 1, "micro": 6}
    ck = tmp_path / "ck" / "z3"
    assert (ck / "latest").read_text() == "global_step10"
    assert {p.name for p in (ck / "global_step10").glob("rank*_state.pt")} == {"rank0_state.pt", "rank1_state.pt"}
    model, _ = load_model(ck)  # the ZeRO-3 export holds full (gathered) weights
    assert model.wte.weight.shape == (512, 32) and all(torch.isfinite(p).all() for p in model.parameters())


def test_tlf_train_under_the_launcher_sigterm_then_module_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    data = make_shards(tmp_path / "data", windows=20)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = (
        TINY
        + DIST
        + [
            f"data.dir={data}",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "train.zero_stage=2",
            "logging.mlflow=true",
            f"logging.tracking_uri={uri}",
            "train.log_interval=1",
            "checkpoint.interval=0",
            "train.eval_interval=0",
        ]
    )
    tlf = shutil.which("tlf", path=str(Path(PY).parent))
    proc = subprocess.Popen(
        _launcher("--no_local_rank", tlf, "train", "tiny/t-loopformer", *common, "schedule.max_steps=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    lines = []
    deadline = time.time() + 400
    for line in proc.stdout:
        lines.append(line)
        if "[tlf] step 3/" in line or time.time() > deadline:
            break
    # as a scheduler's preemption or Ctrl-C does: the whole process group (the runner alone does not forward
    # SIGTERM); the scheduler SIGKILLs the group after its grace period, here as soon as rank 0 reports its save
    os.killpg(proc.pid, signal.SIGTERM)
    for line in proc.stdout:
        lines.append(line)
        if "stopped by SIGTERM" in line:
            break
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    # README: the runner dies of the SIGTERM itself (143 in a shell), whatever the ranks do: its status is no sign
    assert proc.returncode == -signal.SIGTERM, proc.returncode
    assert "[tlf] step 3/" in text, text[-4000:]
    assert "stopped by SIGTERM" in text, text[-4000:]
    ck = tmp_path / "ck"
    stop = int((ck / "latest").read_text().removeprefix("global_step"))
    assert stop >= 3
    assert {p.name for p in (ck / f"global_step{stop}").glob("rank*_state.pt")} == {"rank0_state.pt", "rank1_state.pt"}
    from pipeline.rundir import damage, newest_intact

    assert newest_intact(ck) == ck / f"global_step{stop}" and damage(ck / f"global_step{stop}") is None
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tlf").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["world_size"] == "2" and run.data.tags["zero_stage"] == "2"
    assert run.data.params["train.global_batch_size"] == "4"

    # the module form, resume auto, two more steps: exit 0 and the same MLflow run continues
    p = subprocess.run(
        _launcher(
            "--module",
            "pipeline.train",
            "tiny/t-loopformer",
            *common,
            f"schedule.max_steps={stop + 2}",
            "--resume",
            "auto",
        ),
        capture_output=True,
        text=True,
        timeout=400,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    assert f"resumed from {ck / f'global_step{stop}'}" in p.stdout
    assert (ck / "latest").read_text() == f"global_step{stop + 2}"
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == stop + 2


if __name__ == "__main__":
    worker(*sys.argv[1:5])
