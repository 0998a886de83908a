"""Resume on another world size and ZeRO stage (pipeline/train/reshard.py): a checkpoint of 1 rank resumes on 2
gloo ranks under the real DeepSpeed launcher and one of 2 ranks on 1, for ZeRO 0/1/2/3 and with a stage change;
the losses after the resume equal an uninterrupted run at the new world size within fp32 reduction-order
rounding, and the data position is the same. Global batch 4 = 2 x 2 on two ranks, 2 x 2 accumulated on one (the
resumed run's grad-accum adapts). The model has no random shortcut schedule (tiny/base-loop), so the runs differ
only by the order of fp32 sums.

This file is also the worker script: `deepspeed --no_local_rank --num_gpus 2 tests/test_reshard.py OUT DATA TMP`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, clean_env, make_shards
from test_train_dist import _launcher

STAGES = (0, 1, 2, 3)
CHANGE = {1: 3, 3: 0}  # a stage change each way: 1 rank ZeRO-1 -> 2 ranks ZeRO-3; 2 ranks ZeRO-3 -> 1 rank ZeRO-0
RTOL = 1e-5  # fp32 reduction order (measured: see docs/design.md)


def _cfg(tmp: str, d: str, data: str, stage: int, *extra: str):
    from pipeline.config import load_config

    return load_config("tiny/base-loop", TINY + [
        "train.micro_batch_size=2", "train.global_batch_size=4", f"data.dir={data}", f"checkpoint.dir={tmp}/{d}",
        f"train.zero_stage={stage}", "schedule.max_steps=4", "checkpoint.interval=2", "checkpoint.keep_last=3",
        "train.eval_interval=0", "train.deterministic=true", *extra])


def _position(tmp: str, d: str) -> list:
    import torch

    st = torch.load(f"{tmp}/{d}/global_step4/rank0_state.pt", weights_only=True)["loader"]
    return [st["epoch"], st["offset"]]


def _runs(tmp: str, data: str, world: str, fresh: int | None, resume: int | None) -> dict:
    """Uninterrupted runs <world><stage> of this world size with grad-accum `fresh`, then resumes from the other
    world size's checkpoints at step 2 (same stage, and the CHANGE pairs) on a command line with grad-accum
    `resume` (the other world size's: it adapts). None: skip. Returns losses and data positions."""
    from pipeline.train.trainer import run

    other = "one" if world == "two" else "two"
    out = {}
    for s in STAGES if fresh else ():
        out[f"{world}{s}"] = {"loss": run(_cfg(tmp, f"{world}{s}", data, s, f"train.grad_accum_steps={fresh}")).losses,
                              "pos": _position(tmp, f"{world}{s}")}
    for s, t in [(s, s) for s in STAGES] + list(CHANGE.items()) if resume else ():
        src = f"{tmp}/{other}{s}/global_step2"
        d = f"from_{other}{s}_to_{world}{t}"
        res = run(_cfg(tmp, d, data, t, f"train.grad_accum_steps={resume}", f"checkpoint.resume={src}"))
        out[d] = {"loss": res.losses, "pos": _position(tmp, d), "start": res.start_step, "want": f"{world}{t}"}
    return out


def worker(out: str, data: str, tmp: str) -> None:
    from pipeline.train.cli import _exit

    res = _runs(tmp, data, "two", 1, 2)  # resumes on the 1-rank command line (accum 2): it adapts to 1
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(res))
    _exit(0)


def _check(res: dict) -> float:
    worst = 0.0
    for d, r in res.items():
        if "want" not in d and not d.startswith("from_"):
            continue
        want = res[r["want"]]
        assert r["start"] == 2 and len(r["loss"]) == 2, (d, r)
        assert r["pos"] == want["pos"], (d, r["pos"], want["pos"])  # the same global data position
        for a, b in zip(r["loss"], want["loss"][2:]):
            worst = max(worst, abs(a - b) / abs(b))
    assert worst <= RTOL, (worst, res)
    return worst


def test_resume_one_rank_on_two_and_two_on_one_zero_0_1_2_3_and_stage_change(tmp_path):
    import torch

    torch.set_num_threads(1)
    data = make_shards(tmp_path / "data", windows=14)  # 3 steps of 4 per epoch: step 4 is in the second epoch
    tmp = str(tmp_path)
    one = _runs(tmp, str(data), "one", 2, None)  # no 2-rank checkpoints yet
    out = tmp_path / "two.json"
    p = subprocess.run(_launcher("--no_local_rank", __file__, str(out), str(data), tmp), capture_output=True,
                       text=True, timeout=600, env=clean_env(), cwd=tmp_path)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    two = json.loads(out.read_text())
    back = _runs(tmp, str(data), "one", None, 1)  # on the 2-rank command line (accum 1): it adapts to 2
    one.update(back)
    assert sum(k.startswith("from_") for k in two) == sum(k.startswith("from_") for k in one) == 6
    for s in STAGES:  # the uninterrupted runs of one and two ranks agree too (the same data, the same sums)
        assert one[f"one{s}"]["pos"] == two[f"two{s}"]["pos"]
    worst = max(_check(one), _check(two))
    print(f"max relative loss difference after a resume on another world size/stage: {worst:.2e}")


if __name__ == "__main__":
    worker(*sys.argv[1:])
