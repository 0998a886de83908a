"""The one config system: presets, YAML inheritance, dotted overrides and their errors."""

import dataclasses

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


def test_every_shipped_config_loads():
    presets = list_presets()
    assert len(presets) == len(SCALES) * len(VARIANTS) == 36
    for name in presets:
        cfg = load_config(name)
        scale, variant = name.split("/")
        assert cfg.model.variant == variant and cfg.name == name
    for p in CONFIG_DIR.glob("**/*.yaml"):  # scale and variant fragments load as files too
        load_config(str(p))


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
            "model.gather_scatter=false",
            "eval.loops=[1,2]",
            "model.router_threshold=0.25",
        ],
    )
    assert cfg.model.loops == 3 and cfg.optim.lr == 1e-3 and cfg.model.gather_scatter is False
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
        ("model.router_threshold=1.5", "model.router_threshold must lie in (0, 1)"),
        ("model.router_recipe=greedy", "'model.router_recipe' expects one of 'paper', 'budget', 'expected'"),
        (
            "model.router_target_depth=4",
            "model.router_target_depth must be 0 (default) or lie strictly between 1 and model.loops (4)",
        ),
        ("objective.router_entropy_weight=-1", "objective.router_entropy_weight must be >= 0"),
        ("objective.router_explore=1.5", "objective.router_explore must lie in [0, 1], got 1.5"),
        ("objective.router_explore_span=0", "objective.router_explore_span must be >= 1, got 0"),
        ("eval.loops=[9]", "eval.loops: budget 9"),
        ("model.loops.x=1", "'model.loops' is not a section"),
        ("model", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny/t-loopformer", [override])
    assert needle in str(e.value)


def test_router_training_options_without_what_they_act_on_are_errors():
    with pytest.raises(ConfigError, match=r"objective.router_explore=0.25 needs a router"):
        load_config("tiny/loopformer", ["objective.router_explore=0.25"])
    with pytest.raises(ConfigError, match=r"objective.router_explore_span=8 needs exploration"):
        load_config("tiny/t-loopformer", ["objective.router_explore_span=8"])
    load_config("tiny/t-loopformer", ["objective.router_explore_span=8", "objective.router_explore=0.25"])
    with pytest.raises(ConfigError, match=r"objective.router_explore_draw=next needs exploration"):
        load_config("tiny/t-loopformer", ["objective.router_explore_draw=next"])
    load_config("tiny/t-loopformer", ["objective.router_explore_draw=next", "objective.router_explore=0.25"])
    for k in ("router_ste_log", "router_ste_keys"):
        with pytest.raises(ConfigError, match=rf"objective.{k}=true needs the straight-through estimator"):
            load_config("tiny/t-loopformer", [f"objective.{k}=true", "objective.router_ste=false"])
        with pytest.raises(ConfigError, match=rf"objective.{k}=true needs"):
            load_config("tiny/loopformer", [f"objective.{k}=true"])
        load_config("tiny/t-loopformer", [f"objective.{k}=true"])  # with both: fine
    with pytest.raises(ConfigError, match=r"objective.router_ste_keys=true needs model.exited_keys=drop"):
        load_config("tiny/t-loopformer", ["objective.router_ste_keys=true", "model.exited_keys=frozen"])
    load_config("tiny/t-loopformer", ["objective.router_ste_log=true", "model.exited_keys=frozen"])
    with pytest.raises(ConfigError, match=r"model.router_detach=true needs a router"):
        load_config("tiny/loopformer", ["model.router_detach=true"])
    load_config("tiny/t-loopformer", ["model.router_detach=true"])


# objective keys that were never model keys: newer than the move, so a config stored before it has none of them
BORN_IN_OBJECTIVE = (
    "router_explore",
    "router_explore_span",
    "router_explore_draw",
    "router_ste_log",
    "router_ste_keys",
    "router_prior_weight",
    "router_exit_uniform",
    "router_exit_weights",
    "router_hard_weight",
    "router_hard_ratio",
    "router_hard_bound",
    "router_hard_gate",
    "router_withhold_gate",
    "router_withhold_learnt",
    "router_withhold_kind",
    "router_kind_buckets",
    "router_kind_decay",
    "router_withhold_kind_only",
    "router_kind_gate",
    "router_hard_reference",
)


def test_a_key_that_moved_to_the_objective_is_a_one_line_error_naming_its_new_key(tmp_path):
    born_there = set(BORN_IN_OBJECTIVE)
    assert set(ModelConfig.MOVED) == {f.name for f in dataclasses.fields(ObjectiveConfig)} - born_there
    for old, new in ModelConfig.MOVED.items():
        with pytest.raises(ConfigError) as e:
            load_config("tiny/t-loopformer", [f"model.{old}=1"])
        assert str(e.value) == f"command line (model.{old}=1): 'model.{old}' moved to '{new}'"
    bad = tmp_path / "old.yaml"
    bad.write_text("inherit: [" + str(CONFIG_DIR / "tiny" / "loopformer.yaml") + "]\nmodel:\n  lambda_align: 0.5\n")
    with pytest.raises(ConfigError, match=r"old\.yaml: 'model.lambda_align' moved to 'objective.lambda_align'$"):
        load_config(str(bad))


def test_a_config_stored_before_the_objective_section_reads_in_todays_layout():
    """Checkpoints and exports written before the move hold the objective's keys under `model`."""
    old = Config().to_dict()
    objective = old.pop("objective")
    for k in BORN_IN_OBJECTIVE:  # newer than the move: an old file does not have them
        objective.pop(k)
    old["model"].pop("exited_keys")  # newer too
    old["model"].pop("exit_schedule")
    old["model"].pop("router_forecast")
    old["model"].pop("router_detach")
    old["model"].update(objective, lambda_short=0.3, align_target="hidden")
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in old.items()}
    cfg = config_from_dict(old, "old checkpoint")
    assert cfg.objective.lambda_short == 0.3 and cfg.objective.align_target == "hidden"
    assert cfg.objective.router_explore == 0.0  # a key the old file lacks keeps its default
    expected = upgrade(old)
    expected["model"].update(exited_keys="drop", exit_schedule="own", router_forecast=False, router_detach=False)
    expected["objective"].update(
        router_explore=0.0,
        router_explore_span=1,
        router_explore_draw="prior",
        router_ste_log=False,
        router_ste_keys=False,
        router_prior_weight=0.1,
        router_exit_uniform=0.0,
        router_exit_weights="pi",
        router_hard_weight=0.0,
        router_hard_ratio=1.5,
        router_hard_bound=False,
        router_hard_gate=0.0,
        router_withhold_gate=0.0,
        router_withhold_learnt=0.0,
        router_withhold_kind=0.0,
        router_kind_buckets=4093,
        router_kind_decay=0.9,
        router_withhold_kind_only=False,
        router_kind_gate=False,
        router_hard_reference="batch",
    )
    assert cfg.to_dict() == expected and old == before  # the stored dict is left as it was


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


