"""Checkpoints: DeepSpeed's files + one state file per rank + the consolidated model export, complete or invisible.

One checkpoint is a directory `global_step{N}/` of the run directory (pipeline/rundir.py: its layout, and which
checkpoints in it are complete and intact):

    global_step{N}/             # DeepSpeed's model/optimizer/scheduler files (engine.save_checkpoint), and
        files.json              # every file's size and sha256, hashed as written; rank 0 writes it before the rename
        rank{r}_state.pt        # this rank's step, data position, RNG states (python, numpy, torch, cuda), config
        model/                  # pipeline.model.io export (model.safetensors + config.yaml): what generate/eval load

A checkpoint is written under `.tmp-global_step{N}/` and renamed to `global_step{N}/` by rank 0 only after every
rank has written its files, then `latest` is replaced; so a kill or a full disk during a save leaves only a
hidden temp dir (removed by the next save) and the previous checkpoint stays the newest complete one. Before a
save, the free space is checked against the size of the previous checkpoint (or an estimate from the parameter
count); too little is an error before anything is written. Old checkpoints beyond `checkpoint.keep_last` are
renamed to `.trash-*` and then removed; a `.latest.tmp*` left by a kill between the renames is removed by the next
save; a damaged checkpoint of the step being saved (one the resume passed over) is renamed
`global_step{N}.damaged`, never overwritten. DeepSpeed's `client_state` comes back from rank 0's file only under ZeRO 0-2 (docs/design.md §6), which is
why each rank's own state lives in its own file. Resuming from one: pipeline/train/resume.py.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.files import UnwritableError, atomic_write_bytes, check_writable, write_json
from pipeline.config import Config, ConfigError
from pipeline.rundir import complete_checkpoints, free_name, newest_intact, record_files


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path and what is intact."""


def ensure_dir(root: Path) -> None:
    """Creates the checkpoint root (a no-op when it exists); a CheckpointError naming it when it cannot be written
    (data_prep.files.check_writable). `tlf train` calls it before training, so a bad checkpoint.dir fails at once,
    not at the first save."""
    try:
        check_writable(root, "checkpoint.dir", make=True)
    except UnwritableError as e:
        raise CheckpointError(str(e)) from None


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """Every RNG's state as tensors and plain Python types, so the state file loads with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(s: dict) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in s["python"]))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), int(pos), int(has_gauss), float(gauss))
    )
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ------------------------------------------------------------------------------------------- saving
def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _estimate_bytes(root: Path, model) -> int:
    done = complete_checkpoints(root)
    if done:
        return _dir_bytes(done[-1][1])
    n = sum(p.numel() for p in model.parameters())  # under ZeRO-3 local shards; an estimate only
    return n * 24  # weights + fp32 master + two Adam moments + fp32 export


def _collective_any(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return bool(t.item() > 0)


def _remove_tree(p: Path) -> None:
    """Hides p first (rename to .trash-*) so a half-removed dir never looks like a checkpoint."""
    if not p.exists():
        return
    trash = p.with_name(f".trash-{p.name.lstrip('.')}-{os.getpid()}")
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


RUN_RECORD = "run.json"


def write_run_record(directory: Path, cfg: Config, run_id: str | None, step: int) -> None:
    """run.json beside an export: the training run's MLflow id, tracking URI and step, as plain JSON (evaluation
    reads it instead of the trainer's state file)."""
    from pipeline.tracking import tracking_uri

    rec = {"mlflow_run_id": run_id, "tracking_uri": tracking_uri(cfg.logging.tracking_uri), "step": int(step)}
    write_json(directory / RUN_RECORD, rec, indent=1)


@dataclass(frozen=True)
class RunRecord:
    """run.json beside a model export (`write_run_record`): the training run it came from."""

    mlflow_run_id: str | None
    tracking_uri: str
    step: int


