"""Two gloo ranks on CPU under the real DeepSpeed launcher: ZeRO 1/2/3 learn a repeated batch, resume is bit-exact
with 2 ranks, and `tlf train` itself runs under the launcher (SIGTERM saves and exits; the module form resumes).

The first two are parts "zero" and "resume" of the shared launcher run (tests/two_ranks.py): `zero_part` and
`resume_part` run on each rank there; the resume continues test_reshard.py's uninterrupted 2-rank runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, clean_env, make_shards

pytestmark = pytest.mark.slow  # real multi-process runs (`-m 'not slow'` skips them)

PY = sys.executable
DIST = ["train.micro_batch_size=2", "train.global_batch_size=4"]  # 2 ranks x 2 sequences
RESUMED = (3, 2)  # the ZeRO stages of test_reshard.py's uninterrupted 2-rank runs, each resumed at step 2


# ------------------------------------------------------------------------------ the parts of the 2-rank run
def zero_part(tmp: str) -> dict:
    """ZeRO 1/2/3 on a tiny repeated batch (the split holds exactly one global batch): each stage's losses."""
    from pipeline.config import load_config
    from pipeline.train.trainer import run

    losses = {}
    for stage in (1, 2, 3):
        extra = [f"train.zero_stage={stage}", "schedule.max_steps=10", "checkpoint.interval=0", "train.eval_interval=0"]
        over = TINY + DIST + [f"data.dir={tmp}/rep", f"checkpoint.dir={tmp}/z{stage}", *extra]
        losses[stage] = run(load_config("tiny/t-loopformer", over)).losses
    return losses


def resume_part(tmp: str) -> dict:
    """test_reshard.py's uninterrupted 2-rank runs resumed from their step-2 checkpoints by the same command line:
    each resumed run's start, losses and the rank's saved state at its end."""
    import torch

    from test_reshard import _cfg
    from pipeline.train.trainer import run

    out = {}
    for stage in RESUMED:
        ck = f"{tmp}/two{stage}/global_step2"
        res = run(
            _cfg(tmp, f"again{stage}", f"{tmp}/data", stage, "train.grad_accum_steps=1", f"checkpoint.resume={ck}")
        )
        st = torch.load(f"{tmp}/again{stage}/global_step4/rank{os.environ['RANK']}_state.pt", weights_only=False)
        out[stage] = {"start": res.start_step, "losses": res.losses, "rank": st["rank"], "micro": st["loader"]["micro"]}
    return out


# ------------------------------------------------------------------------------------------- the tests
def test_two_gloo_ranks_zero_1_2_3_learn(two_ranks):
    import torch

    from pipeline.model.io import load_model

    r0, r1 = two_ranks.part("zero")
    for stage in ("1", "2", "3"):
        losses = r0[stage]
        assert len(losses) == 10 and losses == r1[stage]  # the logged loss is the mean over ranks
        assert losses[-1] < 0.7 * losses[0], (stage, losses)
    # ZeRO stages agree on the same data (fp32; docs/design.md §6 saw ~1e-6)
    assert max(abs(a - b) for a, b in zip(r0["1"], r0["3"])) < 1e-4
    assert not two_ranks.leftover_shm  # DeepSpeed's shared-memory all-reduce buffers do not outlive the run
    ck = two_ranks.tmp / "z3"
    assert (ck / "latest").read_text() == "global_step10"
    assert {p.name for p in (ck / "global_step10").glob("rank*_state.pt")} == {"rank0_state.pt", "rank1_state.pt"}
    model, _ = load_model(ck)  # the ZeRO-3 export holds full (gathered) weights
    assert model.wte.weight.shape == (512, 32) and all(torch.isfinite(p).all() for p in model.parameters())


def test_two_gloo_ranks_resume_bit_exact(two_ranks):
    """ZeRO-3 and ZeRO-2 on 2 ranks (train.deterministic): the resumed run's losses and final weights are the
    uninterrupted run's, bit for bit, and each rank's saved state is its own."""
    full = two_ranks.part("reshard")[0]  # the uninterrupted runs (rank 0's record)
    r0, r1 = two_ranks.part("resume")
    for stage in RESUMED:
        r = r0[str(stage)]
        assert r["start"] == 2 and r["losses"] == full[f"two{stage}"]["loss"][2:], (stage, r, full[f"two{stage}"])
        assert (r["rank"], r["micro"]) == (0, 4) and (r1[str(stage)]["rank"], r1[str(stage)]["micro"]) == (1, 4)
        export = "global_step4/model/model.safetensors"
        again, ref = two_ranks.tmp / f"again{stage}" / export, two_ranks.tmp / f"two{stage}" / export
        assert again.read_bytes() == ref.read_bytes(), stage


def test_tlf_train_under_the_launcher_sigterm_then_module_resume(tmp_path):
    from mlflow.tracking import MlflowClient

    from bench.faults import launcher

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
        launcher("--no_local_rank", tlf, "train", "tiny/t-loopformer", *common, "schedule.max_steps=100000"),
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
        launcher(
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
