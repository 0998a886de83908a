"""The documentation agrees with the program. Every `tlf ...` line in the code blocks of README.md, docs/**/*.md and
bench/README.md (and the tlf part of `deepspeed ... $(which tlf) train ...` / `torchrun ... $(which tlf) ...` /
`--module pipeline.train` lines) names subcommands and options that exist (Click's own parameters, as `--help`
shows them), presets and config keys that exist, and paths one command writes where the next reads them; the same
data set is prepared with the same options everywhere; a few cheap ones run for real, as written, in a fresh
directory. What the README states about the CLI is checked where it can be: the command table against `tlf --help`,
the counts of scales, variants, recipe presets and a sweep's stages, the scale and variant tables against the
configs. No documentation file narrates the order in which work was done."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import VARIANT_TABLE, VARIANTS, Config, field_docs, list_presets, load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "README.md"]
PLACEHOLDERS = {"CKPT", "CHECKPOINT", "CONFIG", "PRESET", "OVERRIDES", "DATA", "..."}
CONFIG_CMDS = {("train",), ("config", "show"), ("eval",), ("sweep",), ("plan",)}  # OVERRIDES: section.key=value
TAKES_PRESET = {("train",), ("config", "show"), ("plan",)}
READS_CHECKPOINT = {("eval",), ("ablate",), ("generate",), ("export",)}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def doc_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv after `tlf`) of every tlf command line in a markdown file's code blocks; continuation
    lines joined, comments and shell plumbing (`> f`, `&& ...`) dropped, `[--opt X]` read as `--opt X`."""
    lines, out, code, i = path.read_text().splitlines(), [], False, 0
    while i < len(lines):
        ln, no = lines[i], i + 1
        if ln.lstrip().startswith("```"):
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
                cut = next((k for k, t in enumerate(toks) if t in (">", "&&", "|", ";", "&")), len(toks))
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


def split(cmd: click.Command, argv: list[str], where: str) -> tuple[list[str], dict[str, str]]:
    """Checks every option against the command; returns the positional arguments and the options' values."""
    opts, pos, vals, it = options(cmd), [], {}, iter(argv)
    for tok in it:
        if tok.startswith("-") and tok not in ("-",) and not re.fullmatch(r"-?\d[\d.e-]*", tok):
            name, eq, val = tok.partition("=")
            assert name in opts, f"{where}: {name} is not an option of this command (its --help: {sorted(opts)})"
            p = opts[name]
            if p is not None and not p.is_flag and not p.count:
                vals[p.name] = val if eq else next(it, "")
        else:
            pos.append(tok)
    return pos, vals


def config_of(vals: dict[str, str], pos: list[str]) -> str:
    """The config a train/plan/config show line names: `--config CONFIG`, else its first positional argument."""
    return vals.get("config_opt") or (pos[0] if pos else "")


COMMANDS = [(path, no, argv) for path in DOCS for no, argv in doc_commands(path)]
KEYS = {k for k, *_ in field_docs(Config)} | set(load_config("tiny/t-loopformer").flat())
PRESETS = set(list_presets())


def test_the_docs_have_tlf_commands():
    names = {" ".join(resolve(a)[0]) for _, _, a in COMMANDS}
    assert {"train", "eval", "prep-data", "data inspect", "config show", "compare", "sweep", "generate"} <= names
    assert {"plan", "export", "ablate", "config list", "data fetch-assets"} <= names


@pytest.mark.parametrize("path,no,argv", COMMANDS, ids=[f"{rel(p)}:{no}" for p, no, _ in COMMANDS])
def test_doc_command_names_what_exists(path, no, argv):
    where = f"{rel(path)}:{no} `tlf {' '.join(argv)}`"
    cmd_path, cmd, rest = resolve(argv)
    pos, vals = split(cmd, rest, where)
    for preset in ([config_of(vals, pos)] if cmd_path in TAKES_PRESET else []) + [vals.get("check_preset", "")]:
        if preset and not preset.endswith((".yaml", ".yml")) and "$" not in preset:
            assert preset in PRESETS, f"{where}: no preset {preset!r}"
    if cmd_path == ("sweep",):
        assert any(p.startswith(pos[0] + "/") for p in PRESETS), f"{where}: no scale {pos[0]!r}"
    if cmd_path in CONFIG_CMDS:
        for tok in pos:
            key = tok.partition("=")[0]
            if "=" in tok and "." in key:
                assert key in KEYS, f"{where}: {key} is not a config key"