def read_run_record(export_dir: Path) -> RunRecord | None:
    """The export's run.json, or None when the export has none (saved outside training) or it is not JSON; a
    field of the wrong type is a ConfigError naming the file and key."""
    try:
        meta = json.loads((Path(export_dir) / RUN_RECORD).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    f = Path(export_dir) / RUN_RECORD
    if not isinstance(meta, dict):
        raise ConfigError(f"{f}: must be a JSON object, not {type(meta).__name__}")
    for key, kinds in (("mlflow_run_id", (str, type(None))), ("tracking_uri", (str, type(None))), ("step", (int,))):
        v = meta.get(key, 0 if key == "step" else None)
        if not isinstance(v, kinds) or isinstance(v, bool):
            want = "an integer" if key == "step" else "a string or null"
            raise ConfigError(f"{f}: key '{key}' must be {want}, got {v!r}"[:300])
    return RunRecord(meta.get("mlflow_run_id") or None, meta.get("tracking_uri") or "", meta.get("step", 0))


def export_model(engine, model, cfg: Config, directory: Path, rank: int, digests: dict | None = None) -> None:
    """pipeline.model.io.save_model of the full weights (gathered first under ZeRO-3); every rank calls it.
    digests: filled (rank 0) with {file name: sha256} of the files written."""
    from pipeline.model.io import save_model

    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if rank == 0:
                save_model(directory, model, cfg, digests=digests)
    elif rank == 0:
        save_model(directory, model, cfg, digests=digests)


class _Hashing:
    """A binary file that hashes what is written to it (torch.save writes its zip sequentially)."""

    def __init__(self, fh) -> None:
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, b) -> int:
        self.sha.update(b)
        return self.fh.write(b)

    def flush(self) -> None:
        self.fh.flush()


@contextlib.contextmanager
def hashed_saves(engine, digests: dict[str, str]):
    """While open, DeepSpeed's torch checkpoint engine writes each file through `_Hashing`, recording {path:
    sha256} in digests, so files.json's checksums cost no second read. Another checkpoint engine (Nebula, the
    decoupled one) writes as it does; `rundir.record_files` then hashes its files after the write."""
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or type(ce).__name__ != "TorchCheckpointEngine":
        yield
        return
    zipped = getattr(ce, "zipfile_serialization", True)

    def save(state_dict, path):
        with open(path, "wb") as fh:
            w = _Hashing(fh)
            torch.save(state_dict, w, _use_new_zipfile_serialization=zipped)
        digests[str(path)] = w.sha.hexdigest()

    ce.save = save  # an instance attribute over the class's method
    try:
        yield
    finally:
        del ce.save


