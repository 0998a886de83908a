"""The variant table: every variant name is checked against the flags that define it (README "Presets")."""

import pytest

from pipeline.config import VARIANT_TABLE, VARIANTS, ConfigError, load_config, trained_variant


@pytest.mark.parametrize(
    "name,override,key",
    [
        ("tiny/base-loop", "objective.shortcut=true", "objective.shortcut"),
        ("tiny/loopformer", "model.router=true", "model.router"),
        ("tiny/t-loopformer", "model.conditioning=time", "model.conditioning"),
        ("tiny/tmlt-ee", "objective.shortcut=false", "objective.shortcut"),
        ("tiny/base", "model.loops=2", "model.loops"),
        ("tiny/naive-loop-ee", "model.conditioning=time_step", "model.conditioning"),
    ],
)
def test_a_variant_name_that_contradicts_its_flags_is_a_one_line_error(name, override, key):
    with pytest.raises(ConfigError) as e:
        load_config(name, [override])
    msg = str(e.value)
    assert msg.count("\n") == 0 and f"{key}:" in msg and "contradicts model.variant=" in msg


def test_renaming_a_variant_needs_its_flags():
    load_config("tiny/base-loop", ["model.variant=naive-loop-ee"])  # same flags: the same model
    with pytest.raises(ConfigError, match="model.conditioning: none contradicts model.variant=loopformer"):
        load_config("tiny/base-loop", ["model.variant=loopformer"])


def test_the_table_is_the_variant_list_and_naive_loop_ee_trains_as_base_loop():
    assert VARIANTS == tuple(VARIANT_TABLE) and len(VARIANTS) == 9
    assert trained_variant("naive-loop-ee") == "base-loop" and VARIANT_TABLE["naive-loop-ee"].early_exit
    assert [v for v in VARIANTS if trained_variant(v) != v] == ["naive-loop-ee"]
    a, b = VARIANT_TABLE["naive-loop-ee"], VARIANT_TABLE["base-loop"]
    assert (a.looped, a.conditioning, a.shortcut, a.router) == (b.looped, b.conditioning, b.shortcut, b.router)
