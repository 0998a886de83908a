"""The README's SLURM batch script: bash parses it, its #SBATCH lines are options, and its torchrun
lines (the script's and the several-nodes variant in the paragraph after it) are accepted by torchrun's own
argument parser, with a `tlf train` command line whose preset and overrides load."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def script(path: Path = README) -> str:
    """The ```bash block of a markdown file (the README) holding #SBATCH lines."""
    blocks = re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M)
    found = [b for b in blocks if "#SBATCH" in b]
    assert len(found) == 1, f"{len(found)} SLURM scripts in {path.relative_to(ROOT)}"
    return found[0]


def test_the_slurm_script_is_the_same_in_the_readme_and_the_training_page():
    assert script(README) == script(ROOT / "docs" / "training.md")


def _torchrun(argv: list[str]):
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv)


def test_bash_parses_the_slurm_script(tmp_path):
    f = tmp_path / "tlf.sbatch"
    f.write_text(script())
    p = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert script().startswith("#!/bin/bash\n")


def test_sbatch_lines_are_options():
    for ln in script().splitlines():
        if ln.startswith("#SBATCH"):
            opts = ln.split("#", 2)[1].split()[1:]  # a trailing comment dropped
            assert opts and all(re.fullmatch(r"--[a-z-]+(=\S+)?", o) for o in opts), ln
    assert "--requeue" in script() and re.search(r"--signal=B:TERM@\d+", script())


def test_torchrun_lines_are_accepted_and_tlf_train_loads():
    from pipeline.config import load_config

    body = re.sub(r"\\\n\s*", " ", script())
    line = next(ln for ln in body.splitlines() if ln.startswith("torchrun "))
    argv = shlex.split(line.replace("$(which tlf)", "tlf").rstrip("& "))
    args = _torchrun(argv[1:])
    assert args.standalone and args.nproc_per_node == "8" and args.max_restarts == 3, args
    assert args.training_script == "tlf" and args.training_script_args[0] == "train", args
    preset, *overrides = args.training_script_args[1:]
    cfg = load_config(preset, overrides)  # an unknown preset or key raises
    assert cfg.checkpoint.resume == "auto"  # the requeued job resumes
    # several nodes, as the paragraph after the script says (placeholders filled in)
    text = " ".join(README.read_text().split())
    m = re.search(r"`srun torchrun (--nnodes .*?) …`", text)
    assert m, "the several-nodes torchrun line is gone from README.md"
    opts = m.group(1).replace("$SLURM_NNODES", "2").replace("$(scontrol show hostnames | head -1)", "node1")
    args = _torchrun(shlex.split(opts) + ["--nproc-per-node", "8", "tlf", "train", preset])
    assert args.nnodes == "2" and args.rdzv_backend == "c10d" and args.rdzv_endpoint == "node1:29500", args
