"""The checks of `tlf generate`, `tlf eval` and `tlf ablate` options that need the checkpoint: its stored config is
read (not its weights) and `--loops` held against its training L, so a bad budget is a one-line usage error
before any model loads."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import click

from data_prep.configlib import read_yaml_mapping
from pipeline.config import Config, apply_overrides, config_from_dict
from pipeline.hf.load import is_hf_export, model_dir


def stored_config(path: str | Path, overrides=(), quiet: bool = False) -> tuple[Path, Config]:
    """(model directory, its config with `overrides`) of anything `pipeline.hf.load.load_any` reads, without the
    weights; quiet: without the warnings about damaged checkpoints a run dir may give (the load that follows
    gives them)."""
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        d = model_dir(path)
    if is_hf_export(d):  # tlf's transformers export: the config rides in config.json (as load_any reads it)
        conf = json.loads((d / "config.json").read_text())
        cfg = config_from_dict(conf.get("tlf_config") or {"model": conf.get("tlf_model", {})}, str(d / "config.json"))
    else:
        cfg = config_from_dict(read_yaml_mapping(d / "config.yaml"), source=str(d / "config.yaml"))
    apply_overrides(cfg, list(overrides))
    return d, cfg


def check_loops(budgets, cfg: Config, option: str = "--loops") -> None:
    """A usage error naming `option` unless every loop budget lies in 1..L (the checkpoint's model.loops)."""
    L = cfg.model.loops
    for m in budgets or ():
        if not 1 <= m <= L:
            raise click.BadParameter(
                f"loop budget {m} exceeds the checkpoint's training loops model.loops={L}; use 1..{L}",
                param_hint=f"'{option}'",
            )
