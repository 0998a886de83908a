"""Dependencies run one way: data_prep <- pipeline <- evaluation <- bench (README "Layout"); no function over 60 lines.

Every `import` / `from ... import` in the four packages (module level or inside a function) may name its own
package or one to its left only. Bench scripts import each other by bare name (`from interleave import ...`,
run as scripts with bench/ on sys.path): those count as bench. A module named in a string (`importlib`) counts
too. There is no exception: `tlf`'s subcommands register themselves as `tlf.commands` entry points (setup.py),
which the `tlf` command loads without naming their packages.

Inside data_prep, pipeline and evaluation the modules import each other in no cycle (imports inside functions
count, relative ones resolved), pipeline/model imports nothing of pipeline/train (the trainer uses the model), and
pipeline/plan uses pipeline/train (it traces the training step), never the other way round.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("data_prep", "pipeline", "evaluation", "bench")
BENCH_SCRIPTS = {p.stem for p in (ROOT / "bench").glob("*.py")}
MODULE_STRING = re.compile(r"^(%s)(\.\w+)+$" % "|".join(LAYERS))


def absolute_imports(source: str, filename: str = "<src>"):
    """[(import statement node, dotted module name)] for every absolute import in the source, at module level or
    inside a function (relative imports name the importer's own package and are left out)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node, node.module or ""))
    return out


def imported_packages(source: str, filename: str = "<src>"):
    """[(line, top-level layer, statement text)] for every import of one of LAYERS in the source."""
    out = []
    for node, name in absolute_imports(source, filename):
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


# ------------------------------------------------------------------------------------ inside a package
CYCLE_FREE = ("data_prep", "pipeline", "evaluation")
NEVER = [  # (importer, imported, why): module prefixes
    ("pipeline.model", "pipeline.train", "the model knows nothing of training (the trainer uses the model)"),
    ("pipeline.train", "pipeline.plan", "the plan traces the training step: plan -> train only"),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, name: str, is_package: bool, modules) -> dict[str, int]:
    """{module of `modules`: first line} that module `name` imports, at module level or inside a function:
    `import a.b`, `from a.b import c` (the module a.b.c when there is one, else a.b), relative imports resolved; a
    name that is no module of `modules` counts as its nearest enclosing one (a package's __init__)."""
    out: dict[str, int] = {}
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.setdefault(t, node.lineno)
    return out


def import_graph(root: Path = ROOT, packages=CYCLE_FREE) -> tuple[dict, dict]:
    """({module: {imported module of the same package: line}}, {module: file relative to root})."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        deps = module_imports(path.read_text(), name, path.name == "__init__.py", files)
        graph[name] = {d: ln for d, ln in deps.items() if d.split(".")[0] == name.split(".")[0]}
    return graph, {n: p.relative_to(root).as_posix() for n, p in files.items()}


def cycles(graph: dict) -> list[list[str]]:
    """The import cycles of graph: each strongly connected set of two modules or more, as one cycle through them
    (sorted, each starting at its first module in name order)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a strongly connected set: the stack down to v
            comp = set(stack[stack.index(v) :])
            del stack[stack.index(v) :]
            if len(comp) > 1:
                found.append(_path_through(min(comp), graph, comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _path_through(start: str, graph: dict, comp: set) -> list[str]:
    """A shortest cycle start -> ... -> start inside the strongly connected set comp (breadth first)."""
    prev, todo = {start: None}, [start]
    for v in todo:
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w in comp and w not in prev:
                prev[w] = v
                todo.append(w)
    raise AssertionError(f"{start}: no cycle in {sorted(comp)}")


def cycle_violations(root: Path = ROOT, packages=CYCLE_FREE) -> list[str]:
    graph, files = import_graph(root, packages)
    return [
        "import cycle: " + " -> ".join(f"{files[a]}:{graph[a][b]}" for a, b in zip(c, c[1:])) + f" -> {files[c[0]]}"
        for c in cycles(graph)
    ]


def never_violations(root: Path = ROOT, never=NEVER) -> list[str]:
    graph, files = import_graph(root)
    found = sorted(
        (files[a], ln, f"{a} imports {b}: {why}")
        for a, deps in graph.items()
        for b, ln in deps.items()
        for src, dst, why in never
        if (a == src or a.startswith(src + ".")) and (b == dst or b.startswith(dst + "."))
    )
    return [f"{f}:{ln}: {what}" for f, ln, what in found]


def test_no_import_cycle_inside_a_package():
    bad = cycle_violations()
    assert not bad, "\n".join(bad)


def test_model_never_imports_train_and_train_never_imports_plan():
    bad = never_violations()
    assert not bad, "\n".join(bad)


def test_plan_uses_train_one_way():
    """The one allowed direction is taken: plan imports train (so a check of train -> plan is not vacuous)."""
    graph, _ = import_graph()
    assert any(b.startswith("pipeline.train.") for a in graph if a.startswith("pipeline.plan.") for b in graph[a])


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp_path


def test_a_cycle_is_found_through_function_level_and_relative_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "data_prep/__init__.py": "",
            "data_prep/a.py": "import os\n\ndef f():\n    from data_prep.b import g\n",
            "data_prep/b.py": "from . import c\n",
            "data_prep/c.py": "from .a import f\n",
            "data_prep/d.py": "from data_prep import a\n",  # into the cycle, not on it
            "pipeline/__init__.py": "",
            "pipeline/x/__init__.py": "from pipeline.x.y import Y\n",  # a package's face: imports its module
            "pipeline/x/y.py": "from ..x import z\n",
            "pipeline/x/z.py": "import pipeline.x\n",
            "evaluation/__init__.py": "",
            "evaluation/ok.py": "import data_prep.a\nimport pipeline.x.y\n",  # other packages: not a cycle
        },
    )
    assert cycle_violations(root) == [
        "import cycle: data_prep/a.py:4 -> data_prep/b.py:1 -> data_prep/c.py:1 -> data_prep/a.py",
        "import cycle: pipeline/x/__init__.py:1 -> pipeline/x/y.py:1 -> pipeline/x/z.py:1 -> pipeline/x/__init__.py",
    ]
    (root / "data_prep" / "c.py").write_text("import os\n")
    (root / "pipeline" / "x" / "z.py").write_text("")
    assert cycle_violations(root) == []


def test_model_to_train_and_train_to_plan_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pipeline/model/io.py": "def find():\n    from pipeline.train.checkpoint import newest\n",
            "pipeline/train/checkpoint.py": "from pipeline.model import io\n",
            "pipeline/train/callbacks.py": "from ..plan import core\n",
            "pipeline/plan/core.py": "from pipeline.train.objective import Objective\n",
            "pipeline/train/objective.py": "",
        },
    )
    assert never_violations(root) == [
        "pipeline/model/io.py:2: pipeline.model.io imports pipeline.train.checkpoint: " + NEVER[0][2],
        "pipeline/train/callbacks.py:1: pipeline.train.callbacks imports pipeline.plan.core: " + NEVER[1][2],
    ]


