"""Every config key states its range where it is declared (`f(default, doc, gt=..., ...)`), and a value outside it is
a one-line error naming the key, from every source. The keys come from the declarations, never a hand list: the run
config's (`field_docs(Config)`: every section, every router recipe's own keys), PrepConfig's. Each key gets the
values just outside its declared range (below ge, at gt, above le, at lt, nan and inf for floats), a value of the
wrong type, and list values with a repeat or an element out of range; each must fail through the real `tlf` entry
point (click's CliRunner, in process) with exit status 2 and one line naming the key; the bounds themselves pass.
Then: a key given twice in one YAML file or on one command line, `inherit:` naming nothing, a file that is not
UTF-8, an empty or doubled CONFIG."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from click.testing import CliRunner

from data_prep.config import PrepConfig
from data_prep.configlib import ConfigError, Range, describe_range, f, range_of, set_key
from pipeline.cli import main
from pipeline.config import Config, config_from_dict, field_docs, list_presets, load_config

BASE = "tiny/t-loopformer"
MIN_KEYS = 120  # the run config's keys (every recipe's counted once per recipe) and PrepConfig's: about 135


# ---------------------------------------------------------------------------------------- the keys, declared
@dataclass(frozen=True)
class Key:
    """A config key as declared: its dotted name, the recipe whose key it is ('' for the others), its type, range
    and default."""

    name: str
    recipe: str
    tp: Any
    range: Range
    default: Any


def declared(root: type, name: str, recipe: str) -> Key:
    """The declaration of dotted key `name` of config class root (a choice section read as `recipe`'s class)."""
    cls, (*path, last) = root, name.split(".")
    for part in path:
        cls = typing.get_type_hints(cls)[part]
        if getattr(cls, "CHOICE", None) and recipe:
            cls = cls.choices()[recipe]
    fl = {x.name: x for x in dataclasses.fields(cls)}[last]
    default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
    tp = typing.get_type_hints(cls)[last]
    return Key(name, recipe, tp, range_of(fl), default)


def run_keys() -> list[Key]:
    """Every key of the run config: `field_docs(Config)`'s rows, a recipe's own keys once per recipe."""
    out = []
    for name, _tp, _default, doc in field_docs(Config):
        recipe = doc[1 : doc.index("]")] if name.startswith("objective.router.") and doc.startswith("[") else ""
        out.append(declared(Config, name, recipe))
    return out


def prep_keys() -> list[Key]:
    return [declared(PrepConfig, name, "") for name, *_ in field_docs(PrepConfig)]


RUN, PREP = run_keys(), prep_keys()


def undeclared(keys: list[Key]) -> list[str]:
    """The keys whose declaration does not say what range they take: a number without a bound or unbounded=True, a
    list without its elements' type (items=)."""
    bad = [k.name for k in keys if k.tp in (int, float) and not (k.range.bounded or k.range.unbounded)]
    return bad + [k.name for k in keys if k.tp is list and k.range.items is None]


def test_every_number_and_list_key_declares_its_range():
    assert undeclared(RUN + PREP) == []
    for k in RUN + PREP:  # and every default lies in it
        assert k.range.problem(k.default) is None, (k.name, k.default, k.range)


def test_a_new_number_key_without_a_range_is_caught():
    @dataclass
    class New:
        steps: int = f(3, "A count that says nothing of its range.")
        scale: float = f(1.0, "Any finite value.", unbounded=True)
        names: list = f([], "Names.")

    keys = [declared(New, fl.name, "") for fl in dataclasses.fields(New)]
    assert undeclared(keys) == ["steps", "names"]
    assert describe_range(float, keys[1].range) == "float, any finite"
    with pytest.raises(ValueError, match="unbounded=True with a bound"):
        f(1, "x", ge=0, unbounded=True)


# ---------------------------------------------------------------------------------------- values outside
def outside(k: Key) -> list[str]:
    """YAML texts of values k's declaration refuses: past each bound, nan and inf (finite floats), the wrong type,
    an empty value (nonempty), a repeat (unique), an element of the wrong type or out of its range (lists)."""
    r, tp = k.range, k.tp
    if typing.get_origin(tp) is Literal:
        return ["not-a-choice", "5"]
    if tp is bool:
        return ["maybe", "3"]
    if tp is str:
        return ["5", "[a]"] + (["''"] if r.nonempty else [])
    if tp is list:
        return ["5", "abc"] + list_outside(r)
    step = 1 if tp is int else 0.5
    vals = [r.ge - step if r.ge is not None else None, r.gt, r.le + step if r.le is not None else None, r.lt]
    out = [repr(v) for v in vals if v is not None] + ["abc", "[1]", "true"]
    return out + ([".nan", ".inf", "-.inf"] if tp is float and r.finite else []) + (["1.5"] if tp is int else [])


def list_outside(r: Range) -> list[str]:
    """A list's refused values: an element of the other type, a repeat, an element past its bounds."""
    items = r.items
    ok = inside_item(items.type, items.range)
    out = ["[[1, 2]]"] if items.type is str else ["[abc]"]
    out += [f"[{ok}, {ok}]"] if r.unique else []
    out += ["[]"] if r.nonempty else []
    out += [f"[{v}]" for v in outside(Key("", "", items.type, items.range, None)) if _is_number_text(v)]
    return out


def _is_number_text(text: str) -> bool:
    v = yaml.safe_load(text)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def inside_item(tp: type, r: Range) -> str:
    if tp is str:
        return "a"
    return repr(inside(Key("", "", tp, r, None))[0])


def inside(k: Key) -> list:
    """Values at k's bounds that its range takes: ge and le themselves, just inside gt and lt."""
    r, step = k.range, (1 if k.tp is int else 1e-6)
    vals = [r.ge, r.le, None if r.gt is None else r.gt + step, None if r.lt is None else r.lt - step]
    return [v for v in vals if v is not None]


def recipe_presets() -> dict[str, str]:
    """A preset of each router recipe (the recipe's keys are set on top of it)."""
    return {load_config(p).objective.router.recipe: p for p in reversed(list_presets())}


PRESETS = recipe_presets()


def config_show(k: Key, text: str) -> list[str]:
    """`tlf config show` of a preset with `k=text` (a recipe's key after the recipe, first on the line)."""
    lead = [f"objective.router.recipe={k.recipe}"] if k.recipe else []
    return ["config", "show", PRESETS[k.recipe] if k.recipe else BASE, *lead, f"{k.name}={text}"]


def refused(argv: list[str], key: str, where: str) -> None:
    """argv exits 2 with one error line, no traceback, naming the key and where the value came from."""
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2 and "Traceback" not in r.output, (argv, r.output)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and f"'{key}'" in errors[0] and where in errors[0], (argv, r.output)


def test_values_outside_a_run_config_keys_range_are_one_line_errors_naming_it():
    cases = [(k, text) for k in RUN for text in outside(k)]
    for k, text in cases:
        refused(config_show(k, text), k.name, "command line")
    numbers = [k for k in RUN if k.tp in (int, float)]
    print(f"{len(RUN)} run-config keys ({len(numbers)} numbers), {len(cases)} refused values")
    assert len(RUN) + len(PREP) > MIN_KEYS and len(numbers) > 40 and len(cases) > 4 * len(RUN)


def test_a_run_config_keys_bounds_pass():
    for k in RUN:
        for v in inside(k):
            cfg = Config()
            if k.recipe:
                set_key(cfg, "objective.router.recipe", k.recipe, "test")
            set_key(cfg, k.name, v, "test")
            got = cfg
            for part in k.name.split("."):
                got = getattr(got, part)
            assert got == v, (k.name, v, got)


def test_out_of_range_values_are_refused_from_a_file_and_a_stored_config(tmp_path):
    """The same check on every source: a YAML file (`tlf config show FILE`) and a stored config (a checkpoint's or
    an export's, `config_from_dict`)."""
    y = tmp_path / "run.yaml"
    for k in RUN:
        text = outside(k)[0]
        lead = f"objective.router.recipe: {k.recipe}\n" if k.recipe else ""
        y.write_text(f"inherit: {PRESETS[k.recipe] if k.recipe else BASE}\n{lead}{k.name}: {text}\n")
        refused(["config", "show", str(y)], k.name, str(y))
        stored: dict = {"objective": {"router": {"recipe": k.recipe or "paper"}}}  # (no upgrade of the router)
        *path, last = k.name.split(".")
        leaf = stored
        for part in path:
            leaf = leaf.setdefault(part, {})
        leaf[last] = yaml.safe_load(text)
        with pytest.raises(ConfigError, match=rf"^ck/config.yaml: '{k.name}' "):
            config_from_dict(stored, "ck/config.yaml")


def test_values_outside_a_prep_keys_range_fail_before_any_work(tmp_path):
    out = tmp_path / "out"
    n = 0
    for k in PREP:
        for text in outside(k):
            refused(["prep-data", "--source", "demo", "--out", str(out), f"{k.name}={text}"], k.name, "command line")
            n += 1
        for v in inside(k):
            set_key(PrepConfig(), k.name, v, "test")
    print(f"{len(PREP)} prep-data keys, {n} refused values")
    assert not out.exists() and n > 3 * len(PREP)
    y = tmp_path / "prep.yaml"
    y.write_text("source: demo\nshard_tokens: 0\n")
    refused(["prep-data", "--config", str(y), "--out", str(out)], "shard_tokens", "prep.yaml")
    r = CliRunner().invoke(main, ["prep-data", "--source", "demo", "--out", str(out), "--workers", "-2"])
    assert r.exit_code == 2 and "workers" in r.output and "Traceback" not in r.output, r.output  # click's or ours
    assert not out.exists()


def test_messages_name_the_range():
    cases = {
        "optim.lr=-1": "'optim.lr' must be > 0, got -1.0",
        "optim.lr=nan": "'optim.lr' must be a finite number > 0, got nan",
        "optim.beta1=1.5": "'optim.beta1' must be in [0, 1), got 1.5",
        "train.seed=-1": "'train.seed' must be in [0, 4294967295], got -1",
        "eval.loops=[1,1]": "'eval.loops' must list each element once, got 1 twice in [1, 1]",
        "eval.loops=[0]": "'eval.loops' elements must be >= 1, got 0 in [0]",
        "eval.loops=3": "'eval.loops' expects list of int, got 3",
    }
    for item, want in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(BASE, [item])
        assert str(e.value) == f"command line ({item}): {want}"
    r = CliRunner().invoke(main, ["config", "show", BASE, "--doc"])
    assert "optim.lr = 0.003  (float, > 0)  #" in r.output
    assert "eval.loops = []  (list of int, distinct, each >= 1)  #" in r.output
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    assert "| `optim.beta1` | float, in [0, 1) | `0.9` |" in doc


def test_a_cross_key_rule_names_both_keys():
    with pytest.raises(ConfigError, match=r"eval.ppl_context=65 exceeds model.block_size=64"):
        load_config(BASE, ["eval.ppl_context=65"])
    assert load_config(BASE, ["eval.ppl_context=64"]).eval.ppl_context == 64
    with pytest.raises(ConfigError, match=r"eval.loops: budget 5 must be an integer in 1..model.loops \(4\)"):
        load_config(BASE, ["eval.loops=[5]"])


# ---------------------------------------------------------------------------------------- keys given twice
@pytest.mark.parametrize(
    "text,key,lines",
    [
        ("optim:\n  lr: 0.1\n  beta1: 0.5\n  lr: 0.2\n", "optim.lr", (3, 5)),
        ("optim:\n  lr: 0.1\nmodel:\n  loops: 3\noptim:\n  beta1: 0.5\n", "optim", (2, 6)),
        ("optim.lr: 0.1\nmodel:\n  loops: 3\noptim: {lr: 2}\n", "optim.lr", (2, 5)),
        ("objective.router: {recipe: paper}\nobjective:\n  router:\n    recipe: paper\n", "objective.router", (2, 4)),
    ],
)
def test_a_key_given_twice_in_a_file_names_both_lines(tmp_path, text, key, lines):
    y = tmp_path / "cfg.yaml"
    y.write_text(f"inherit: {BASE}\n{text}")
    with pytest.raises(ConfigError) as e:
        load_config(str(y))
    assert str(e.value) == f"{y}: '{key}' given twice (line {lines[0]} and line {lines[1]})"
    refused(["config", "show", str(y)], key, f"line {lines[0]} and line {lines[1]}")


def test_later_still_wins_across_files_and_over_a_file(tmp_path):
    """What inherit: and overrides are for: a file over the files it inherits, the command line over the file."""
    (tmp_path / "a.yaml").write_text(f"inherit: {BASE}\noptim:\n  lr: 0.1\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\noptim.lr: 0.2\n")
    assert load_config(str(tmp_path / "b.yaml")).optim.lr == 0.2
    assert load_config(str(tmp_path / "b.yaml"), ["optim.lr=0.3"]).optim.lr == 0.3
    anchors = tmp_path / "c.yaml"  # an anchor and its alias are one value, not a key given twice
    anchors.write_text(f"inherit: {BASE}\ndata:\n  extra_val_dirs: &d [x]\neval:\n  ppl_dirs: *d\n")
    assert load_config(str(anchors)).eval.ppl_dirs == ["x"]


def test_a_key_given_twice_on_one_command_line_is_an_error(tmp_path):
    refused(["config", "show", BASE, "optim.lr=0.1", "optim.lr=0.2"], "optim.lr", "optim.lr=0.1 and optim.lr=0.2")
    refused(["config", "show", BASE, "optim.lr=0.1", "optim={lr: 0.2}"], "optim.lr", "given twice")
    refused(["prep-data", "--source", "demo", "--out", str(tmp_path / "o"), "seed=1", "seed=2"], "seed", "twice")
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["config", "show", "--config", BASE, "--config", "tiny/base"])
    assert r.exit_code == 2 and f"--config given 2 times ({BASE}, tiny/base); give one" in r.output, r.output
    r = CliRunner().invoke(
        main, ["prep-data", "--config", "a.yaml", "--config", "b.yaml", "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 2 and "--config given 2 times (a.yaml, b.yaml); give one" in r.output, r.output
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------- inherit, empty, UTF-8
@pytest.mark.parametrize("value", ["", "null", "''", "[]", "[tiny/t-loopformer, '']", "[tiny/t-loopformer, 5]"])
def test_an_inherit_that_names_nothing_is_an_error_naming_the_file(tmp_path, value):
    y = tmp_path / "run.yaml"
    y.write_text(f"inherit: {value}\noptim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(y))}: inherit: "):
        load_config(str(y))


def test_an_empty_config_name_is_a_usage_error():
    for argv in (["config", "show", ""], ["config", "show", "--config", " "], ["train", ""], ["plan", ""]):
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 2 and "names nothing" in r.output and "Traceback" not in r.output, (argv, r.output)
    with pytest.raises(ConfigError, match="names nothing"):
        load_config("")


def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    y = tmp_path / "latin1.yaml"
    y.write_bytes(f"inherit: {BASE}\n# caf\xe9\n".encode("latin-1"))
    want = "not UTF-8 text (byte 0xe9 at offset"
    for argv in (["config", "show", str(y)], ["train", "--config", str(y)]):
        r = CliRunner().invoke(main, argv)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert r.exit_code == 2 and len(errors) == 1 and str(y) in errors[0] and want in errors[0], r.output
    p = tmp_path / "prep.yaml"
    p.write_bytes("source: d\xe9mo\n".encode("latin-1"))
    r = CliRunner().invoke(main, ["prep-data", "--config", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and f"{p}: {want}" in r.output and not (tmp_path / "o").exists(), r.output
