"""Resume on another world size and ZeRO stage (pipeline/train/reshard.py): a checkpoint of 1 rank resumes on 2
gloo ranks under the real DeepSpeed launcher and one of 2 ranks on 1, each with a stage change, so that every
ZeRO stage 0/1/2/3 is once read and once loaded: 1 rank ZeRO-0 -> 2 ranks ZeRO-3 and back, 1 rank ZeRO-1 -> 2
ranks ZeRO-2 and back (the uninterrupted runs are the other direction's sources: 8 runs, 4 of them on 2 ranks).
The losses after the resume equal an uninterrupted run at the new world size and stage within fp32
reduction-order rounding, and the data position is the same. Then `tlf train` itself resumes a 2-rank checkpoint
on 1 rank from the 2-rank command line (grad-accum adapts). Global batch 4 = 2 x 2 on two ranks, 2 x 2 accumulated
on one (the resumed run's grad-accum adapts). The models draw a random shortcut schedule (tiny/t-loopformer for the
ZeRO-0 <-> 3 pair, tiny/loopformer for 1 <-> 2): one per optimizer step keyed to (train.seed, step), so the runs
differ only by the order of fp32 sums.

The 2-rank runs are part "reshard" of the shared launcher run (tests/two_ranks.py), whose 1-rank sources
(`one_rank_sources`) are made before it starts; their checkpoints also serve test_train_dist.py's bit-exact 2-rank
resume.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, make_shards

pytestmark = pytest.mark.slow  # real multi-process runs (`-m 'not slow'` skips them)

PAIRS = {0: 3, 1: 2}  # 1 rank ZeRO-s <-> 2 ranks ZeRO-PAIRS[s]: a world-size and a stage change in each resume
STAGES = {"one": tuple(PAIRS), "two": tuple(PAIRS.values())}  # the uninterrupted runs' stages per world size
PRESET = {0: "tiny/t-loopformer", 3: "tiny/t-loopformer", 1: "tiny/loopformer", 2: "tiny/loopformer"}  # by stage
RTOL = 1e-5  # fp32 reduction order (measured: see docs/design.md)


def _args(tmp: str, d: str, data: str, stage: int, *extra: str) -> list[str]:
    return TINY + [
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        f"data.dir={data}",
        f"checkpoint.dir={tmp}/{d}",
        f"train.zero_stage={stage}",
        "schedule.max_steps=4",
        "checkpoint.interval=2",
        "checkpoint.keep_last=3",
        "train.eval_interval=0",
        "train.deterministic=true",
        *extra,
    ]


def _cfg(tmp: str, d: str, data: str, stage: int, *extra: str):
    from pipeline.config import load_config

    return load_config(PRESET[stage], _args(tmp, d, data, stage, *extra))


def _position(tmp: str, d: str) -> list:
    import torch

    st = torch.load(f"{tmp}/{d}/global_step4/rank0_state.pt", weights_only=True)["loader"]
    return [st["epoch"], st["offset"]]


def _runs(tmp: str, data: str, world: str, fresh: int | None, resume: int | None) -> dict:
    """Uninterrupted runs <world><stage> of this world size with grad-accum `fresh`, then resumes from the other
    world size's checkpoints at step 2 (onto the paired stage) on a command line with grad-accum `resume` (the
    other world size's: it adapts). None: skip. Returns losses and data positions."""
    from pipeline.train.trainer import run

    other = "one" if world == "two" else "two"
    out = {}
    for s in STAGES[world] if fresh else ():
        out[f"{world}{s}"] = {
            "loss": run(_cfg(tmp, f"{world}{s}", data, s, f"train.grad_accum_steps={fresh}")).losses,
            "pos": _position(tmp, f"{world}{s}"),
        }
    pairs = {s: t for a, b in PAIRS.items() for s, t in ((a, b), (b, a)) if s in STAGES[other]}
    for s, t in pairs.items() if resume else ():
        src = f"{tmp}/{other}{s}/global_step2"
        d = f"from_{other}{s}_to_{world}{t}"
        res = run(_cfg(tmp, d, data, t, f"train.grad_accum_steps={resume}", f"checkpoint.resume={src}"))
        out[d] = {"loss": res.losses, "pos": _position(tmp, d), "start": res.start_step, "want": f"{world}{t}"}
    return out


