"""Every option of every `tlf` command, read from click's own description of the commands (`pipeline.cli.main`, the
`tlf.commands` entry points resolved through its `list_commands` / `get_command`): each option of a numeric,
ranged, choice or custom type gets the bad values its type implies (below its minimum, above its maximum, nan, inf,
a word, an empty string; for a list: empty, an empty item, a duplicate, a bad item) and each one, given to the real
command in process, must be a usage error (exit 2) naming the option, without a traceback. A numeric option
without bounds, or of a type this walk does not know, fails the test; flags and free strings (paths, names) are
listed as such. Click checks option types before a command's callback runs, so nothing here loads a model: the
checks that need a checkpoint's L (`--loops`) have their own tests, on a tiny checkpoint whose weights must not
be read."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from data_prep.clitypes import CommaList, Device, IntOrZero, KeyedList, KeyValue, ShellWords
from pipeline.cli import main

NUMBERS = (click.IntRange, click.FloatRange)
FREE = (click.types.StringParamType, click.Path)  # names, paths, URIs, presets: any string is for the command
MIN_COVERED = (
    45  # options with bad values tried (45 of 87 options, in 13 commands): a floor, so a walk that loses some fails
)


def commands(group: click.Group = main, path: tuple[str, ...] = ()):
    """(argv path, command) of every leaf command under group, as `tlf --help` lists them."""
    ctx = click.Context(group, info_name="tlf")
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = dict(commands())
OPTIONS = [
    (path, p) for path, cmd in COMMANDS.items() for p in cmd.params if isinstance(p, click.Option) and p.name != "help"
]


def kind(p: click.Option) -> str:
    """flag, free (a string the command reads as it likes), checked (bad values come from its type), or why the
    option is not acceptable: an unbounded number or an unknown type."""
    t = p.type
    if p.is_flag or isinstance(t, click.types.BoolParamType):
        return "flag"
    if isinstance(t, click.Path) and t.exists:
        return "checked"
    if isinstance(t, NUMBERS):
        return "checked" if t.min is not None or t.max is not None else "unbounded number"
    if isinstance(t, (click.types.IntParamType, click.types.FloatParamType)):
        return "unbounded number"
    if isinstance(t, (click.Choice, CommaList, KeyedList, KeyValue, ShellWords, Device)):
        return "checked"
    if isinstance(t, FREE):
        return "free"
    return f"unknown type {t!r}"


def good(t: click.ParamType) -> str:
    """A value of type t (a list's item)."""
    if isinstance(t, click.Choice):
        return str(t.choices[0])
    if t.min is not None and t.max is not None:
        return str((t.min + t.max) / 2 if isinstance(t, click.FloatRange) else t.min + int(t.min_open))
    return str(t.min + 1 if t.min is not None else t.max - 1)


def _numbers(t) -> list[str]:
    integer = isinstance(t, click.IntRange)
    step = 1 if integer else 0.5
    out = ["abc", "", "nan"] + (["1.5"] if integer else ["inf", "-inf"])
    if t.min is not None:
        out.append(str(t.min if t.min_open else t.min - step))
    if isinstance(t, IntOrZero):  # 0 stands for off: -1 is below it, min - 1 between them
        out = [v for v in out if v != "0"] + ["-1"] + ([str(t.min - 1)] if t.min > 1 else [])
    if t.max is not None:
        out.append(str(t.max if t.max_open else t.max + step))
    return out


def bad(t: click.ParamType, tmp) -> list[str]:
    """The bad values type t implies."""
    if isinstance(t, click.Path):
        return [str(tmp / "no-such-path")]
    if isinstance(t, NUMBERS):
        return _numbers(t)
    if isinstance(t, click.Choice):
        return ["no-such-choice", ""]
    if isinstance(t, CommaList):
        item = good(t.item)
        out = ["", ",", f"{item},", f",{item}"] + [f"{item},{b}" for b in bad(t.item, tmp) if b and "," not in b]
        return out + ([f"{item},{item}"] if t.distinct else [])
    if isinstance(t, KeyedList):
        out = ["", "nokey=1", "=1", "no-equals"]
        return out + [f"{k}={b}" for k, lst in t.keys.items() for b in bad(lst, tmp)]
    if isinstance(t, KeyValue):
        return ["no-equals", "=value", ""]
    if isinstance(t, ShellWords):
        return ['"unclosed', "it's", "trailing\\"]
    if isinstance(t, Device):
        return ["gpu", "cuda:x", "cuda:", ""]
    raise AssertionError(f"no bad values for {t!r}")


def positional(cmd: click.Command, tmp) -> list[str]:
    """Arguments that get the command to its options: an existing path, a choice, or a word."""
    out = []
    for a in cmd.params:
        if isinstance(a, click.Argument) and a.required and a.nargs == 1:
            out.append(str(a.type.choices[0]) if isinstance(a.type, click.Choice) else str(tmp))
    return out


def test_every_option_is_a_flag_a_free_string_or_checked():
    kinds = {f"tlf {' '.join(path)} {p.opts[0]}": kind(p) for path, p in OPTIONS}
    wrong = {k: v for k, v in kinds.items() if v not in ("flag", "free", "checked")}
    assert not wrong, wrong
    checked = [k for k, v in kinds.items() if v == "checked"]
    assert len(checked) >= MIN_COVERED and len(COMMANDS) >= 12, (len(checked), len(COMMANDS))


def test_an_unbounded_number_or_an_unknown_type_is_caught():
    """The walk is no formality: a plain int or float option, or a type it has no bad values for, fails it."""

    class Odd(click.ParamType):
        name = "odd"

    assert kind(click.Option(["--n"], type=int)) == "unbounded number"
    assert kind(click.Option(["--x"], type=float)) == "unbounded number"
    assert kind(click.Option(["--y"], type=click.FloatRange())) == "unbounded number"
    assert kind(click.Option(["--z"], type=Odd())).startswith("unknown type")


CHECKED = [(path, p) for path, p in OPTIONS if kind(p) == "checked"]


@pytest.mark.parametrize("path,option", CHECKED, ids=[f"{' '.join(path)} {p.opts[0]}" for path, p in CHECKED])
def test_a_bad_value_is_a_usage_error_naming_the_option(path, option, tmp_path):
    """Each bad value, given first so click reads it before anything else, exits 2 with one error naming the
    option (its long name, as click writes `Invalid value for '--loops'`), never a traceback."""
    name = next(o for o in option.opts if o.startswith("--"))
    args = positional(COMMANDS[path], tmp_path)
    for value in bad(option.type, tmp_path):
        r = CliRunner().invoke(main, [*path, f"{name}={value}", *args])
        said = f"tlf {' '.join(path)} {name}={value!r}: exit {r.exit_code}\n{r.output}"
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), said
        assert "Traceback" not in r.output and f"'{name}'" in r.output, said
        assert sum(ln.startswith("Error:") for ln in r.output.splitlines()) == 1, said


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_default_is_a_value_of_its_own_type(path, tmp_path):
    """The command line with only what is required parses (click converts each default through its type)."""
    cmd = COMMANDS[path]
    required = [x for p in cmd.params if isinstance(p, click.Option) and p.required for x in (p.opts[0], "x")]
    ctx = cmd.make_context(path[-1], [*positional(cmd, tmp_path), *required])
    assert set(ctx.params) == {p.name for p in cmd.params}


