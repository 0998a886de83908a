"""Kill trials: SIGKILL every stage at seeded random moments, rerun the same command, and check the finished output
equals an uninterrupted run's. Every kill is triggered by an event of the run (a shard written, a step, a save, a
unit of evaluation), never by elapsed time: each trial is killed mid-run however fast or loaded the machine, and a
seed names the same kills on every machine.

- `tlf prep-data` (workers 0, 1, 2; jsonl and jsonl.zst input): killed inside a shard write (half the temp file
  written) or right after one. Right after the kill every shard file a reader can open is whole and an incomplete
  directory is refused by readers; the rerun ends with every file byte-identical to an uninterrupted run.
- `tlf train` in one process, and with 2 gloo ranks under the DeepSpeed launcher (the whole process group is
  killed): inside a checkpoint save (the first trial in the final export), during a random step, or right after a
  complete save. Every run has `train.deterministic=true`, so "equals" is exact float equality of the losses after
  the resume point, which must be the newest complete checkpoint.
- `tlf train` resumed on another world size (`resize`): killed during a random step on 2 gloo ranks and resumed
  in one process, or the reverse, under ZeRO stage 0-3 in turn; the losses after the resume must equal the
  uninterrupted run at the new world size within fp32 rounding (rtol 1e-5; the maximum is reported).
- `tlf eval`: killed as a unit of work starts (a task at a budget, a perplexity set) or as results.json is about
  to be written; results.json is then absent or whole, and the rerun's equals the uninterrupted run's (timings
  and file paths aside).

A trial diverges when a check fails or the rerun fails.

    python bench/faults.py --trials 10 --seed 0 --out bench/results/faults.json    # every stage
    python bench/faults.py --stages prep,eval --trials 10                         # some
    python bench/faults.py --stages resize --trials 8 --out bench/results/faults_resize.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.interleave import write_json  # noqa: E402  (after the sys.path line above, which needs REPO)
from data_prep.shards import write_shard  # noqa: E402  (as above)
from pipeline.train.ds import free_port  # noqa: E402  (as above)

# A model small enough that a step takes milliseconds on CPU.
TINY = [
    "model.vocab_size=512",
    "model.block_size=32",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.n_layers=2",
    "model.loops=3",
    "model.fourier_dim=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "schedule.warmup_steps=2",
    "train.eval_interval=0",
    "logging.mlflow=false",
    "train.deterministic=true",
]

# KILL_IN_SAVE=N: SIGKILL inside the save of step N, after DeepSpeed's files and the rank state, before the export
# (N = max_steps: the final export). KILL_AT_LATEST=N: SIGKILL between writing `latest`'s temp file and its rename,
# after checkpoint N was renamed into place. KILL_AT_MICRO=k: SIGKILL when the loader hands out global micro-batch k
# (during step k+1 at batch 2). KILL_AFTER_SAVE=N: SIGKILL as soon as the save of step N is complete (`latest`
# written), before the next step. KILL_GROUP=1: kill the whole process group (the launcher and every rank), not just
# this process. Rank 0 prints, as its last stdout line, the losses, the steps it started from and ended at, and the
# process's thread count and deterministic-algorithms flag (before and after the run). The tests use it too.
CHILD = """
import json, os, signal, sys, torch
from pipeline.config import load_config
from pipeline.train import checkpoint
from pipeline.train.cli import _exit
from pipeline.train.trainer import run
from pipeline.train.data import TrainLoader
kill = os.environ.get("KILL_IN_SAVE")
kill_micro = int(os.environ.get("KILL_AT_MICRO", "-1"))
kill_after = os.environ.get("KILL_AFTER_SAVE")
def die():
    if os.environ.get("KILL_GROUP") == "1":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
orig = TrainLoader.next
def nxt(self):
    if self.micro == kill_micro:
        die()
    return orig(self)
TrainLoader.next = nxt
real = checkpoint.export_model
def export(engine, model, cfg, directory, rank, *rest):
    if kill and f"global_step{kill}" in str(directory):
        die()
    return real(engine, model, cfg, directory, rank, *rest)
checkpoint.export_model = export
real_save = checkpoint.save
def save(*a, **kw):
    path = real_save(*a, **kw)
    if kill_after and f"global_step{kill_after}" == path.name:
        die()
    return path
