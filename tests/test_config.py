"""The one config system: presets, YAML inheritance, dotted overrides and their errors."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import (
    CONFIG_DIR,
    SCALES,
    VARIANTS,
    Config,
    ConfigError,
    ModelConfig,
    ObjectiveConfig,
    config_from_dict,
    field_docs,
    list_presets,
    load_config,
    upgrade,
)


# the presets beside SCALE/VARIANT: the router recipes' (docs/router.md)
RECIPE_PRESETS = {
    *(f"{scale}/t-loopformer-budget" for scale in SCALES),
    "fold/kinds",
    "fold/t-loopformer-expected",
}


def test_every_shipped_config_loads():
    presets = list_presets()
    assert set(presets) == {f"{s}/{v}" for s in SCALES for v in VARIANTS} | RECIPE_PRESETS
    for name in presets:
        cfg = load_config(name)
        scale, variant = name.split("/")
        assert cfg.model.variant == variant.removesuffix("-budget").removesuffix("-expected").replace(
            "kinds", "base-loop-router"
        )
        assert cfg.name == name
    for p in CONFIG_DIR.glob("**/*.yaml"):  # scale and variant fragments load as files too
        load_config(str(p))


def test_presets_name_their_recipe():
    """t-loopformer is the paper's recipe (a faithful reproduction); SCALE/t-loopformer-budget the budget recipe;
    fold/kinds the recipe that composed on the fold task, fold/t-loopformer-expected the expected one."""
    for scale in SCALES:
        assert load_config(f"{scale}/t-loopformer").objective.router.recipe == "paper"
        budget = load_config(f"{scale}/t-loopformer-budget")
        assert budget.objective.router.recipe == "budget" and budget.model.router_norm
    assert load_config("small/t-loopformer-budget").objective.router.target_depth == 2.5  # make demo's
    kinds = load_config("fold/kinds")
    assert (kinds.model.variant, kinds.objective.router.recipe, kinds.model.exited_keys) == (
        "base-loop-router",
        "kinds",
        "frozen",
    )
    assert load_config("fold/t-loopformer-expected").objective.router.recipe == "expected"


def test_variant_flags_match_design_table():
    want = {  # variant: (conditioning, shortcut, router, looped)
        "base": ("none", False, False, False),
        "base-loop": ("none", False, False, True),
        "tmlt": ("time", False, False, True),
        "naive-loop-ee": ("none", False, False, True),
        "base-loop-ee-align": ("none", True, False, True),
        "tmlt-ee": ("time", True, False, True),
        "loopformer": ("time_step", True, False, True),
        "t-loopformer": ("time_step", True, True, True),
    }
    for scale in SCALES:
        looped = load_config(f"{scale}/base-loop").model
        for v, (cond, sc, rt, is_looped) in want.items():
            c = load_config(f"{scale}/{v}")
            m = c.model
            assert (m.conditioning, c.objective.shortcut, m.router) == (cond, sc, rt), (scale, v)
            if is_looped:
                assert (m.n_layers, m.loops) == (looped.n_layers, looped.loops)
            else:  # the dense baseline has the looped models' effective depth
                assert (m.n_layers, m.loops) == (looped.n_layers * looped.loops, 1)
    paper = load_config("paper/t-loopformer")
    assert (paper.model.d_model, paper.model.n_heads, paper.model.d_ff, paper.model.block_size) == (
        2048,
        32,
        5120,
        2048,
    )
    assert (paper.model.n_layers, paper.model.loops, paper.model.vocab_size) == (3, 8, 50304)
    assert (paper.optim.lr, paper.schedule.min_lr, paper.schedule.warmup_steps, paper.schedule.max_steps) == (
        6e-4,
        6e-5,
        4000,
        250000,
    )
    assert paper.optim.weight_decay == 0.2 and paper.train.global_batch_size == 48
    assert load_config("paper/base").model.n_layers == 24


def test_overrides_are_typed():
    cfg = load_config(
        "tiny/t-loopformer",
        [
            "model.loops=3",
            "optim.lr=1e-3",
            "model.execution=dense",
            "eval.loops=[1,2]",
            "model.router_threshold=0.25",
        ],
    )
    assert cfg.model.loops == 3 and cfg.optim.lr == 1e-3 and cfg.model.execution == "dense"
    assert cfg.eval.loops == [1, 2] and cfg.model.router_threshold == 0.25


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.loopz=3", "unknown config key 'model.loopz' (did you mean 'model.loops'?)"),
        ("modle.loops=3", "unknown config key 'modle'"),
        ("model.loops=abc", "'model.loops' expects int"),
        ("model.loops=2.5", "'model.loops' expects int"),
        ("model.conditioning=sometimes", "'model.conditioning' expects one of"),
        ("model.d_model=33", "model.d_model (33) must be divisible by model.n_heads"),
        ("model.router_threshold=1.5", "'model.router_threshold' must be in (0, 1), got 1.5"),
        (
            "objective.router.recipe=greedy",
            "'objective.router.recipe' expects one of 'paper', 'budget', 'expected', 'kinds', got 'greedy'",
        ),
        (
            "objective.router.target_depth=2",
            "unknown config key 'objective.router.target_depth': recipe 'paper' has the keys none",
        ),
        ("model.router_recipe=budget", "'model.router_recipe' moved to 'objective.router.recipe'"),
        (
            "objective.router_explore=0.25",
            "'objective.router_explore': removed: exploration did not help (docs/research/router.md)",
        ),
        ("eval.loops=[9]", "eval.loops: budget 9"),
        ("model.loops.x=1", "'model.loops' is not a section"),
        ("model", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny/t-loopformer", [override])
    assert needle in str(e.value)


def test_a_recipe_checks_its_keys_and_the_network_it_trains():
    """Each recipe's own checks and the cross-checks every recipe shares, each a one-line error naming the key."""
    budget = "tiny/t-loopformer-budget"
    bad = [
        ("tiny/loopformer", ["objective.router.recipe=budget"], r"objective.router.recipe=budget needs a router"),
        ("tiny/t-loopformer", ["objective.router.recipe=budget"], r"budget needs model.router_norm=true"),
        (budget, ["objective.router.target_depth=4"], r"target_depth must be 0 \(default\) or lie strictly between"),
        (budget, ["objective.router.entropy_weight=-1"], r"'objective.router.entropy_weight' must be >= 0, got -1.0"),
        (budget, ["objective.router.hard_weight=1"], r"recipe 'budget' has the keys target_depth, balance_w"),
        (budget, ["model.router_forecast=true"], r"budget does not train the forecast head .* recipes that train"),
        (budget, ["objective.router.recipe=kinds"], r"kinds needs model.router_forecast=true"),
        (budget, ["objective.router.recipe=expected"], r"expected needs model.exit_schedule=prefix"),
        ("fold/kinds", ["objective.router.hard_gate=1"], r"'objective.router.hard_gate' must be in \(0, 1\), got 1.0"),
        ("fold/kinds", ["objective.router.withhold=0"], r"'objective.router.withhold' must be in \(0, 1\), got 0.0"),
        ("fold/kinds", ["objective.router.hard_weight=0"], r"'objective.router.hard_weight' must be > 0, got 0.0"),
        ("tiny/loopformer", ["model.router_norm=true"], r"model.router_norm=true needs a router"),
    ]
    for preset, overrides, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            load_config(preset, overrides)
    load_config(budget, ["objective.router.recipe=expected", "model.exit_schedule=prefix"])
    load_config(
        "fold/base-loop-router", ["objective.router.recipe=expected", "model.router_norm=true"]
    )  # unconditioned


