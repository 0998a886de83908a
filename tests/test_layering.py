"""Dependencies run one way: data_prep <- pipeline <- evaluation <- bench (README "Layout").

Every `import` / `from ... import` in the four packages (module level or inside a function) may name its own
package or one to its left only. Bench scripts import each other by bare name (`from interleave import ...`,
run as scripts with bench/ on sys.path): those count as bench. A module named in a string (`importlib`) counts
too. There is no exception: `tlf`'s subcommands register themselves as `tlf.commands` entry points (setup.py),
which the `tlf` command loads without naming their packages.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("data_prep", "pipeline", "evaluation", "bench")
BENCH_SCRIPTS = {p.stem for p in (ROOT / "bench").glob("*.py")}
MODULE_STRING = re.compile(r"^(%s)(\.\w+)+$" % "|".join(LAYERS))


def imported_packages(source: str, filename: str = "<src>"):
    """[(line, top-level layer, statement text)] for every import of one of LAYERS in the source."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: own package
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in BENCH_SCRIPTS:
                top = "bench"
            if top in LAYERS:
                out.append((node.lineno, top, ast.get_source_segment(source, node) or name))
    return out


def named_modules(source: str, filename: str = "<src>"):
    """[(line, top-level layer, string)] for every string constant that is a dotted module path of LAYERS."""
    return [
        (n.lineno, n.value.split(".")[0], repr(n.value))
        for n in ast.walk(ast.parse(source, filename))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and MODULE_STRING.match(n.value)
    ]


def violations(root: Path = ROOT):
    bad = []
    for rank, pkg in enumerate(LAYERS):
        for path in sorted((root / pkg).rglob("*.py")):
            rel, src = path.relative_to(root).as_posix(), path.read_text()
            found = imported_packages(src, str(path)) + named_modules(src, str(path))
            for line, top, stmt in found:
                if LAYERS.index(top) > rank:
                    bad.append(f"{rel}:{line}: {pkg} must not import {top}: {stmt}")
    return sorted(bad)


def test_imports_run_one_way():
    bad = violations()
    assert not bad, "imports against data_prep <- pipeline <- evaluation <- bench:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "src,expected",
    [
        ("import evaluation.report\n", [(1, "evaluation")]),
        ("def g():\n    from bench.interleave import write_json\n", [(2, "bench")]),
        ("from interleave import run_cases\n", [(1, "bench")]),
        ("from . import x\nimport os\nfrom torch import nn\n", []),
    ],
)
def test_walker_sees_every_kind_of_import(src, expected):
    assert [(ln, top) for ln, top, _ in imported_packages(src)] == expected


def test_violation_names_file_line_and_import(tmp_path):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "data_prep" / "x.py").write_text("import os\n\ndef f():\n    from pipeline.config import Config\n")
    (tmp_path / "pipeline" / "y.py").write_text(
        'import importlib\nm = importlib.import_module("evaluation.cli")\n'
        'DIRS = ("pipeline", "evaluation")  # directory names are fine\n'
    )
    (tmp_path / "bench" / "ok.py").write_text("from evaluation import report\nfrom data_prep import shards\n")
    assert violations(tmp_path) == [
        "data_prep/x.py:4: data_prep must not import pipeline: from pipeline.config import Config",
        "pipeline/y.py:2: pipeline must not import evaluation: 'evaluation.cli'",
    ]


def test_every_package_registers_its_own_tlf_commands():
    """The `tlf` command finds its subcommands as entry points: every one of them loads, and each package's
    commands come from that package."""
    from importlib.metadata import entry_points

    import click

    from pipeline.cli import main

    eps = {ep.name: ep for ep in entry_points(group="tlf.commands")}
    assert {"prep-data", "train", "generate", "eval", "compare", "ablate", "sweep", "export"} <= set(eps)
    ctx = click.Context(main)
    assert set(eps) <= set(main.list_commands(ctx))  # loaded when named (`_Group.get_command`)
    for name, ep in eps.items():
        assert ep.value.split(".")[0] in LAYERS and main.get_command(ctx, name) is ep.load(), name


def test_training_modules_do_not_import_each_other_in_a_cycle():
    """Within pipeline/train/ the imports (module level or inside a function) form no cycle: the callbacks use
    the trainer object they are given, never import trainer.py."""
    mods = {p.stem: p for p in (ROOT / "pipeline" / "train").glob("*.py")}
    graph = {}
    for name, path in mods.items():
        src = path.read_text()
        deps = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline.train."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.ImportFrom) and node.module == "pipeline.train":
                deps.update(a.name for a in node.names)
        graph[name] = deps & mods.keys()

    def cycle_from(n, path):
        for d in graph[n]:
            if d in path:
                return path[path.index(d) :] + [d]
            found = cycle_from(d, path + [d])
            if found:
                return found
        return None

    for n in graph:
        assert cycle_from(n, [n]) is None, " -> ".join(cycle_from(n, [n]))