checkpoint.save = save
kill_latest = os.environ.get("KILL_AT_LATEST")
real_write = checkpoint.atomic_write_bytes
def write(path, chunks):
    if kill_latest and os.path.basename(path) == "latest" and b"".join(chunks) == f"global_step{kill_latest}".encode():
        with open(os.path.join(os.path.dirname(path), f".latest.tmp{os.getpid()}"), "wb") as fh:
            fh.write(b"".join(chunks))
        die()
    return real_write(path, chunks)
checkpoint.atomic_write_bytes = write
before = torch.get_num_threads()
res = run(load_config(os.environ.get("PRESET", "tiny/t-loopformer"), sys.argv[1:]))
if int(os.environ.get("RANK", "0")) == 0:
    print(json.dumps({"losses": [float(x) for x in res.losses], "start": res.start_step, "step": res.step,
                      "threads_before": before, "threads": torch.get_num_threads(),
                      "det": torch.are_deterministic_algorithms_enabled()}))
_exit(0)
"""

# prep-data with KILL_IN_SHARD=k: SIGKILL halfway through writing the temp file of the k-th shard (0-based, either
# split) the run writes; KILL_AFTER_SHARD=k: SIGKILL right after the k-th shard is whole on disk (between writes);
# otherwise `python -m data_prep prep-data ARGS` unchanged.
PREP_CHILD = """
import os, re, signal, sys
import data_prep.writer as writer
from data_prep.__main__ import main
k = int(os.environ.get("KILL_IN_SHARD", "-1"))
after = int(os.environ.get("KILL_AFTER_SHARD", "-1"))
seen = [0]
real = writer.atomic_write_bytes
def write(path, chunks):
    if re.search(r"_(train|val)_[0-9]{6}[.]bin$", str(path)):
        if seen[0] == k:
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            data = b"".join(bytes(c) for c in chunks)
            with open(tmp, "wb") as fh:
                fh.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        seen[0] += 1
        out = real(path, chunks)
        if seen[0] - 1 == after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return real(path, chunks)
writer.atomic_write_bytes = write
main(sys.argv[1:])
"""


def _env(**extra) -> dict:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return {**env, "PYTHONPATH": path, "DS_ACCELERATOR": "cpu", **extra}


def _popen(cmd: list[str], **extra) -> subprocess.Popen:
    """A child in its own process group (so the whole group can be killed), stdout/stderr captured."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**extra),
        start_new_session=True,
        cwd=REPO,
    )


def _start(args: list[str], **extra) -> subprocess.Popen:
    return _popen([sys.executable, "-c", CHILD, *args], **extra)


def launcher(*args: str) -> list[str]:
    """The DeepSpeed launcher's command for 2 local ranks on a free port (as `deepspeed --num_gpus 2 ARGS`)."""
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        *args,
    ]


def _start_dist(child: Path, args: list[str], **extra) -> subprocess.Popen:
    """CHILD as 2 gloo ranks under the DeepSpeed launcher, in one process group."""
    return _popen(launcher("--no_local_rank", str(child), *args), **extra)


def _finish(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    if p.returncode:
        raise RuntimeError(f"exit {p.returncode}: {err[-2000:]}{out[-1000:]}")
    return json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith('{"losses"')))


def _newest_complete(ck: Path) -> int:
    from pipeline.rundir import complete_checkpoints

    done = complete_checkpoints(ck) if ck.exists() else []
    return done[-1][0] if done else 0


