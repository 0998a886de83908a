"""Dependencies run one way: data_prep <- pipeline <- evaluation <- bench (README "Layout").

Every `import` / `from ... import` in the four packages (module level or inside a function) may name its own
package or one to its left only. Bench scripts import each other by bare name (`from interleave import ...`,
run as scripts with bench/ on sys.path): those count as bench.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("data_prep", "pipeline", "evaluation", "bench")
BENCH_SCRIPTS = {p.stem for p in (ROOT / "bench").glob("*.py")}


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


def violations(root: Path = ROOT):
    bad = []
    for rank, pkg in enumerate(LAYERS):
        for path in sorted((root / pkg).rglob("*.py")):
            for line, top, stmt in imported_packages(path.read_text(), str(path)):
                if LAYERS.index(top) > rank:
                    bad.append(f"{path.relative_to(root)}:{line}: {pkg} must not import {top}: {stmt}")
    return bad


def test_imports_run_one_way():
    bad = violations()
    assert not bad, "imports against data_prep <- pipeline <- evaluation <- bench:\n" + "\n".join(bad)


@pytest.mark.parametrize("src,expected", [
    ("import evaluation.report\n", [(1, "evaluation")]),
    ("def g():\n    from bench.interleave import write_json\n", [(2, "bench")]),
    ("from interleave import run_cases\n", [(1, "bench")]),
    ("from . import x\nimport os\nfrom torch import nn\n", []),
])
def test_walker_sees_every_kind_of_import(src, expected):
    assert [(ln, top) for ln, top, _ in imported_packages(src)] == expected


def test_violation_names_file_line_and_import(tmp_path):
    for pkg in LAYERS:
        (tmp_path / pkg).mkdir()
    (tmp_path / "data_prep" / "x.py").write_text("import os\n\ndef f():\n    from pipeline.config import Config\n")
    (tmp_path / "bench" / "ok.py").write_text("from evaluation import report\nfrom data_prep import shards\n")
    assert violations(tmp_path) == [
        "data_prep/x.py:4: data_prep must not import pipeline: from pipeline.config import Config"]
