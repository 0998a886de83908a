"""Helpers shared by several test files (imported as `from helpers import ...`; pytest puts tests/ on sys.path)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from bench.testkit import spread_router as _spread_router
from pipeline.config import load_config
from pipeline.model.looped import LoopedLM

DEVICES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() else []
)  # exactness tests run on a GPU too, where there is one


def perturbed_tiny(name: str = "tiny/t-loopformer", seed: int = 0, overrides: tuple = ()):
    """A tiny model with every weight perturbed (zero-initialised modulators would make loops identities) and a
    router biased to depths around 3 of 4; returns (model in eval mode, config)."""
    cfg = load_config(name, list(overrides))
    torch.manual_seed(seed)
    m = LoopedLM(cfg.model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if m.router is not None:
            m.router.fc2.bias.copy_(torch.linspace(-0.5, 0.5, cfg.model.loops))
    return m.eval(), cfg


def spread_router(model, seed: int = 0, scale: float = 3.0):
    """The tests' one router-spreading fixture: bench.testkit.spread_router (the benchmarks' recipe) at a
    peakier scale, so that the few tokens of a tiny test already cover every depth 1..L; returns the model."""
    return _spread_router(model, seed, scale)


# Each router recipe as overrides of a router preset (tiny/t-loopformer, fold/base-loop-router ...): the recipe and
# the network keys it needs (pipeline/train/recipes)
RECIPE = {
    "paper": [],
    "budget": ["model.router_norm=true", "objective.router.recipe=budget"],
    "expected": ["model.router_norm=true", "model.exit_schedule=prefix", "objective.router.recipe=expected"],
    "kinds": [
        "model.router_norm=true",
        "model.router_forecast=true",
        "model.exit_schedule=prefix",
        "objective.router.recipe=kinds",
    ],
}


def loose_kinds(monkeypatch, ratio: float = 1.0, buckets: int = 31, decay: float = 0.5) -> None:
    """The kinds recipe's constants loosened for a few steps on random tokens: a token is hard above `ratio` times
    its exit's mean (random tokens' losses are nearly uniform), a small table that moves fast."""
    from pipeline.train.recipes import kinds

    monkeypatch.setattr(kinds, "HARD_RATIO", ratio)
    monkeypatch.setattr(kinds, "KIND_BUCKETS", buckets)
    monkeypatch.setattr(kinds, "KIND_DECAY", decay)


def run_here(args: list[str], preset: str = "tiny/t-loopformer") -> dict:
    """bench/faults.py's CHILD without a kill, in this process: `run(load_config(preset, args))`, the same entry
    the child calls, without a child's second import of torch and DeepSpeed (seconds each). Returns what the child
    prints: {"losses", "start", "step"}. For the runs that are not killed (uninterrupted runs a killed child is
    compared with, set-ups, resumes after the kill); a run that must die (a SIGKILL of a process) stays a child."""
    from pipeline.train.trainer import run

    res = run(load_config(preset, list(args)))
    return {"losses": [float(x) for x in res.losses], "start": res.start_step, "step": res.step}


REPO = Path(__file__).resolve().parent.parent
# Several `tlf` commands one after the other in one child process (the `tlf` entry, pipeline.cli.main, called as the
# console script does), each with its own stdout, stderr and exit status: a module's shared runs import torch,
# DeepSpeed and MLflow once instead of once a command. tlf train leaves through os._exit (pipeline/train/cli.py
# _exit, after its teardown); here that exit ends the command, and the next one follows. One train a driver: a
# second would find DeepSpeed's process group torn down by the first.
DRIVER = """
import json, os, sys
from pathlib import Path
def _exit(code):
    raise SystemExit(code)
os._exit = _exit
from pipeline.cli import main
out = Path(sys.argv[1])
for i, args in enumerate(json.loads(sys.argv[2])):
    with open(out / f"{i}.out", "w") as o, open(out / f"{i}.err", "w") as e:
        saved = os.dup(1), os.dup(2)
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
        try:
            main(args=args, prog_name="tlf")
            code = 0
        except SystemExit as x:
            code = x.code if isinstance(x.code, int) else int(x.code is not None)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    (out / f"{i}.rc").write_text(str(code))
"""


def tlf_all(commands: dict[str, list], cwd: Path) -> dict[str, subprocess.CompletedProcess]:
    """{name: `tlf *args`} run in this order in one child (DRIVER), in cwd: {name: its result}; each must exit 0."""
    logs = cwd / ".tlf_all"
    logs.mkdir()
    todo = [[str(a) for a in args] for args in commands.values()]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", DRIVER, str(logs), json.dumps(todo)], cwd=cwd, env=env,
                       capture_output=True, text=True)  # fmt: skip
    out = {}
    for i, (name, args) in enumerate(commands.items()):
        rc = logs / f"{i}.rc"
        assert rc.is_file(), f"tlf {name} did not finish (driver exit {p.returncode}):\n{p.stdout}{p.stderr}"
        read = lambda ext: (logs / f"{i}.{ext}").read_text()  # noqa: B023 - read at once
        out[name] = subprocess.CompletedProcess(["tlf", *args], int(rc.read_text()), read("out"), read("err"))
        assert out[name].returncode == 0, f"tlf {name}: " + out[name].stdout + out[name].stderr
    shutil.rmtree(logs)
    return out
