"""The README's command lines agree with the program: every `tlf ...` line in its code blocks (and the tlf part of
its `deepspeed ... $(which tlf) train ...` / `--module pipeline.train` lines) names subcommands and options that
exist (Click's own parameters, as `--help` shows them), presets and config keys that exist, and paths one command
writes where the next reads them; the same data set is prepared with the same options everywhere; a few cheap ones
run for real, as written, in a fresh directory."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import list_presets, load_config

README = Path(__file__).resolve().parent.parent / "README.md"
PLACEHOLDERS = {"CKPT", "CHECKPOINT", "CONFIG", "PRESET", "OVERRIDES", "..."}
CONFIG_CMDS = {("train",), ("config", "show"), ("eval",), ("sweep",)}  # OVERRIDES are section.key=value of Config
READS_CHECKPOINT = {("eval",), ("ablate",), ("generate",), ("export",)}


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line number, argv after `tlf`) of every tlf command line in the README's code blocks; continuation lines
    joined, comments and shell plumbing (`> f`, `&& ...`) dropped, `[--opt X]` read as `--opt X`."""
    lines, out, code, i = README.read_text().splitlines(), [], False, 0
    while i < len(lines):
        ln, no = lines[i], i + 1
        if ln.startswith("```"):
            code = not code
        elif code:
            while ln.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                ln = ln.rstrip()[:-1] + " " + lines[i].strip()
            ln = re.sub(r"\[(--[^\]]*)\]", r"\1", ln)
            m = (
                re.match(r"\s*tlf\s+(.*)", ln)
                or re.search(r"\$\(which tlf\)\s+(.*)", ln)
                or re.search(r"--module pipeline\.train\s+(.*)", ln)
            )
            if m:
                toks = shlex.split(m.group(1), comments=True)
                cut = next((k for k, t in enumerate(toks) if t in (">", "&&", "|", ";")), len(toks))
                out.append((no, (["train"] if "--module pipeline.train" in ln else []) + toks[:cut]))
        i += 1
    return out


def resolve(argv: list[str]) -> tuple[tuple[str, ...], click.Command, list[str]]:
    cmd, path = main, []
    while isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        assert argv and argv[0] in cmd.list_commands(ctx), f"`tlf {' '.join(path + argv[:1])}`: no such subcommand"
        path.append(argv[0])
        cmd, argv = cmd.get_command(ctx, argv[0]), argv[1:]
    return tuple(path), cmd, argv


def options(cmd: click.Command) -> dict[str, click.Option]:
    """Every option name the command's --help lists (hidden ones excluded), with --help itself."""
    opts = {n: p for p in cmd.params if isinstance(p, click.Option) and not p.hidden for n in p.opts + p.secondary_opts}
    return {**opts, "--help": None, "-h": None}


def split(cmd: click.Command, argv: list[str], where: str) -> list[str]:
    """Checks every option against the command; returns the positional arguments."""
    opts, pos, it = options(cmd), [], iter(argv)
    for tok in it:
        if tok.startswith("-") and tok not in ("-",) and not re.fullmatch(r"-?\d[\d.e-]*", tok):
            name, eq, _ = tok.partition("=")
            assert name in opts, f"{where}: {name} is not an option of this command (its --help: {sorted(opts)})"
            p = opts[name]
            if p is not None and not p.is_flag and not p.count and not eq:
                next(it, None)
        else:
            pos.append(tok)
    return pos


COMMANDS = readme_commands()
KEYS = set(load_config("tiny/t-loopformer").flat())


def test_the_readme_has_tlf_commands():
    names = {" ".join(resolve(a)[0]) for _, a in COMMANDS}
    assert {"train", "eval", "prep-data", "data inspect", "config show", "compare", "sweep", "generate"} <= names


@pytest.mark.parametrize("no,argv", COMMANDS, ids=[f"L{no}" for no, _ in COMMANDS])
def test_readme_command_names_what_exists(no, argv):
    where = f"README.md:{no} `tlf {' '.join(argv)}`"
    path, cmd, rest = resolve(argv)
    pos = split(cmd, rest, where)
    presets = set(list_presets())
    if path in (("train",), ("config", "show")) and not pos[0].endswith((".yaml", ".yml")):
        assert pos[0] in presets, f"{where}: no preset {pos[0]!r}"
    if path == ("sweep",):
        assert any(p.startswith(pos[0] + "/") for p in presets), f"{where}: no scale {pos[0]!r}"
    if path in CONFIG_CMDS:
        for tok in pos:
            key = tok.partition("=")[0]
            if "=" in tok and "." in key:
                assert key in KEYS, f"{where}: {key} is not a config key"