def test_the_expected_router_recipe_needs_its_exits_to_be_depths():
    """model.router_recipe=expected trains the exit after loop d of the full pass: a config where that is not
    a depth-d token, or that asks for the straight-through recipes' knobs or the entropy term, is one line."""
    ok = ["model.router_recipe=expected", "model.exit_schedule=prefix", "objective.router_entropy_weight=0"]
    load_config("tiny/t-loopformer", ok)
    bad = [
        (ok[::2], r"model.router_recipe=expected needs model.exit_schedule=prefix"),
        (ok[:2], r"objective.router_entropy_weight=0.1 with model.router_recipe=expected"),
        ([*ok, "objective.router_explore=0.25"], r"objective.router_explore=0.25 needs a straight-through router"),
        ([*ok, "objective.router_ste_log=true"], r"objective.router_ste_log=true needs a straight-through router"),
        ([*ok, "objective.router_ste_keys=true"], r"objective.router_ste_keys=true needs a straight-through router"),
        ([*ok, "objective.router_exit_uniform=1.5"], r"objective.router_exit_uniform must lie in \[0, 1\], got 1.5"),
        (
            ["objective.router_exit_uniform=0.5"],
            r"objective.router_exit_uniform=0.5 needs model.router_recipe=expected",
        ),
        (
            ["objective.router_exit_weights=depth"],
            r"objective.router_exit_weights=depth needs model.router_recipe=expected",
        ),
        (
            [*ok, "objective.router_exit_weights=depth", "objective.router_exit_uniform=0.1"],
            r"objective.router_exit_weights=depth with objective.router_exit_uniform=0.1: .* \(set one of them\)$",
        ),
        ([*ok, "objective.router_exit_weights=hard"], r"objective.router_exit_weights"),
        (
            [*ok, "objective.router_exit_weights=depth_label"],
            r"objective.router_exit_weights=depth_label needs the hard-token target",
        ),
        ([*ok, "objective.router_withhold_learnt=-1"], r"objective.router_withhold_learnt must be >= 0, got -1"),
        (
            [*ok, "objective.router_withhold_learnt=0.1"],
            r"objective.router_withhold_learnt=0.1 needs objective.router_exit_weights=depth_label",
        ),
        ([*ok, "objective.router_withhold_gate=1"], r"objective.router_withhold_gate must lie in \[0, 1\), got 1"),
        (
            [*ok, "objective.router_hard_weight=1", "objective.router_withhold_gate=0.7"],
            r"objective.router_withhold_gate=0.7 needs objective.router_exit_weights=depth_label and model.router_f",
        ),
        ([*ok, "objective.router_withhold_kind=1"], r"objective.router_withhold_kind must lie in \[0, 1\), got 1"),
        (
            [*ok, "objective.router_withhold_kind=0.9"],
            r"objective.router_withhold_kind=0.9 needs objective.router_exit_weights=depth_label",
        ),
        ([*ok, "objective.router_kind_buckets=0"], r"objective.router_kind_buckets must be >= 1, got 0"),
        ([*ok, "objective.router_kind_decay=1"], r"objective.router_kind_decay must lie in \[0, 1\), got 1"),
        (
            [*ok, "objective.router_kind_buckets=64"],
            r"objective.router_kind_buckets=64 needs objective.router_withhold_kind > 0 \(the kinds' table\)$",
        ),
        (
            [*ok, "objective.router_kind_decay=0.5"],
            r"objective.router_kind_decay=0.5 needs objective.router_withhold_kind > 0",
        ),
        (
            [*ok, "objective.router_withhold_kind_only=true"],
            r"objective.router_withhold_kind_only=true needs objective.router_withhold_kind > 0",
        ),
        (
            [*ok, "objective.router_kind_gate=true"],
            r"objective.router_kind_gate=true needs objective.router_withhold_kind > 0",
        ),
        (
            [
                *ok,
                "objective.router_hard_weight=1",
                "objective.router_exit_weights=depth_label",
                "objective.router_withhold_kind=0.8",
                "objective.router_kind_gate=true",
            ],
            r"objective.router_kind_gate=true needs objective.router_hard_gate > 0 \(the gate the kinds' table opens\)$",
        ),
        (
            [*ok, "objective.router_hard_reference=routed"],
            r"objective.router_hard_reference=routed needs the hard-token target \(objective.router_hard_weight > 0\)$",
        ),
        ([*ok, "objective.router_hard_reference=exit"], r"objective.router_hard_reference"),
        ([*ok, "objective.router_hard_weight=-1"], r"objective.router_hard_weight must be >= 0, got -1"),
        (["objective.router_hard_weight=0.5"], r"objective.router_hard_weight=0.5 needs model.router_recipe=expected"),
        ([*ok, "objective.router_hard_weight=1", "objective.router_hard_ratio=0.5"], r"router_hard_ratio must be >= 1"),
        ([*ok, "objective.router_hard_bound=true"], r"router_hard_bound=true needs the hard-token target"),
        ([*ok, "objective.router_hard_ratio=2"], r"objective.router_hard_ratio=2.0 needs the hard-token target"),
        ([*ok, "model.router_forecast=true"], r"objective.router_hard_gate=0.0 with model.router_forecast=true"),
        ([*ok, "objective.router_hard_gate=0.9"], r"objective.router_hard_gate=0.9 with model.router_forecast=false"),
        ([*ok, "model.router_forecast=true", "objective.router_hard_gate=0.9"], r"router_hard_gate=0.9 needs the hard"),
        (["model.router_forecast=true"], r"model.router_forecast=true needs the expected router recipe"),
    ]
    for overrides, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            load_config("tiny/t-loopformer", overrides)
