"""Model export: the consolidated weights + resolved config that generation and evaluation load.

An export is a directory holding `config.yaml` (the whole resolved Config) and `model.safetensors` (a plain,
single-device fp32 state dict; the tied `lm_head.weight` is not stored twice). Training writes one beside
each checkpoint (`<ckpt>/model/`), so `tlf generate` and `tlf eval` never need DeepSpeed. Files are written
atomically. Without the `safetensors` package (`pip install tlf[hf]`) the weights go to `model.pt` instead;
exports holding `model.pt` (older runs) still load, through `torch.load(weights_only=True)`: loading never
unpickles arbitrary objects.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import torch

from data_prep.configlib import read_yaml_mapping
from data_prep.files import atomic_write_bytes, read_text
from pipeline.config import Config, ConfigError, apply_overrides, config_from_dict, to_yaml
from pipeline.model.looped import LoopedLM
from pipeline.rundir import newest_intact

WEIGHT_FILES = ("model.safetensors", "model.pt")  # in order of preference when loading


def have_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401  (only whether it imports)
    except ModuleNotFoundError:
        return False
    return True


def state_for_export(model: LoopedLM) -> dict[str, torch.Tensor]:
    """fp32 CPU copies of the weights, contiguous and unshared (the tied lm_head is left out)."""
    skip = {"lm_head.weight"}  # tied to wte
    return {k: v.detach().float().cpu().contiguous().clone() for k, v in model.state_dict().items() if k not in skip}


def save_model(
    directory: str | os.PathLike, model: LoopedLM, cfg: Config, fmt: str | None = None, digests: dict | None = None
) -> Path:
    """fmt: "safetensors" (the default when the package is installed) or "pt". digests: filled with {file name:
    sha256} of the files written, hashed as they are written (a checkpoint's files.json)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fmt = fmt or ("safetensors" if have_safetensors() else "pt")
    state = state_for_export(model)
    if fmt == "safetensors":
        from safetensors.torch import save as st_save

        data = st_save(state, metadata={"format": "pt"})
    else:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
    written = {f"model.{fmt}": atomic_write_bytes(d / f"model.{fmt}", [data])}
    for other in WEIGHT_FILES:  # a re-export in the other format must not leave stale weights preferred
        if other != f"model.{fmt}" and (d / other).exists():
            (d / other).unlink()
    written["config.yaml"] = atomic_write_bytes(d / "config.yaml", [to_yaml(cfg).encode()])
    if digests is not None:
        digests.update(written)
    return d


def weights_file(d: Path) -> Path | None:
    return next((d / w for w in WEIGHT_FILES if (d / w).is_file()), None)


def find_export(path: str | os.PathLike) -> Path:
    """Accepts an export dir, a checkpoint dir containing `model/`, or a run dir: its newest intact checkpoint
    (pipeline.rundir.newest_intact: every file's size, the export's checksums; a damaged newer one is passed over
    with a warning), which `latest` names unless a
    kill hit between a checkpoint's rename and `latest`'s."""
    p = Path(path)
    for cand in (p, p / "model"):
        if weights_file(cand) and (cand / "config.yaml").is_file():
            return cand
    # sizes of every file, checksums of the export's (the files read here)
    ck = newest_intact(p, lambda m: print(f"[tlf] warning: {m}", file=sys.stderr, flush=True), only="model/")
    if ck is not None and weights_file(ck / "model"):
        return ck / "model"
    latest = p / "latest"
    if latest.is_file():
        return find_export(p / read_text(latest).strip())  # not UTF-8: a FileFormatError naming it
    raise FileNotFoundError(
        f"{p}: no model export (expected model.safetensors or model.pt, and config.yaml, "
        f"or a checkpoint dir with model/)"
    )


def load_state(f: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file; a clear one-line ConfigError naming the file when it is unreadable."""
    try:
        if f.suffix == ".safetensors":
            if not have_safetensors():
                raise ConfigError(f"{f}: reading safetensors weights needs the package (pip install tlf[hf])")
            from safetensors.torch import load_file

            return load_file(str(f), device="cpu")
        return torch.load(f, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated/corrupt file, or a pickle holding more than tensors
        first = (str(e).strip().splitlines() or [""])[0][:200]  # an empty file's error has no message
        raise ConfigError(f"{f}: unreadable weights ({type(e).__name__}{': ' + first if first else ''})") from None


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu", overrides: list[str] = ()
) -> tuple[LoopedLM, Config]:
    d = find_export(path)
    raw = read_yaml_mapping(d / "config.yaml")  # bad YAML or another shape: a ConfigError naming the file
    cfg = config_from_dict(raw, source=str(d / "config.yaml"))
    apply_overrides(cfg, overrides)
    f = weights_file(d)
    return model_from_state(cfg, load_state(f), f, "config.yaml", device), cfg


def model_from_state(
    cfg: Config, state: dict[str, torch.Tensor], f: Path, config_name: str, device: str | torch.device = "cpu"
) -> LoopedLM:
    """cfg's network holding `state` (read from weights file f, described by its `config_name`), in eval mode on
    device; weights of another shape or names, or NaN/inf in them, are a ConfigError naming f."""
    model = LoopedLM(cfg.model)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config gives
        why = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise ConfigError(f"{f}: weights do not match its {config_name} ({why.rstrip('.')})") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(
            f"{f}: {len(bad)} of {len(state)} weight tensors hold NaN or inf (first: {bad[0]}); the "
            "run diverged or the file is corrupt: use an earlier checkpoint"
        )
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise ConfigError(
            f"{f}: weights do not match its {config_name} (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return model.to(device).eval()
