"""Exports are readable by others as any file the user writes: every file of `tlf export --format hf` (and of a
plain export) gets the mode the umask gives (0644 under 022), model.safetensors included."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from helpers import perturbed_tiny
from pipeline.cli import main
from pipeline.model.io import save_model


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_export_files_follow_the_umask(tmp_path, umask, mode):
    m, cfg = perturbed_tiny()
    save_model(tmp_path / "src", m, cfg)
    old = os.umask(umask)
    try:
        for fmt in ("hf", "safetensors"):
            r = CliRunner().invoke(
                main, ["export", str(tmp_path / "src"), "--out", str(tmp_path / fmt), "--format", fmt]
            )
            assert r.exit_code == 0, r.output
    finally:
        os.umask(old)
    files = [p for fmt in ("hf", "safetensors") for p in (tmp_path / fmt).iterdir()]
    assert any(p.name == "model.safetensors" for p in files) and len(files) > 5
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(mode) for p in files}