def train_trials(n: int, seed: int, work: Path, steps: int = 8, interval: int = 2, ranks: int = 1) -> dict:
    """n kill trials of `tlf train` (1 process, or 2 gloo ranks under the launcher with the process group killed),
    in turn: killed inside a save (the first in the final export; trials 3, 9, … at the `latest` rename instead),
    during a random step, right after a random complete save. Every kill is triggered by an event of the run, never
    by elapsed time, so each trial is killed mid-run however fast or loaded the machine; the rerun and `tlf eval
    RUN_DIR`'s choice must both be the newest complete checkpoint. Returns counts and per-trial records."""
    data = work / "shards"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 512, 10 * ranks * 32 + 1))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 512, 8 * 32 + 1))
    common = TINY + [f"data.dir={data}", f"schedule.max_steps={steps}", f"checkpoint.interval={interval}"]
    extra = {}
    if ranks == 2:
        common += ["train.global_batch_size=4"]  # 2 ranks x 2 sequences
        extra = {"KILL_GROUP": "1"}
        child = work / "train_child.py"
        child.write_text(CHILD)

        def start(args, **env):
            return _start_dist(child, args, **env, **extra)
    else:
        start = _start
    t0 = time.perf_counter()
    ref = _finish(start(common + [f"checkpoint.dir={work / 'ref'}"]))
    ref_s = time.perf_counter() - t0
    r = random.Random(seed)
    trials, divergences = [], 0
    stage = "train (1 process)" if ranks == 1 else "train (2 gloo ranks, launcher, process group killed)"
    for i in range(n):
        ck = work / f"trial{i}"
        args = common + [f"checkpoint.dir={ck}"]
        if i % 6 == 3:  # between the checkpoint's rename and `latest`'s: eval and the rerun must use it anyway
            at = r.choice(range(interval, steps, interval))
            how = f"at the `latest` rename after step {at}"
            p = start(args, KILL_AT_LATEST=str(at))
            p.communicate(timeout=600)
        elif i % 3 == 0:
            at = steps if i == 0 else r.choice(range(interval, steps + 1, interval))
            how = f"in save of step {at}" + (" (final export)" if at == steps else "")
            p = start(args, KILL_IN_SAVE=str(at))
            p.communicate(timeout=600)
        elif i % 3 == 1:
            micro = r.randrange(steps)
            how = f"during step {micro + 1}"
            p = start(args, KILL_AT_MICRO=str(micro))
            p.communicate(timeout=600)
        else:
            at = r.choice(range(interval, steps, interval))
            how = f"right after the save of step {at}"
            p = start(args, KILL_AFTER_SAVE=str(at))
            p.communicate(timeout=600)
        killed = p.returncode == -signal.SIGKILL
        newest = _newest_complete(ck)
        rec = {"trial": i, "kill": how, "killed": killed, "newest_complete": newest}
        if newest:  # what `tlf eval RUN_DIR` loads is the newest complete checkpoint, whatever `latest` says
            from pipeline.model.io import find_export

            rec["eval_loads"] = find_export(ck).parent.name
        try:
            res = _finish(start(args))
            ok = (
                res["start"] == (newest if newest < steps else steps) and res["losses"] == ref["losses"][res["start"] :]
            )
            ok = ok and rec.get("eval_loads", f"global_step{newest}") == f"global_step{newest}"
            rec.update(resumed_from=res["start"], ok=ok)
        except RuntimeError as e:
            rec.update(ok=False, error=str(e)[-500:])
        divergences += not rec["ok"]
        trials.append(rec)
        print(
            f"{stage} trial {i}: killed {how} ({'killed' if killed else 'finished first'}), newest complete "
            f"step {newest}, rerun {'matches' if rec['ok'] else 'DIVERGES'}",
            flush=True,
        )
    return {
        "stage": stage,
        "trials": n,
        "killed": sum(t["killed"] for t in trials),
        "divergences": divergences,
        "reference_s": round(ref_s, 2),
        "records": trials,
    }