def _written_and_read():
    """(checkpoint dirs written by `tlf train`, data dirs written by `tlf prep-data`, [(where, kind, path) read]),
    over every documentation file together."""
    ckpts, data, reads = set(), {}, []
    for path, no, argv in COMMANDS:
        where = f"{rel(path)}:{no}"
        cmd_path, cmd, rest = resolve(argv)
        pos, vals = split(cmd, rest, where)
        kv = dict(t.split("=", 1) for t in pos if "=" in t)
        if cmd_path == ("train",):
            ckpts.add(kv.get("checkpoint.dir") or "checkpoints/" + config_of(vals, pos).replace("/", "-"))
            reads += [(where, "data", kv["data.dir"])] if "data.dir" in kv else []
        if cmd_path == ("prep-data",):
            data.setdefault(vals["out"], []).append((where, sorted(rest)))
        if cmd_path in READS_CHECKPOINT and pos and pos[0] not in PLACEHOLDERS and not pos[0].startswith("<"):
            reads.append((where, "checkpoint", pos[0]))
        if cmd_path == ("data", "inspect"):
            reads.append((where, "data", pos[0]))
        for t in rest:
            for d in re.findall(r"(?:ppl_dirs=\[|^)((?:data/[\w.-]+,?)+)\]?$", t):
                reads += [(where, "data", x) for x in d.split(",") if x]
    return ckpts, data, reads


def test_paths_one_command_writes_are_what_the_next_reads():
    ckpts, data, reads = _written_and_read()
    assert reads
    for where, kind, p in reads:
        if kind == "checkpoint" and p.startswith("checkpoints/"):
            assert p in ckpts, f"{where}: reads {p}, but the docs' `tlf train` lines write {sorted(ckpts)}"
        if kind == "data" and p not in PLACEHOLDERS:
            assert p in data, f"{where}: reads {p}, which no `tlf prep-data --out` in the docs writes"


def test_each_data_set_is_prepared_the_same_way_everywhere():
    _, data, _ = _written_and_read()
    for out, uses in data.items():
        assert len({tuple(a) for _, a in uses}) == 1, f"{out} is prepared differently at {[w for w, _ in uses]}"


def _run(argv: list[str]):
    r = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    return r.output


def test_cheap_doc_commands_run_as_written(tmp_path, monkeypatch):
    """`tlf data fetch-assets`, `tlf config list`, the `tlf config show` lines, then `tlf prep-data --source demo
    --out data/demo` and `tlf data inspect data/demo` in a fresh directory, exactly as the docs write them."""
    monkeypatch.chdir(tmp_path)
    runnable = [a for _, _, a in COMMANDS]
    cheap = [a for a in runnable if a[:2] in (["data", "fetch-assets"], ["config", "list"])]  # instant after set-up
    cheap += [a for a in runnable if a[:2] == ["config", "show"] and not a[2].endswith(".yaml")]
    cheap += [a for a in runnable if a[:1] == ["prep-data"] and "demo" in a and "data/demo" in a]
    cheap += [a for a in runnable if a[:2] == ["data", "inspect"] and a[2] == "data/demo"]
    assert len(cheap) >= 6, cheap
    for argv in dict.fromkeys(map(tuple, cheap)):
        out = _run(list(argv))
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


# ---------------------------------------------------------------------------------------------------------------
# What the README states about the CLI
# ---------------------------------------------------------------------------------------------------------------
def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def _table_rows(text: str, first: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header's first cell is `first`."""
    lines, rows, on = text.splitlines(), [], False
    for ln in lines:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")] if ln.startswith("|") else None
        if cells and cells[0] == first and not on:
            on = True
        elif on and cells is None:
            break
        elif on and not set(cells[0]) <= set("-: "):
            rows.append(cells)
    assert rows, f"no table headed {first!r}"
    return rows


def test_the_command_table_lists_every_command():
    rows = _table_rows(_section(README.read_text(), "Commands and where they are documented"), "command")
    listed = [re.fullmatch(r"`tlf ([\w-]+)`", r[0]).group(1) for r in rows]
    assert sorted(listed) == sorted(main.list_commands(click.Context(main))), "README's command table vs `tlf --help`"
    for r in rows:
        for target in re.findall(r"\]\(([^)#]+)", r[-1]):
            assert (ROOT / target).is_file(), f"README's command table links {target}, which does not exist"


NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}


def _stated(pattern: str) -> list[tuple[str, int]]:
    """(file, number) for every `<number> <pattern>` in README.md and docs/**/*.md (numbers as digits or words)."""
    out = []
    for path in DOCS[:-1]:
        text = " ".join(path.read_text().split())
        for m in re.finditer(rf"\b(\d+|{'|'.join(NUMBERS)}) {pattern}", text, flags=re.I):
            n = m.group(1).lower()
            out.append((rel(path), int(n) if n.isdigit() else NUMBERS[n]))
    return out