def one_rank_sources(tmp: Path) -> dict:
    """Before the shared 2-rank run: its data (3 steps of 4 per epoch: step 4 is in the second epoch) and the
    uninterrupted 1-rank runs, whose step-2 checkpoints it resumes on 2 ranks."""
    data = make_shards(tmp / "data", windows=14)
    return _runs(str(tmp), str(data), "one", 2, None)  # no 2-rank checkpoints yet


def two_rank_part(tmp: str) -> dict:
    """Each rank's part of the shared 2-rank run: the uninterrupted 2-rank runs, and the resumes of the 1-rank
    checkpoints on the 1-rank command line (accum 2): it adapts to 1."""
    return _runs(tmp, f"{tmp}/data", "two", 1, 2)


def _rel(got: list[float], want: list[float]) -> float:
    """The largest relative difference of got from want, loss by loss."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _check(res: dict) -> float:
    worst = 0.0
    for d, r in res.items():
        if not d.startswith("from_"):
            continue
        want = res[r["want"]]
        assert r["start"] == 2 and len(r["loss"]) == 2, (d, r)
        assert r["pos"] == want["pos"], (d, r["pos"], want["pos"])  # the same global data position
        worst = max(worst, _rel(r["loss"], want["loss"][2:]))
    assert worst <= RTOL, (worst, res)
    return worst


def test_resume_one_rank_on_two_and_two_on_one_zero_0_1_2_3_with_stage_changes(two_ranks, monkeypatch):
    one, two = dict(two_ranks.sources()), two_ranks.part("reshard")[0]  # rank 0's
    tmp, data = str(two_ranks.tmp), two_ranks.tmp / "data"
    back = _runs(tmp, str(data), "one", None, 1)  # on the 2-rank command line (accum 1): it adapts to 2
    one.update(back)
    assert sum(k.startswith("from_") for k in two) == sum(k.startswith("from_") for k in one) == 2
    worst = max(_check(one), _check(two))  # each resumed run against the uninterrupted one at its new size and stage
    fresh = 0.0  # the uninterrupted runs of one and two ranks agree too: the same data, schedules and sums
    for s, t in PAIRS.items():
        assert one[f"one{s}"]["pos"] == two[f"two{t}"]["pos"]
        fresh = max(fresh, _rel(one[f"one{s}"]["loss"], two[f"two{t}"]["loss"]))
    assert fresh <= RTOL, (fresh, one, two)
    # `tlf train` itself, on the 2-rank command line (grad-accum 1) on 1 rank: its early batch check lets the
    # resume through (it refused 2 x 1 x 1 != 4 before the checkpoint was read), and grad-accum adapts to 2
    from click.testing import CliRunner

    from pipeline.cli import main
    from pipeline.train import cli

    monkeypatch.setattr(cli, "_exit", lambda code: sys.exit(code))
    r = CliRunner().invoke(
        main,
        [
            "train",
            PRESET[1],
            *_args(
                tmp,
                "cli",
                str(data),
                1,
                "train.grad_accum_steps=1",
                "schedule.max_steps=3",
                f"checkpoint.resume={tmp}/two2/global_step2",
            ),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (
        "resuming a checkpoint of 2 ranks under ZeRO-2 on 1 ranks under ZeRO-1: global batch 4 = micro-batch 2 x "
        "grad-accum 2 x 1 ranks" in r.output
    ), r.output
    print(
        f"max relative loss difference after a resume on another world size/stage: {worst:.2e}; 1 vs 2 ranks: {fresh:.2e}"
    )