TINY = [
    "model.vocab_size=512",
    "model.block_size=32",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.n_layers=1",
    "model.loops=3",
    "model.fourier_dim=16",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny t-loopformer export, L = 3."""
    from pipeline.config import load_config
    from pipeline.model.io import save_model
    from pipeline.model.looped import LoopedLM

    cfg = load_config("tiny/t-loopformer", TINY)
    d = tmp_path_factory.mktemp("cli") / "model"
    save_model(d, LoopedLM(cfg.model), cfg)
    return d


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "{ck}", "-p", "hi", "--loops", "4"],
        ["eval", "{ck}", "--loops", "1,4", "--tasks", "none", "--no-mlflow"],
        ["ablate", "{ck}", "--loops", "4", "--out", "{out}"],
    ],
    ids=lambda a: a[0],
)
def test_loops_above_L_is_refused_before_the_weights_are_read(argv, ckpt, tmp_path, monkeypatch):
    from pipeline.model import io

    def no_weights(*a, **k):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(io, "load_state", no_weights)
    r = CliRunner().invoke(main, [a.format(ck=ckpt, out=tmp_path / "o") for a in argv])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("Error:"))
    assert "'--loops'" in line and "loop budget 4" in line and "model.loops=3" in line and "1..3" in line, line


@pytest.mark.parametrize(
    "text", ["[]", '{"budgets": 5}', '{"budgets": [5]}', '{"budgets": [{"tasks": {}}]}', '{"budgets": [], "model": 7}']
)
def test_compare_on_a_results_json_that_is_not_one_is_one_line(text, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(text)
    r = CliRunner().invoke(main, ["compare", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "Traceback" not in r.output and r.exception.__class__ is SystemExit, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "results.json" in errors[0] and "not a tlf results file" in errors[0], r.output


def test_eval_options_become_overrides():
    """--tasks none is eval.tasks=[]; a list keeps its order; unset options leave the config alone."""
    from evaluation.cli import option_overrides

    none = dict.fromkeys(
        "limit batch_size source race_file ppl_tokens stride no_ppl no_latency no_mlflow strict no_progress "
        "out_dir".split()
    )
    assert option_overrides(tasks=(), **none) == ["eval.tasks=[]"]
    assert option_overrides(tasks=("piqa", "copa"), **{**none, "limit": 0}) == [
        "eval.tasks=[piqa,copa]",
        "eval.limit=0",
    ]
    assert option_overrides(tasks=None, **none) == []
    assert option_overrides(tasks=None, **{**none, "out_dir": 'a "b"'}) == ['eval.out_dir="a \\"b\\""']
