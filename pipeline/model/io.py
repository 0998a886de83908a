"""Model export: the consolidated weights + resolved config that generation and evaluation load.

An export is a directory holding `config.yaml` (the whole resolved Config) and `model.pt` (a plain,
single-device state dict in fp32). Training writes one beside each checkpoint (`<ckpt>/model/`), so
`tlf generate` and `tlf eval` never need DeepSpeed. Files are written atomically.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch
import yaml

from data_prep.shards import atomic_write_bytes
from pipeline.config import Config, ConfigError, apply_overrides, config_from_dict, to_yaml
from pipeline.model.looped import LoopedLM


def save_model(directory: str | os.PathLike, model: LoopedLM, cfg: Config) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(d / "model.pt", [buf.getvalue()])
    atomic_write_bytes(d / "config.yaml", [to_yaml(cfg).encode()])
    return d


def find_export(path: str | os.PathLike) -> Path:
    """Accepts an export dir, a checkpoint dir containing `model/`, or a run dir with `latest` checkpoint."""
    p = Path(path)
    for cand in (p, p / "model"):
        if (cand / "model.pt").is_file() and (cand / "config.yaml").is_file():
            return cand
    latest = p / "latest"
    if latest.is_file():
        return find_export(p / latest.read_text().strip())
    raise FileNotFoundError(f"{p}: no model export (expected model.pt and config.yaml, or a checkpoint dir with model/)")


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", overrides: list[str] = ()) -> tuple[LoopedLM, Config]:
    d = find_export(path)
    raw = yaml.safe_load((d / "config.yaml").read_text())
    cfg = config_from_dict(raw, source=str(d / "config.yaml"))
    apply_overrides(cfg, overrides)
    model = LoopedLM(cfg.model)
    state = torch.load(d / "model.pt", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.model.tie_embeddings]
    if missing or unexpected:
        raise ConfigError(f"{d}: weights do not match its config.yaml (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return model.to(device).eval(), cfg