def test_setting_the_recipe_starts_its_keys_from_their_defaults(tmp_path):
    """In a mapping the recipe is chosen first, whatever the key order; on top of a preset, another recipe starts
    from its own defaults (the keys of the preset's recipe do not carry over)."""
    y = tmp_path / "r.yaml"
    y.write_text(
        "inherit: [" + str(CONFIG_DIR / "tiny" / "t-loopformer-budget.yaml") + "]\nobjective:\n  router:\n"
        "    prior_weight: 0.3\n    recipe: expected\nmodel:\n  exit_schedule: prefix\n"
    )
    r = load_config(str(y)).objective.router
    assert (r.recipe, r.prior_weight, r.target_depth) == ("expected", 0.3, 0.0)
    r = load_config("fold/kinds", ["objective.router.recipe=kinds", "objective.router.withhold=0.5"]).objective.router
    assert (r.recipe, r.target_depth, r.withhold) == ("kinds", 1.1, 0.5)  # the same recipe: kept


def test_a_moved_or_removed_key_is_a_one_line_error_naming_what_replaces_it(tmp_path):
    for cls, sec in ((ModelConfig, "model"), (ObjectiveConfig, "objective")):
        assert not set(cls.MOVED) & set(cls.REMOVED) & {f.name for f in dataclasses.fields(cls)}
        for old, new in cls.MOVED.items():
            with pytest.raises(ConfigError) as e:
                load_config("tiny/t-loopformer", [f"{sec}.{old}=1"])
            assert str(e.value) == f"command line ({sec}.{old}=1): '{sec}.{old}' moved to '{new}'"
        for old, why in cls.REMOVED.items():
            with pytest.raises(ConfigError) as e:
                load_config("tiny/t-loopformer", [f"{sec}.{old}=1"])
            assert str(e.value) == f"command line ({sec}.{old}=1): '{sec}.{old}': {why}"
    bad = tmp_path / "old.yaml"
    bad.write_text("inherit: [" + str(CONFIG_DIR / "tiny" / "loopformer.yaml") + "]\nmodel:\n  lambda_align: 0.5\n")
    with pytest.raises(ConfigError, match=r"old\.yaml: 'model.lambda_align' moved to 'objective.lambda_align'$"):
        load_config(str(bad))


