"""The run directory (`checkpoint.dir`, default `checkpoints/<config name with / replaced by ->`) as training
leaves it, read by the resume and by whatever loads a trained model (`tlf eval RUN_DIR`, `tlf generate`): which
checkpoints in it are complete, and which of those are intact.

    latest                      # names the newest complete checkpoint; a hint only
    metrics.jsonl, tracking.json  # the run's metrics and its MLflow run (pipeline/tracking.py)
    global_step{N}/             # one checkpoint (pipeline/train/checkpoint.py writes it)
        files.json              # every file's size and sha256 (hashed as it was written), written before the rename
        rank{r}_state.pt        # rank r's training state
        model/                  # the model export (pipeline/model/io.py)

A checkpoint is complete once its dir bears its final name (`global_step{N}` holding rank0_state.pt), and intact
when every file files.json lists has the size and sha256 it was written with (`damage`; sizes only when `deep` is
false; a checkpoint written before files.json held checksums: sizes; before files.json existed: `legacy_damage`).
`newest_intact` is what readers take, not what `latest` names: a kill between the two renames leaves `latest` one
behind (said in a warning, `lagging_latest`), and a truncated, altered or missing file makes them fall back to the
previous checkpoint with a warning naming both.

A start never overwrites another run: `lost_by_start` says what of a run directory a run starting from a given
checkpoint would replace (another run's checkpoints, metrics or MLflow run; this run's checkpoints past the start),
and `move_aside` moves a whole run directory to a sibling `<dir>.replaced-<UTC time>` (`tlf train --overwrite`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import torch

from data_prep.files import write_json
from pipeline.config import Config
from pipeline.tracking import METRICS_FILE, RUN_FILE

STEP_DIR = re.compile(r"^global_step(\d+)$")


def run_dir(cfg: Config) -> Path:
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path("checkpoints") / (cfg.name or cfg.model.variant).replace("/", "-")


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """[(step, dir)] of the complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "rank0_state.pt").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


FILES = "files.json"  # {relative path: {"size": bytes, "sha256": hex}} of every file of a checkpoint (rank 0, before the rename)
CHUNK = 1 << 22  # bytes read at a time when hashing


def sha256_file(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_files(ck: Path, digests: dict[str, str]) -> None:
    """Writes ck/files.json listing every file of checkpoint dir ck (all ranks have written theirs) with its size
    and sha256: `digests` ({relative path: hex}) holds those hashed as they were written; a file missing from it (a
    small one DeepSpeed copies in) is hashed here."""
    rec = {}
    for f in sorted(ck.rglob("*")):
        if f.is_file():
            rel = str(f.relative_to(ck))
            rec[rel] = {"size": f.stat().st_size, "sha256": digests.get(rel) or sha256_file(f)}
    write_json(ck / FILES, rec, indent=0)


def damage(ck: Path, deep: bool = True, only: str = "") -> str | None:
    """Why checkpoint dir ck cannot be used (a file it was written with is missing, has another size or, when
    `deep`, another sha256), or None. `only`: hash just the files under that relative prefix (sizes are always
    checked for all). A checkpoint written before files.json existed: `legacy_damage`."""
    try:
        rec = json.loads((ck / FILES).read_text())
    except FileNotFoundError:
        return legacy_damage(ck)
    except (OSError, ValueError) as e:
        return f"{FILES} unreadable: {e}"
    if not isinstance(rec, dict):
        return f"{FILES} is not an object"
    for name, want in rec.items():
        size, digest = (want, None) if isinstance(want, int) else (want.get("size"), want.get("sha256"))
        f = ck / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
        if deep and digest and name.startswith(only) and sha256_file(f) != digest:
            return f"{name} differs from what was written (sha256 mismatch)"
    return None


def legacy_damage(ck: Path) -> str | None:
    """Why checkpoint dir ck without files.json cannot be resumed from, or None: a file the resume needs is missing
    (each rank's state file, DeepSpeed's model states and, under ZeRO 1-3, each rank's optimizer partition; ZeRO-3
    also each rank's model partition), or a .pt / .safetensors file is cut short (its zip directory or header
    does not fit its size). Reads only rank0_state.pt and each file's directory or header."""
    for f in sorted(ck.rglob("*.pt")) + sorted(ck.rglob("*.safetensors")):
        why = _cut_short(f)
        if why:
            return f"{f.relative_to(ck)} {why}"
    try:
        st = torch.load(ck / "rank0_state.pt", map_location="cpu", weights_only=True)
        ws, stage = int(st["world_size"]), int(st["config"]["train"].get("zero_stage", 0))
    except Exception as e:  # noqa: BLE001 - a foreign or tampered state file: name it
        return f"rank0_state.pt unreadable ({type(e).__name__})"
    need = [f"rank{r}_state.pt" for r in range(ws)] + ["mp_rank_00_model_states.pt"]
    if stage >= 1:
        need += [
            f"{'bf16_' if (ck / 'bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt').is_file() else ''}"
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            for r in range(ws)
        ]
    if stage == 3:
        need = [n for n in need if n != "mp_rank_00_model_states.pt"]
        need += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ws)]
    missing = [n for n in need if not (ck / n).is_file()]
    return f"{missing[0]} is missing" if missing else None