def _written_and_read():
    """(checkpoint dirs written by `tlf train`, data dirs written by `tlf prep-data`, [(line, kind, path) read])."""
    ckpts, data, reads = set(), {}, []
    for no, argv in COMMANDS:
        path, cmd, rest = resolve(argv)
        pos = split(cmd, rest, str(no))
        kv = dict(t.split("=", 1) for t in pos if "=" in t)
        if path == ("train",):
            ckpts.add(kv.get("checkpoint.dir") or "checkpoints/" + pos[0].replace("/", "-"))
            reads += [(no, "data", kv["data.dir"])] if "data.dir" in kv else []
        if path == ("prep-data",):
            out = rest[rest.index("--out") + 1]
            data.setdefault(out, []).append((no, sorted(rest)))
        if path in READS_CHECKPOINT and pos and pos[0] not in PLACEHOLDERS and not pos[0].startswith("<"):
            reads.append((no, "checkpoint", pos[0]))
        if path == ("data", "inspect"):
            reads.append((no, "data", pos[0]))
        for t in rest:
            for d in re.findall(r"(?:ppl_dirs=\[|^)((?:data/[\w.-]+,?)+)\]?$", t):
                reads += [(no, "data", x) for x in d.split(",") if x]
    return ckpts, data, reads


def test_paths_one_command_writes_are_what_the_next_reads():
    ckpts, data, reads = _written_and_read()
    assert reads
    for no, kind, p in reads:
        if kind == "checkpoint" and p.startswith("checkpoints/"):
            assert p in ckpts, f"README.md:{no}: reads {p}, but the README's `tlf train` lines write {sorted(ckpts)}"
        if kind == "data":
            assert p in data, f"README.md:{no}: reads {p}, which no `tlf prep-data --out` in the README writes"


def test_each_data_set_is_prepared_the_same_way_everywhere():
    _, data, _ = _written_and_read()
    for out, uses in data.items():
        assert len({tuple(a) for _, a in uses}) == 1, (
            f"{out} is prepared differently at README lines {[n for n, _ in uses]}"
        )


def _run(argv: list[str]):
    r = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    return r.output


def test_cheap_readme_commands_run_as_written(tmp_path, monkeypatch):
    """`tlf data fetch-assets`, the `tlf config show` lines, then `tlf prep-data --source demo --out data/demo` and
    `tlf data inspect data/demo` in a fresh directory, exactly as the README writes them."""
    monkeypatch.chdir(tmp_path)
    cheap = [a for _, a in COMMANDS if a[:2] == ["data", "fetch-assets"]]  # instant once `make assets` ran
    cheap += [a for _, a in COMMANDS if a[:2] == ["config", "show"] and not a[2].endswith(".yaml")]
    cheap += [a for _, a in COMMANDS if a[:1] == ["prep-data"] and "demo" in a and "data/demo" in a]
    cheap += [a for _, a in COMMANDS if a[:2] == ["data", "inspect"]]
    assert len(cheap) >= 5, cheap
    for argv in cheap:
        out = _run(argv)
        if "--doc" in argv:
            assert "model.loops =" in out
    assert (tmp_path / "data" / "demo" / "manifest.json").is_file()


def _commands(cmd=main, path=()):
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _commands(cmd.get_command(ctx, name), path + (name,))
    else:
        yield path, cmd


def test_help_texts_agree_across_commands():
    from pipeline.device import DEVICE_HELP

    with_device = {p: o for p, c in _commands() for n, o in options(c).items() if n == "--device"}
    assert set(with_device) >= {("eval",), ("ablate",), ("generate",)}
    assert {(o.default, o.help) for o in with_device.values()} == {("auto", DEVICE_HELP)}
    # --config is the command's config wherever it is shown (a YAML file of options for prep-data; a preset or
    # YAML file, as the positional CONFIG, for the others), never something else
    shown = {p: options(c)["--config"] for p, c in _commands() if "--config" in options(c)}
    assert set(shown) == {("prep-data",), ("train",), ("plan",), ("config", "show")}
    assert all("YAML file" in o.help for o in shown.values())
    assert "tlf config show PRESET --doc" in _run(["train", "--help"])