def resize_trials(n: int, seed: int, work: Path, steps: int = 8, interval: int = 2) -> dict:
    """n trials of a run killed (SIGKILL during a random step, the process group under the launcher) and resumed
    on the other world size: 2 gloo ranks -> 1 process and 1 -> 2 in turn, under ZeRO stage i % 4, rerun with the
    same command line (grad-accum adapts). The losses after the resume must equal the uninterrupted run at the new
    world size (ZeRO-0, the preset's stage) within fp32 reduction-order rounding (rtol 1e-5; the maximum is
    reported). tiny/base-loop: no random shortcut schedule,
    whose draws per micro-batch depend on how the global batch is split."""
    data = work / "shards"
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    write_shard(data / "t_train_000000.bin", rng.integers(0, 512, 20 * 32 + 1))
    write_shard(data / "t_val_000000.bin", rng.integers(0, 512, 8 * 32 + 1))
    child = work / "train_child.py"
    child.write_text(CHILD)
    common = TINY + [
        f"data.dir={data}",
        f"schedule.max_steps={steps}",
        f"checkpoint.interval={interval}",
        "train.global_batch_size=4",
    ]
    accum = {1: ["train.grad_accum_steps=2"], 2: ["train.grad_accum_steps=1"]}

    def start(ranks, args, **env):
        if ranks == 2:
            return _start_dist(child, args, PRESET="tiny/base-loop", KILL_GROUP="1", **env)
        return _start(args, PRESET="tiny/base-loop", **env)

    ref = {k: _finish(start(k, common + accum[k] + [f"checkpoint.dir={work / f'ref{k}'}"])) for k in (1, 2)}
    r = random.Random(seed)
    trials, divergences, worst = [], 0, 0.0
    for i in range(n):
        old, new, stage = (2, 1, i % 4) if i % 2 == 0 else (1, 2, i % 4)
        ck = work / f"trial{i}"
        args = common + accum[old] + [f"checkpoint.dir={ck}", f"train.zero_stage={stage}"]
        step = r.randrange(interval, steps)  # after the first checkpoint
        p = start(old, args, KILL_AT_MICRO=str(step * 2 // old))  # 2 // old micro-batches per step
        p.communicate(timeout=600)
        newest = _newest_complete(ck)
        rec = {
            "trial": i,
            "kill": f"{old} -> {new} ranks, ZeRO-{stage}, during step {step + 1}",
            "killed": p.returncode == -signal.SIGKILL,
            "newest_complete": newest,
        }
        try:
            res = _finish(start(new, args))  # the same command line on the other world size
            want = ref[new]["losses"][res["start"] :]
            rel = max((abs(a - b) / abs(b) for a, b in zip(res["losses"], want)), default=0.0)
            worst = max(worst, rel)
            ok = res["start"] == newest and len(res["losses"]) == len(want) and rel <= 1e-5
            rec.update(resumed_from=res["start"], max_rel_diff=rel, ok=ok)
        except RuntimeError as e:
            rec.update(ok=False, error=str(e)[-500:])
        divergences += not rec["ok"]
        trials.append(rec)
        print(
            f"resize trial {i}: {rec['kill']}, newest complete step {newest}, rerun "
            f"{'matches' if rec['ok'] else 'DIVERGES'} (max rel diff {rec.get('max_rel_diff', float('nan')):.1e})",
            flush=True,
        )
    return {
        "stage": "train resumed on another world size (2 <-> 1 ranks)",
        "trials": n,
        "killed": sum(t["killed"] for t in trials),
        "divergences": divergences,
        "max_rel_diff": worst,
        "records": trials,
    }


# ------------------------------------------------------------------------------------------------ prep-data
def _corpus(work: Path, docs: int) -> dict[str, Path]:
    """The same seeded documents as .jsonl and .jsonl.zst."""
    import zstandard

    r = random.Random(0)
    words = ["loop", "token", "router", "depth", "shard", "model", "cache", "gather", "scatter", "the", "a", "of"]
    lines = [
        json.dumps({"text": f"Document {i}. " + " ".join(r.choice(words) for _ in range(r.randrange(20, 400)))})
        for i in range(docs)
    ]
    text = ("\n".join(lines) + "\n").encode()
    (work / "in.jsonl").write_bytes(text)
    (work / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    return {"jsonl": work / "in.jsonl", "jsonl.zst": work / "in.jsonl.zst"}


def _prep_files(d: Path) -> dict[str, bytes]:
    """Every output file but the lock (the manifest included: its final form must match too)."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != ".lock"}


def _torn_shard_accepted(d: Path) -> str | None:
    """Right after a kill: a shard file a reader opens must be whole, and an incomplete directory is refused."""
    from data_prep.shards import ShardError, ShardReader, ShardSet

    for f in d.glob("*.bin"):
        if f.name.startswith("."):
            continue  # temp files and resume buffers: never read as shards
        try:
            ShardReader(f)
        except ShardError as e:
            return f"torn shard on disk: {e}"
    if (d / "manifest.json").is_file():
        try:
            ShardSet(d, "train")
            if not json.loads((d / "manifest.json").read_text())["complete"]:
                return "a reader accepted an incomplete directory"
        except ShardError:
            pass
    return None


def _writing(p: subprocess.Popen, out: Path) -> float:
    """Waits until prep-data p has written its first manifest (start-up is over); returns that moment."""
    while p.poll() is None and not (out / "manifest.json").is_file():
        time.sleep(0.002)
    return time.perf_counter()


def prep_trials(n: int, seed: int, work: Path, docs: int = 2000, shard_tokens: int = 20000) -> dict:
    """n kill trials of `tlf prep-data`: workers 0, 1, 2 in turn, jsonl and jsonl.zst in turn, killed inside a
    token-file write or right after one is whole (a seeded-random shard; an event of the run, never elapsed
    time); the rerun must end byte-identical."""
    work.mkdir(parents=True, exist_ok=True)
    inputs = _corpus(work, docs)

    def cmd(fmt, out, workers):
        return [
            sys.executable,
            "-c",
            PREP_CHILD,
            "prep-data",
            "--source",
            "files",
            "-i",
            str(inputs[fmt]),
            "--out",
            str(out),
            "--shard-tokens",
            str(shard_tokens),
            "--workers",
            str(workers),
            "--no-progress",
            "batch_bytes=4096",
        ]

    refs, ref_s = {}, {}
    for fmt in inputs:
        p = _popen(cmd(fmt, work / f"ref-{fmt}", 0))
        t0 = _writing(p, work / f"ref-{fmt}")
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        ref_s[fmt] = time.perf_counter() - t0  # from its first manifest to the end: the writing phase
        refs[fmt] = _prep_files(work / f"ref-{fmt}")
    n_files = sum(1 for f in refs["jsonl"] if f.endswith(".bin"))
    r = random.Random(seed)
    trials, divergences = [], 0
    for i in range(n):
        workers, fmt = i % 3, list(inputs)[i % 2]
        out = work / f"trial{i}"
        if (i // 2) % 2 == 0:
            k = r.randrange(n_files)
            how = f"inside token-file write {k}"
            p = _popen(cmd(fmt, out, workers), KILL_IN_SHARD=str(k))
            p.communicate(timeout=600)
        else:
            k = r.randrange(n_files)
            how = f"right after token-file write {k}"
            p = _popen(cmd(fmt, out, workers), KILL_AFTER_SHARD=str(k))
            p.communicate(timeout=600)
        killed = p.returncode == -signal.SIGKILL
        on_disk = sum(1 for f in out.glob("*.bin") if not f.name.startswith(".")) if out.exists() else 0
        torn = _torn_shard_accepted(out) if out.exists() else None
        rerun = _popen(cmd(fmt, out, workers))
        _, err = rerun.communicate(timeout=600)
        same = rerun.returncode == 0 and _prep_files(out) == refs[fmt]
        rec = {
            "trial": i,
            "workers": workers,
            "input": fmt,
            "kill": how,
            "killed": killed,
            "shards_at_kill": on_disk,
            "shards_total": n_files,
            "ok": same and not torn,
        }
        if torn:
            rec["torn"] = torn
        if rerun.returncode:
            rec["error"] = err[-500:]
        divergences += not rec["ok"]
        trials.append(rec)
        print(
            f"prep-data trial {i} (workers {workers}, {fmt}): killed {how} "
            f"({'killed' if killed else 'finished first'}) with {on_disk}/{n_files} shards on disk, rerun "
            f"{'identical' if rec['ok'] else 'DIVERGES'}" + (f" [{torn}]" if torn else ""),
            flush=True,
        )
    return {
        "stage": "prep-data",
        "trials": n,
        "killed": sum(t["killed"] for t in trials),
        "divergences": divergences,
        "reference_s": {k: round(v, 2) for k, v in ref_s.items()},
        "records": trials,
    }


# ------------------------------------------------------------------------------------------------ tlf eval
def _stable(path: Path) -> dict:
    """A results.json without what legitimately differs between two runs: timings, when it was written, and its own
    directory's name in the output file paths."""

    def drop(x):
        if isinstance(x, dict):
            return {k: drop(v) for k, v in x.items() if k not in ("timing_s", "wall_s", "load_s", "evaluated_at")}
        return [drop(v) for v in x] if isinstance(x, list) else x

    return drop(json.loads(path.read_text().replace(json.dumps(str(path.parent))[1:-1], "<out>")))


# eval with KILL_AT_UNIT=k: SIGKILL as the k-th unit of work starts (0-based, in run order: a task scored at a budget,
# or a perplexity set; k = the number of units: as results.json is about to be written); otherwise `tlf eval ARGS`
# unchanged. The last stdout line says how many units ran ("units N"), so a reference run tells the trials the range.
EVAL_CHILD = """
import os, signal, sys
import evaluation.evaluate as ev
from evaluation import results
from pipeline.cli import main
k, seen = int(os.environ.get("KILL_AT_UNIT", "-1")), [0]
def unit(real):
    def f(*a, **kw):
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        seen[0] += 1
        return real(*a, **kw)
    return f
ev.Scorer.score, ev.perplexity, results.write = unit(ev.Scorer.score), unit(ev.perplexity), unit(results.write)
try:
    main(sys.argv[1:], prog_name="tlf")
finally:
    print(f"units {seen[0] - 1}", flush=True)
"""


def eval_trials(n: int, seed: int, work: Path, tasks: str = "copa,sciq") -> dict:
    """n kill trials of `tlf eval` (a tiny perturbed model, offline tasks, perplexity): killed as a seeded-random
    unit of work starts (a task at a budget, a perplexity set, or the results.json write), so every trial is
    killed mid-run however fast the machine; results.json is absent or whole right after, and the rerun's equals
    the uninterrupted run's."""
    import torch

    from pipeline.config import load_config
    from pipeline.model.io import save_model
    from pipeline.model.looped import LoopedLM

    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config("tiny/t-loopformer")
    torch.manual_seed(0)
    model = LoopedLM(cfg.model)
    with torch.no_grad():
        for q in model.parameters():
            q.add_(torch.randn_like(q) * 0.05)
    save_model(work / "model", model, cfg)
    (work / "data").mkdir(exist_ok=True)
    write_shard(work / "data" / "d_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 2000))

    def cmd(out):
        return [
            sys.executable,
            "-c",
            EVAL_CHILD,
            "eval",
            str(work / "model"),
            f"data.dir={work / 'data'}",
            "data.extra_val_dirs=[]",
            "--loops",
            "2,4",
            "--tasks",
            tasks,
            "--limit",
            "4",
            "--source",
            "offline",
            "--no-latency",
            "--no-mlflow",
            "--ppl-tokens",
            "500",
            "--out",
            str(out),
        ]

    t0 = time.perf_counter()
    p = _popen(cmd(work / "ref"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    ref_s = time.perf_counter() - t0
    units = int(out.strip().splitlines()[-1].split()[1])  # the results.json write is unit number `units`
    ref = _stable(work / "ref" / "results.json")
    r = random.Random(seed)
    trials, divergences = [], 0
    for i in range(n):
        out = work / f"trial{i}"
        k = units if i == 0 else r.randrange(units)  # the first trial: at the results.json write
        how = "as results.json is written" if k == units else f"as unit {k + 1}/{units} starts"
        p = _popen(cmd(out), KILL_AT_UNIT=str(k))
        p.communicate(timeout=600)
        killed = p.returncode == -signal.SIGKILL
        torn, had = None, (out / "results.json").is_file()
        if had:
            try:
                json.loads((out / "results.json").read_text())
            except ValueError:
                torn = "a torn results.json"
        rerun = _popen(cmd(out))
        _, err = rerun.communicate(timeout=600)
        same = rerun.returncode == 0 and _stable(out / "results.json") == ref
        rec = {"trial": i, "kill": how, "killed": killed, "results_json_at_kill": had, "ok": same and not torn}
        if rerun.returncode:
            rec["error"] = err[-500:]
        divergences += not rec["ok"]
        trials.append(rec)
        print(
            f"eval trial {i}: killed {how} ({'killed' if killed else 'finished first'}), "
            f"rerun {'same results.json' if rec['ok'] else 'DIVERGES'}",
            flush=True,
        )
    return {
        "stage": "eval",
        "trials": n,
        "killed": sum(t["killed"] for t in trials),
        "divergences": divergences,
        "units": units,
        "reference_s": round(ref_s, 2),
        "records": trials,
    }


STAGES = {
    "prep": prep_trials,
    "train": train_trials,
    "train2": lambda n, seed, work: train_trials(n, seed, work, ranks=2),
    "eval": eval_trials,
    "resize": resize_trials,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stages", default="prep,train,train2,eval,resize", help=f"comma-separated, of {', '.join(STAGES)}"
    )
    ap.add_argument("--out", default="bench/results/faults.json")
    a = ap.parse_args()
    results = []
    for name in a.stages.split(","):
        if name not in STAGES:
            ap.error(f"--stages: unknown stage {name!r} (choose from {', '.join(STAGES)})")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            res = STAGES[name](a.trials, a.seed, Path(tmp))
            res["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(res)
    print("\nstage | trials | killed mid-run | divergences | wall s")
    for res in results:
        print(f"{res['stage']} | {res['trials']} | {res['killed']} | {res['divergences']} | {res['wall_s']}")
    write_json(a.out, {"seed": a.seed, "stages": results})
    sys.exit(1 if any(res["divergences"] for res in results) else 0)


if __name__ == "__main__":
    main()