def _cut_short(f: Path) -> str | None:
    """Why file f (torch's zip format or safetensors) is incomplete, or None; a cheap look at its end or header."""
    import struct
    import zipfile

    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if f.suffix == ".safetensors":
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                meta = json.loads(fh.read(n)) if 0 < n < size else None
                if not isinstance(meta, dict):
                    return f"is cut short ({size} bytes, no complete header)"
                end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
                return None if 8 + n + end == size else f"is cut short ({size} bytes, {8 + n + end} expected)"
        if not head.startswith(b"PK"):
            return f"is cut short ({size} bytes)" if size == 0 else None  # torch's old pickle format: not checked
        with zipfile.ZipFile(f):
            return None
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, zipfile.BadZipFile) as e:
        return f"is cut short or unreadable ({type(e).__name__})"


def newest_intact(root: Path, warn=None, deep: bool = True, only: str = "") -> Path | None:
    """The newest complete checkpoint under root whose files are all there as written (`damage`, with `deep` and
    `only`), or None; each newer damaged one is reported through warn (a callable taking one line) naming it and the
    one chosen instead, and so is a `latest` that names another checkpoint (`lagging_latest`)."""
    done = [p for _, p in complete_checkpoints(root)]
    for i in range(len(done) - 1, -1, -1):
        why = damage(done[i], deep, only)
        if why is None:
            if warn is not None and (note := lagging_latest(root, done, i)):
                warn(note)
            return done[i]
        if warn is not None:
            warn(
                f"checkpoint {done[i]} is damaged ({why}); "
                + (f"falling back to {done[i - 1]}" if i else "no earlier complete checkpoint to fall back to")
            )
    return None


def lagging_latest(root: Path, done: list[Path], i: int) -> str | None:
    """Why root/latest, a hint written after each save, is passed over for done[i] (of root's complete checkpoints,
    oldest first; those after it are damaged), or None when it names done[i] (or is absent, or names a damaged
    checkpoint: that warning was given)."""
    chosen = done[i]
    try:
        named = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if named == chosen.name or root / named in done[i + 1 :]:
        return None
    why = (
        "a save was cut off before it updated latest"
        if root / named in done[:i]
        else "no complete checkpoint of that name"
    )
    return f"{root / 'latest'} names {named[:80]!r}; using {chosen}, the newest intact checkpoint ({why})"


def own_checkpoint(root: Path, ck: Path | None) -> bool:
    """Whether checkpoint dir ck is one of run directory root's own."""
    return ck is not None and ck.parent.resolve() == Path(root).resolve()


def lost_by_start(root: Path, start: Path | None, auto: bool) -> str | None:
    """What of run directory `root` a run starting from checkpoint dir `start` (None: from step 0) would replace,
    as one phrase, or None when nothing: from one of root's own checkpoints, the intact checkpoints past it (their
    steps would be written again; under checkpoint.resume=`auto` there are none, `start` being the newest intact);
    from anything else, every complete checkpoint, the metrics and the MLflow run of the run that is there. Under
    `auto` a root without a complete checkpoint is the same run started again after a kill before its first save,
    and its metrics are redone."""
    done = complete_checkpoints(root)
    if own_checkpoint(root, start):
        if auto:  # (the checkpoints past it were found damaged as it was chosen: not hashed again)
            return None
        at = int(STEP_DIR.match(start.name).group(1))
        later = [p.name for s, p in done if s > at and damage(p) is None]
        return f"checkpoints past {start.name} ({', '.join(later)})" if later else None
    if auto and start is None and not done:
        return None
    held = [p.name for _, p in done]
    metrics = root / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        held.append(METRICS_FILE)
    if (root / RUN_FILE).is_file():
        held.append(f"{RUN_FILE} (its MLflow run)")
    return f"another run ({', '.join(held)})" if held else None


def free_name(p: Path) -> Path:
    """p, or p-1, p-2, ...: the first of them nothing has taken."""
    out, n = p, 1
    while out.exists():
        out, n = p.with_name(f"{p.name}-{n}"), n + 1
    return out


def move_aside(root: Path) -> Path:
    """Moves run directory root to a new sibling `<name>.replaced-<UTC time>` (never over anything) and returns
    it; root is then free for a new run."""
    aside = free_name(root.with_name(f"{root.name}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))
    os.rename(root, aside)
    return aside
