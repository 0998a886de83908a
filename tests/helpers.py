"""Helpers shared by several test files (imported as `from helpers import ...`; pytest puts tests/ on sys.path)."""

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