FUNCTION_LIMIT = 60  # lines from `def` to the last line of the body (decorators aside)
LIMITS = {("pipeline/train/objective.py", "Objective.forward"): 40}  # the objective's one dispatch


def _functions(node: ast.AST, prefix: str = ""):
    """(qualified name, def node) of every function under node, once each: a class's methods as Class.name, a
    function's nested functions as outer.name."""
    for n in ast.iter_child_nodes(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + n.name, n
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _functions(n, f"{prefix}{n.name}.")
        else:
            yield from _functions(n, prefix)


def long_functions(root: Path = ROOT) -> list[str]:
    """'FILE:LINE Class.name N lines (limit M)' for each function in data_prep, pipeline and evaluation over its
    limit (LIMITS, else FUNCTION_LIMIT)."""
    out = []
    for pkg in CYCLE_FREE:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            for name, n in _functions(ast.parse(f.read_text(), rel)):
                limit = LIMITS.get((rel, name), FUNCTION_LIMIT)
                if n.end_lineno - n.lineno + 1 > limit:
                    out.append(f"{rel}:{n.lineno} {name} {n.end_lineno - n.lineno + 1} lines (limit {limit})")
    return sorted(out)


def test_no_function_over_its_line_limit():
    bad = long_functions()
    assert not bad, "\n".join(bad)


def test_a_long_function_is_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LIMIT))
    method = "".join(f"        x{i} = {i}\n" for i in range(40))
    root = _tree(
        tmp_path,
        {
            "data_prep/a.py": f"@staticmethod\ndef short():\n    pass\n\ndef long():\n{body}",
            "pipeline/train/objective.py": f"class Objective:\n    def forward(self):\n{method}",
            "evaluation/b.py": f"class C:\n    def m(self):\n{method * 2}",  # a long method: found once, as C.m
        },
    )
    assert long_functions(root) == [
        f"data_prep/a.py:5 long {FUNCTION_LIMIT + 1} lines (limit {FUNCTION_LIMIT})",
        f"evaluation/b.py:2 C.m 81 lines (limit {FUNCTION_LIMIT})",
        "pipeline/train/objective.py:2 Objective.forward 41 lines (limit 40)",
    ]