def test_counts_stated_in_the_docs_are_the_programs():
    scales = {p.split("/")[0] for p in PRESETS}
    recipe_presets = {p for p in PRESETS if p.split("/")[1] not in VARIANTS}
    sweep = _run(["sweep", "tiny", "--print"]).splitlines()
    counts = {
        r"scales\b": len(scales),
        r"variants\b(?! of the paper)": len(VARIANTS),
        r"recipe presets\b": len(recipe_presets),
        r"trainings\b": sum(ln.startswith("tlf train ") for ln in sweep),
        r"evaluations\b": sum(ln.startswith("tlf eval ") for ln in sweep),
    }
    assert _stated(r"scales\b") and _stated(r"variants\b") and _stated(r"trainings\b")
    for pattern, want in counts.items():
        for where, n in _stated(pattern):
            assert n == want, f"{where} states {n} {pattern.split(chr(92))[0]}; the program has {want}"


def test_the_scale_and_variant_tables_are_the_configs():
    text = _section(README.read_text(), "Presets")
    named = set()
    for cells in _table_rows(text, "scale"):
        scale = cells[0].strip("`")
        named.add(scale)
        assert scale in {p.split("/")[0] for p in PRESETS}, f"README's scale table: no scale {scale}"
        m = load_config(f"{scale}/base-loop")
        got = [m.model.d_model, m.model.n_heads, m.model.d_ff, f"{m.model.n_layers} × {m.model.loops}"]
        got += [m.model.block_size, m.train.global_batch_size]
        stated = [*cells[1:5], cells[5], cells[6].split()[0]]
        assert [str(x) for x in got] == stated, f"README's {scale} row {stated} vs the config {got}"
    assert named == {p.split("/")[0] for p in PRESETS}
    cond = {"none": "none", "time t": "time", "t and step Δ": "time_step"}
    rows = _table_rows(text, "variant")
    assert [c[0].strip("`") for c in rows] == list(VARIANTS)
    for name, _, conditioning, shortcut, router in rows:
        v = VARIANT_TABLE[name.strip("`")]
        assert (cond[conditioning], shortcut, router) == (
            v.conditioning,
            *("yes" if f else "no" for f in (v.shortcut, v.router)),
        ), f"README's {name} row"
    listed = set()
    for cells in _table_rows(text, "recipe preset"):
        recipe = re.match(r"`(\w+)`", cells[2]).group(1)
        for preset in re.findall(r"`([\w-]+/[\w-]+)`", cells[0]):
            assert preset in PRESETS, f"README's recipe presets: no preset {preset}"
            assert load_config(preset).objective.router.recipe == recipe, f"README's recipe presets: {preset}"
            listed.add(preset)
    assert listed == {p for p in PRESETS if p.split("/")[1] not in VARIANTS}, "README's recipe presets vs the configs"


# Words and forms that narrate the order in which work was done; documentation describes the software and its
# measured behaviour (git log keeps the history).
NARRATION = [
    r"\bsessions?\b",
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    r"fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(st|nd|rd|th)) (session|period|round of work)",
    r"\bwork periods?\b",
    r"\bissues? #?\d+",
    r"\b20\d\d-\d\d-\d\d\b",
    r"\ba week ago\b",
    r"\byesterday\b",
    r"\blast week\b",
    r"\blast stop\b",
    r"\bbefore this change\b",
    r"\bsince commit\b",
    r"\buntil this run\b",
    r"\bat that commit\b",
    r"\bwas first counted\b",
]


@pytest.mark.parametrize("path", DOCS, ids=[rel(p) for p in DOCS])
def test_no_document_narrates_the_order_of_the_work(path):
    hits = [
        f"{rel(path)}:{no}: {m.group(0)!r}"
        for no, ln in enumerate(path.read_text().splitlines(), 1)
        for m in [re.search("|".join(NARRATION), ln, flags=re.I)]
        if m
    ]
    assert not hits, "narration in documentation:\n" + "\n".join(hits)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=[rel(p) for p in DOCS])
def test_links_between_documents_resolve(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{rel(path)} links {target}: no such file"
        if anchor and dest.suffix == ".md":
            heads = {_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
            assert anchor in heads, f"{rel(path)} links {target}: no such heading in {rel(dest)}"


BENCH_HELPERS = {"interleave", "testkit"}  # used by the benchmarks and tests, not benchmarks themselves


def test_bench_readme_has_a_section_for_every_benchmark():
    text = (ROOT / "bench" / "README.md").read_text()
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    for stem in sorted(scripts - BENCH_HELPERS):
        assert f"## {stem}\n" in text or f"bench/{stem}.py" in text, f"bench/README.md says nothing of bench/{stem}.py"
    for stem in re.findall(r"^## (\S+)$", text, flags=re.M):
        assert stem in scripts, f"bench/README.md has a section '## {stem}' but no bench/{stem}.py"
