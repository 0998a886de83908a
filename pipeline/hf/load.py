"""tlf's own transformers export (`tlf export --format hf`) read back as a LoopedLM, so `tlf generate` and
`tlf eval` take that directory as they take a tlf export, a checkpoint or a run dir (`load_any`).

The directory's config.json holds the network (`tlf_model`) and, from exports that carry it, the whole resolved
config (`tlf_config`: data.dir, eval settings, the preset name); model.safetensors holds the weights under
`model.` (the tied LM head once, as the embedding).
"""

from __future__ import annotations

import os
from pathlib import Path

from data_prep.files import FileFormatError, read_json
from pipeline.config import Config, apply_overrides, config_from_dict
from pipeline.model.io import find_export, load_model, load_state, model_from_state
from pipeline.model.looped import LoopedLM

MODEL_TYPE = "tlf_looped"  # config.json's model_type of tlf's transformers export


def is_hf_export(path: str | os.PathLike) -> bool:
    """Whether path is a directory written by `tlf export --format hf` (config.json naming MODEL_TYPE). A config.json
    that is there but not UTF-8 or not JSON is a FileFormatError naming it (it cannot tell what the directory is)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    conf = read_json(f)
    return isinstance(conf, dict) and conf.get("model_type") == MODEL_TYPE


def hf_stored_config(d: Path) -> dict:
    """The config an export of `tlf export --format hf` carries in its config.json: the whole resolved config
    (`tlf_config`) or, from exports without it, the network (`tlf_model`); another shape is a FileFormatError."""
    f = Path(d) / "config.json"
    conf = read_json(f, dict)
    stored = conf.get("tlf_config") or {"model": conf.get("tlf_model", {})}
    if not isinstance(stored, dict) or not isinstance(stored.get("model", {}), dict):
        raise FileFormatError(f"{f}: tlf_config and tlf_model must be JSON objects")
    return stored


def model_dir(path: str | os.PathLike) -> Path:
    """The directory a model loads from: tlf's transformers export itself, else `find_export`'s (an export dir,
    a checkpoint dir holding model/, or a run dir's newest intact checkpoint)."""
    return Path(path) if is_hf_export(path) else find_export(path)


def load_any(path: str | os.PathLike, device="cpu", overrides: list[str] | tuple = ()) -> tuple[LoopedLM, Config]:
    """(model in eval mode on device, its Config) of anything `model_dir` accepts; overrides as load_model's."""
    if not is_hf_export(path):
        return load_model(path, device, list(overrides))
    d = Path(path)
    cfg = config_from_dict(hf_stored_config(d), source=str(d / "config.json"))
    cfg.name = cfg.name or d.name
    apply_overrides(cfg, list(overrides))
    f = d / "model.safetensors"
    state = {k.removeprefix("model."): v for k, v in load_state(f).items()}
    return model_from_state(cfg, state, f, "config.json", device), cfg