def _stored(name: str) -> dict:
    """A stored config of tests/fixtures (an export's config.yaml)."""
    import yaml

    return yaml.safe_load(
        (CONFIG_DIR.parent / "tests" / "fixtures" / name / "global_step2/model/config.yaml").read_text()
    )


def test_a_config_stored_before_the_objective_section_reads_in_todays_layout():
    """Checkpoints and exports written before the move hold the objective's keys under `model`, the router's
    recipe there too and no network key newer than them."""
    old = _stored("pre_objective/zero0")
    before = json.dumps(old, sort_keys=True)
    cfg = config_from_dict(old, "old checkpoint")
    assert cfg.objective.lambda_short == 0.2 and cfg.model.router_norm and cfg.model.exited_keys == "drop"
    assert dataclasses.asdict(cfg.objective.router) == {
        "recipe": "budget",
        "target_depth": 0.0,
        "balance_weight": 1.0,
        "entropy_weight": 0.1,
    }
    assert upgrade(old)["objective"]["router"]["recipe"] == "budget" and json.dumps(old, sort_keys=True) == before


def test_a_stored_config_whose_router_training_is_gone_is_a_one_line_error():
    """A stored value today's code does not run (a removed setting on, a network constant changed, the expected
    recipe with the hard-token target but not the kinds recipe's choices) names the key and why."""
    cases = [
        (
            ("objective", "router_explore", 0.25),
            r"'objective.router_explore'=0.25: removed: exploration did not help .*; today's code runs 0.0 there$",
        ),
        (("model", "norm_eps", 1e-6), r"'model.norm_eps'=1e-06: removed: RMSNorm's epsilon is 1e-5"),
        (
            ("model", "router_detach", True),
            r"'model.router_detach'=True: removed: the router reads sg\(h0\) under the kinds recipe",
        ),
        (
            ("objective", "router_exit_weights", "pi"),
            r"'objective.router_exit_weights'='pi': removed: fixed in the kinds recipe .* runs 'depth_label' there$",
        ),
    ]
    for (sec, key, value), msg in cases:
        d = _stored("pre_recipes/kinds_zero0" if key == "router_exit_weights" else "pre_recipes/budget_zero0")
        d[sec][key] = value
        with pytest.raises(ConfigError, match=r"^old checkpoint: " + msg):
            config_from_dict(d, "old checkpoint")
    d = _stored("pre_recipes/budget_zero0")  # the router's hidden size, stored as d_model // 4: today's network
    d["model"]["router_hidden"] = d["model"]["d_model"] // 4
    config_from_dict(d, "old checkpoint")
    d["model"]["router_hidden"] += 1
    with pytest.raises(ConfigError, match=r"'model.router_hidden'=\d+: removed: the router's hidden size is d_model"):
        config_from_dict(d, "old checkpoint")


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layerz: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'model.n_layerz'"):
        load_config(str(bad))
    bad.write_text("model:\n  n_layers: three\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: 'model.n_layers' expects int"):
        load_config(str(bad))
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load_config(str(bad))
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("inherit: b.yaml\n")
    b.write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="inherit cycle"):
        load_config(str(a))
    child = tmp_path / "child.yaml"
    child.write_text(f"inherit: [{CONFIG_DIR / 'tiny' / 'loopformer.yaml'}]\nmodel:\n  loops: 2\n")
    cfg = load_config(str(child))
    assert cfg.model.loops == 2 and cfg.model.conditioning == "time_step" and cfg.model.d_model == 32
    with pytest.raises(ConfigError, match="unknown config 'tiny/loopformr'.*did you mean tiny/loopformer"):
        load_config("tiny/loopformr")


