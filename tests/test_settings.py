"""Every setting of the network and the objective has a user: a shipped preset that sets it in its YAML, or that
runs on its default (`make demo` and `make demo-fold` train presets: small/t-loopformer-budget,
fold/t-loopformer-expected), and the router recipes' keys are counted once each as objective.router.<key>. A
setting added without a user here fails, and so do more than 30 of them (docs/router.md: what did not help is
deleted)."""

import dataclasses

import pytest

from data_prep.configlib import read_yaml_chain
from pipeline.config import Config, field_docs, flatten, load_config, preset_file, resolve_path

MAX_SETTINGS = 30
# setting -> (the preset that uses it, "sets" it in its YAML chain or runs its "default")
USERS = {
    "model.variant": ("tiny/t-loopformer", "sets"),
    "model.vocab_size": ("tiny/t-loopformer", "sets"),
    "model.block_size": ("tiny/t-loopformer", "sets"),
    "model.d_model": ("tiny/t-loopformer", "sets"),
    "model.n_heads": ("tiny/t-loopformer", "sets"),
    "model.d_ff": ("tiny/t-loopformer", "sets"),
    "model.n_layers": ("tiny/t-loopformer", "sets"),
    "model.loops": ("tiny/t-loopformer", "sets"),
    "model.conditioning": ("tiny/t-loopformer", "sets"),
    "model.router": ("tiny/t-loopformer", "sets"),
    "model.router_threshold": ("paper/t-loopformer", "default"),  # the paper's theta 0.5
    "model.router_norm": ("small/t-loopformer-budget", "sets"),
    "model.router_forecast": ("fold/kinds", "sets"),
    "model.execution": ("paper/t-loopformer", "default"),  # compact; the others are bench/gpu_check.py's cases
    "model.exit_schedule": ("fold/t-loopformer-expected", "sets"),
    "model.exited_keys": ("fold/kinds", "sets"),
    "model.gate_init": ("fold/kinds", "sets"),
    "model.fourier_dim": ("tiny/t-loopformer", "sets"),
    "objective.shortcut": ("tiny/t-loopformer", "sets"),
    "objective.lambda_short": ("fold/t-loopformer-expected", "sets"),
    "objective.lambda_align": ("fold/t-loopformer-expected", "sets"),
    "objective.align_positions": ("fold/kinds", "sets"),
    "objective.router.recipe": ("small/t-loopformer-budget", "sets"),
    "objective.router.target_depth": ("small/t-loopformer-budget", "sets"),
    "objective.router.balance_weight": ("small/t-loopformer-budget", "default"),
    "objective.router.entropy_weight": ("small/t-loopformer-budget", "default"),
    "objective.router.prior_weight": ("fold/kinds", "default"),
    "objective.router.hard_weight": ("fold/kinds", "sets"),
    "objective.router.hard_gate": ("fold/kinds", "sets"),
    "objective.router.withhold": ("fold/kinds", "sets"),
}


def settings() -> set[str]:
    """Every model and objective setting, each recipe key once as objective.router.<key> (the reference's rows)."""
    return {k for k, *_ in field_docs(Config) if k.split(".")[0] in ("model", "objective")}


def _yaml_keys(preset: str) -> set[str]:
    """The dotted keys a preset's YAML chain sets (its `inherit:` entries resolved as load_config resolves them)."""
    return set().union(*(flatten(data) for _, data in read_yaml_chain(resolve_path(preset), resolve=preset_file)))


def test_every_setting_has_a_user_and_there_are_at_most_30():
    have = settings()
    assert have - set(USERS) == set(), "settings without a user (a preset that sets or runs them): add one or delete"
    assert set(USERS) - have == set(), "USERS lists settings that no longer exist"
    assert len(have) <= MAX_SETTINGS, f"{len(have)} model + objective settings, more than {MAX_SETTINGS}"


@pytest.mark.parametrize("key", sorted(USERS))
def test_the_user_of_each_setting_uses_it(key):
    """A preset that "sets" a key writes it in its YAML chain; one that runs its "default" has the default there
    (of the key's class in that preset: the recipe's for objective.router keys)."""
    preset, how = USERS[key]
    cfg = load_config(preset)
    sec, _, rest = key.partition(".")
    obj = getattr(cfg, sec)
    if rest.startswith("router."):
        obj, rest = obj.router, rest.removeprefix("router.")
    assert rest in {fl.name for fl in dataclasses.fields(obj)}, f"{preset} has no {key}"
    if how == "sets":
        assert key in _yaml_keys(preset), f"{preset} does not set {key}"
    else:
        assert getattr(obj, rest) == getattr(type(obj)(), rest), f"{preset} does not run {key}'s default"