def save(engine, model, cfg: Config, root: Path, step: int, state: dict, rank: int) -> Path:
    """Writes checkpoint global_step{step} (every rank calls this); returns its dir."""
    tag = f"global_step{step}"
    final, tmp = root / tag, root / f".tmp-{tag}"
    prev = newest_intact(root, deep=False)  # for the messages below: sizes only
    prev_msg = f"previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
    if rank == 0:
        ensure_dir(root)
        for stale in root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.glob(".trash-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.glob(".latest.tmp*"):  # a kill during the `latest` rename
            stale.unlink(missing_ok=True)
        need = int(_estimate_bytes(root, model) * 1.1)
        free = shutil.disk_usage(root).free
        short = free < need
    else:
        short = False
    if _collective_any(short):
        raise CheckpointError(
            f"not saving {final}: about {need / 2**20:.1f} MiB needed but only {free / 2**20:.1f} MiB "
            f"free on {root}; {prev_msg}"
            if rank == 0
            else f"not saving {final}: rank 0 found too little free disk space; {prev_msg}"
        )
    written: dict[str, str] = {}  # {path: sha256} of the files this rank writes, hashed as they are written
    try:
        with hashed_saves(engine, written):
            engine.save_checkpoint(str(root), tag=tmp.name, client_state={"step": step}, save_latest=False)
        buf = io.BytesIO()
        torch.save(state, buf)
        written[str(tmp / f"rank{rank}_state.pt")] = atomic_write_bytes(tmp / f"rank{rank}_state.pt", [buf.getvalue()])
        exported: dict[str, str] = {}
        export_model(engine, model, cfg, tmp / "model", rank, exported)
        written.update({str(tmp / "model" / k): v for k, v in exported.items()})
        if rank == 0:
            write_run_record(tmp / "model", cfg, state.get("mlflow_run_id"), step)
    except (OSError, RuntimeError) as e:  # torch.save inside DeepSpeed reports a full disk as a RuntimeError
        # No collective here: a peer may be inside DeepSpeed's own barrier. Single process: clean up and
        # report; under a launcher this rank exits non-zero and the launcher stops the others.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving {final} failed on rank {rank}: {_one_line(e, root)}; {prev_msg}") from e
    digests = _gather_digests(written, tmp)
    if rank == 0:
        record_files(tmp, digests)
        if final.exists():  # a damaged checkpoint of this step that the resume passed over: kept, renamed
            os.replace(final, free_name(root / f"{tag}.damaged"))
        os.replace(tmp, final)
        _fsync_dir(root)
        atomic_write_bytes(root / "latest", [tag.encode()])
        for _, old in complete_checkpoints(root)[: -cfg.checkpoint.keep_last]:
            _remove_tree(old)
    torch.distributed.barrier()
    return final


def _gather_digests(written: dict[str, str], tmp: Path) -> dict[str, str]:
    """Every rank's {path: sha256} as {path relative to tmp: sha256} on rank 0 (a barrier: all have written)."""
    mine = {str(Path(k).relative_to(tmp)): v for k, v in written.items() if Path(k).is_relative_to(tmp)}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


# How a failed write shows up: OSError ENOSPC / EDQUOT (our writers, torch's legacy format), or a RuntimeError of
# torch's zip writer (DeepSpeed's own save): "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs
# 598" (torch 2.13 on a full disk), "basic_ios::clear: iostream error" (a small file), "PytorchStreamWriter failed
# writing file data/0: file write failed" (older torch).
WRITE_FAILED = ("unexpected pos", "iostream error", "file write failed", "No space left on device")


def _one_line(e: BaseException, where: Path) -> str:
    """An exception as one line (torch's writer errors span several lines); a failed write gets the free space on
    `where`, the checkpoint dir."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    msg = next((ln for ln in lines if "failed" in ln.lower()), lines[0])
    full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    if full or (isinstance(e, RuntimeError) and any(m in str(e) for m in WRITE_FAILED)):
        try:
            msg += f" (disk full? {shutil.disk_usage(where).free / 2**20:.1f} MiB free on {where})"
        except OSError:
            pass
    return msg


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------ loading
def read_state(path: Path, rank: int, world_size: int | None) -> dict:
    """This rank's state dict of checkpoint dir `path` (step, data position, RNG states, config, MLflow run);
    world_size None: whatever world size wrote it."""
    f = path / f"rank{rank}_state.pt"
    if not f.is_file():
        have = sorted(p.name for p in path.glob("rank*_state.pt"))
        raise CheckpointError(
            f"{path}: no {f.name} (it holds {', '.join(have) or 'no rank files'}); "
            f"resume with the world size that wrote it"
        )
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)  # never unpickles arbitrary objects
    except Exception as e:  # truncated, foreign or tampered file: name it
        raise CheckpointError(
            f"{f}: not a readable training state ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); resume from another checkpoint "
            f"or set checkpoint.resume=none"
        ) from e
    if world_size is not None and state["world_size"] != world_size:
        raise CheckpointError(f"{path} was written by {state['world_size']} ranks; this run has {world_size}")
    return state


def load_engine(engine, path: Path) -> None:
    """Restores DeepSpeed's module, optimizer, scheduler and step counters from checkpoint dir `path`."""
    loaded, _ = engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise CheckpointError(f"{path}: DeepSpeed could not load this checkpoint")
