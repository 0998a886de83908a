"""Model exports: safetensors by default, legacy model.pt still loads, `tlf export` round-trips every tiny preset
bit-exactly, and no load path unpickles arbitrary objects."""

import pytest
import torch
from click.testing import CliRunner
from helpers import perturbed_tiny

from pipeline.cli import main
from pipeline.config import ConfigError, list_presets
from pipeline.model.io import find_export, load_model, save_model

torch.set_num_threads(1)
TINY = sorted(p for p in list_presets() if p.startswith("tiny/"))


def _logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("name", TINY)
def test_safetensors_is_default_and_export_cli_round_trips(tmp_path, name):
    model, cfg = perturbed_tiny(name)
    src = save_model(tmp_path / "src", model, cfg)
    assert sorted(p.name for p in src.iterdir()) == ["config.yaml", "model.safetensors"]
    res = CliRunner().invoke(main, ["export", str(src), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    loaded, cfg2 = load_model(tmp_path / "out")
    assert cfg2.model == cfg.model
    idx = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, idx), _logits(loaded, idx))
    assert loaded.lm_head.weight.data_ptr() == loaded.wte.weight.data_ptr()  # tied: stored once, tied after loading


def test_legacy_model_pt_loads_and_converts(tmp_path):
    model, cfg = perturbed_tiny()
    old = tmp_path / "old"
    old.mkdir()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, old / "model.pt")  # an export of older runs
    save_model(tmp_path / "tmp", model, cfg)
    (old / "config.yaml").write_bytes((tmp_path / "tmp" / "config.yaml").read_bytes())
    idx = torch.arange(12).view(1, 12)
    assert torch.equal(_logits(load_model(old)[0], idx), _logits(model, idx))
    res = CliRunner().invoke(main, ["export", str(old), "--out", str(tmp_path / "new")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "new" / "model.safetensors").is_file() and not (tmp_path / "new" / "model.pt").exists()
    assert torch.equal(_logits(load_model(tmp_path / "new")[0], idx), _logits(model, idx))
    res = CliRunner().invoke(main, ["export", str(tmp_path / "new"), "--out", str(tmp_path / "new"), "--format", "pt"])
    assert res.exit_code != 0 and "source export itself" in res.output


class _Boom:
    def __reduce__(self):
        return (print, ("side effect",))


def test_loading_never_unpickles_objects_and_bad_files_are_one_line_errors(tmp_path):
    model, cfg = perturbed_tiny()
    d = save_model(tmp_path / "e", model, cfg, fmt="pt")
    torch.save({"wte.weight": _Boom()}, d / "model.pt")  # a pickle that would call print() when unpickled
    with pytest.raises(ConfigError, match=r"model\.pt: unreadable weights"):
        load_model(d)
    d = save_model(tmp_path / "s", model, cfg)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(ConfigError, match=r"model\.safetensors: unreadable weights"):
        load_model(d)
    res = CliRunner().invoke(main, ["export", str(d), "--out", str(tmp_path / "x")])
    assert (
        res.exit_code == 2 and "model.safetensors: unreadable weights" in res.output and "Traceback" not in res.output
    )
    with pytest.raises(FileNotFoundError, match="model.safetensors or model.pt"):
        find_export(tmp_path)


KILLED_EXPORT = """
import os, signal, sys
from data_prep import files
from pipeline.cli import main
real = files.atomic_write_bytes
def write(path, chunks):  # SIGKILL once the weights are written, as config.yaml is about to be
    if str(path).endswith("config.yaml"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, chunks)
import pipeline.model.io as io
io.atomic_write_bytes = write
sys.argv = ["tlf", *sys.argv[1:]]
main()
"""


def test_export_is_atomic_and_replaces_an_earlier_export_whole(tmp_path):
    """A kill leaves no partial --out and the rerun removes its temp files; `--format hf` over an earlier
    tlf export leaves none of its files (model.pt, config.yaml) beside the new ones."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    model, cfg = perturbed_tiny()
    src = save_model(tmp_path / "src", model, cfg)
    out = tmp_path / "out"
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, "export", str(src), "--out", str(out)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not out.exists() and list(tmp_path.glob(".out.tmp-export*"))  # nothing partial under --out
    assert CliRunner().invoke(main, ["export", str(src), "--out", str(out), "--format", "pt"]).exit_code == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out", "src"]  # the temp dir is gone
    assert sorted(x.name for x in out.iterdir()) == ["config.yaml", "model.pt"]
    res = CliRunner().invoke(main, ["export", str(src), "--out", str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    names = {x.name for x in out.iterdir()}
    assert "config.json" in names and "model.safetensors" in names and not names & {"model.pt", "config.yaml"}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out", "src"]