def test_every_field_is_documented():
    rows = field_docs()
    assert len(rows) > 50
    for key, _tp, _default, doc in rows:
        assert doc and len(doc) > 8, f"{key} has no doc"
    for fl in dataclasses.fields(Config):
        assert fl.metadata.get("doc"), fl.name


def test_world_size_mismatch_names_both_values():
    cfg = load_config("paper/t-loopformer")
    assert cfg.check_world_size(8) == 1
    with pytest.raises(ConfigError, match=r"global_batch_size=48 but .*micro_batch_size=6 .* world_size=4 = 24"):
        cfg.check_world_size(4)


def test_cli_config_commands():
    r = CliRunner().invoke(main, ["config", "list"])
    assert r.exit_code == 0 and "tiny/t-loopformer" in r.output and "paper/base" in r.output
    r = CliRunner().invoke(main, ["config", "show", "tiny/t-loopformer", "model.loops=2"])
    assert r.exit_code == 0 and "loops: 2" in r.output
    r = CliRunner().invoke(main, ["config", "show", "tiny/t-loopformer", "--doc"])
    assert r.exit_code == 0 and "model.router_threshold = 0.5" in r.output
    r = CliRunner().invoke(main, ["config", "show", "tiny/t-loopformer", "model.nope=1"])
    assert r.exit_code == 2 and "unknown config key 'model.nope'" in r.output


def test_config_show_doc_shows_only_the_chosen_recipes_keys():
    keys = {}
    for name in ("tiny/t-loopformer", "tiny/t-loopformer-budget", "fold/kinds"):
        r = CliRunner().invoke(main, ["config", "show", name, "--doc"])
        assert r.exit_code == 0, r.output
        keys[name] = {line.split(" = ")[0] for line in r.output.splitlines() if line.startswith("objective.router.")}
    assert keys["tiny/t-loopformer"] == {"objective.router.recipe"}
    assert keys["tiny/t-loopformer-budget"] == {
        f"objective.router.{k}" for k in ("recipe", "target_depth", "balance_weight", "entropy_weight")
    }
    assert {f"objective.router.{k}" for k in ("hard_weight", "hard_gate", "withhold", "prior_weight")} <= keys[
        "fold/kinds"
    ] and "objective.router.entropy_weight" not in keys["fold/kinds"]
    rows = {k for k, *_ in field_docs()}  # the README's reference: every recipe's keys
    assert {"objective.router.entropy_weight", "objective.router.withhold"} <= rows


def test_the_recipe_is_chosen_before_its_keys_wherever_it_stands_on_the_command_line():
    """objective.router.recipe starts the section over: a recipe key given before it on the command line must not be
    dropped with the old recipe (a setting silently ignored)."""
    for order in (
        ["objective.router.target_depth=3", "objective.router.recipe=expected"],
        ["objective.router.recipe=expected", "objective.router.target_depth=3"],
    ):
        cfg = load_config("small/t-loopformer-budget", [*order, "model.exit_schedule=prefix"])
        assert cfg.objective.router.recipe == "expected"
        assert cfg.objective.router.target_depth == 3.0
    kept = load_config("small/t-loopformer-budget", ["objective.router.recipe=budget"])
    assert kept.objective.router.target_depth == 2.5  # naming the recipe already chosen keeps its keys


def test_the_recipe_is_chosen_before_its_keys_in_a_yaml_file_of_dotted_keys(tmp_path):
    """The same rule in a YAML file whose keys are dotted (the order of a mapping's keys as written)."""
    p = tmp_path / "run.yaml"
    p.write_text(
        "inherit: small/t-loopformer-budget\nobjective.router.target_depth: 3\nobjective.router.recipe: expected\n"
        "model.exit_schedule: prefix\n"
    )
    cfg = load_config(str(p))
    assert cfg.objective.router.recipe == "expected" and cfg.objective.router.target_depth == 3.0
