"""What the code imports is what the set-ups install: every third-party module that data_prep, pipeline or
evaluation imports is provided by `make demo`'s set-up (requirements-demo.txt) or, for the Hub and harness paths
only, by `make setup`'s (requirements.txt), and the packages the demo leaves out are the ones tests run without
(tests/fixtures/demo_packages)."""

import ast
import sys
from pathlib import Path

from test_layering import CYCLE_FREE as OWN, ROOT, absolute_imports

# module -> the distribution that provides it, by set-up
DEMO = {
    "click": "click",
    "deepspeed": "deepspeed",
    "matplotlib": "matplotlib",
    "mlflow": "mlflow-skinny",
    "numpy": "numpy",
    "pyarrow": "pyarrow",
    "safetensors": "safetensors",
    "tiktoken": "tiktoken",
    "torch": "torch",
    "tqdm": "tqdm",
    "yaml": "PyYAML",
    "zstandard": "zstandard",
}
FULL_ONLY = {  # the Hub's data sets and tasks, the lm-eval harness, the transformers export's remote code
    "datasets": "datasets",
    "huggingface_hub": "datasets",  # installed with datasets (and transformers)
    "lm_eval": "lm-eval",
    "transformers": "transformers",
}


def third_party_imports(root: Path = ROOT) -> dict[str, list[str]]:
    """{top-level module: ['file:line', ...]} of every import in the three packages that is neither the standard
    library nor the project's own."""
    out: dict[str, list[str]] = {}
    for pkg in OWN:
        for f in sorted((root / pkg).rglob("*.py")):
            for node, name in absolute_imports(f.read_text(), str(f)):
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in (*OWN, "__future__"):
                    out.setdefault(top, []).append(f"{f.relative_to(root)}:{node.lineno}")
    return out


def pinned(path: Path) -> set[str]:
    """The distribution names a requirements file pins (following -r includes)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            names |= pinned(path.parent / line[3:].strip())
        elif line:
            names.add(line.split("==")[0].split(">=")[0].strip().lower())
    return names


def test_every_third_party_import_is_installed_by_a_set_up():
    unknown = {m: where for m, where in third_party_imports().items() if m not in DEMO and m not in FULL_ONLY}
    assert not unknown, (
        f"imports no set-up is known to install: {unknown}; add the package to requirements-demo.txt (every "
        "`make demo` path) or requirements.txt (Hub/harness paths only, which need a clear error without it)"
    )


def test_the_set_ups_pin_what_the_code_imports():
    demo, full = pinned(ROOT / "requirements-demo.txt"), pinned(ROOT / "requirements.txt")
    assert {d.lower() for d in DEMO.values()} - {"torch"} <= demo  # torch is installed first, by itself
    assert {d.lower() for d in FULL_ONLY.values()} <= full and not {d.lower() for d in FULL_ONLY.values()} & demo


def test_the_tests_without_the_full_set_up_block_exactly_its_packages():
    src = (ROOT / "tests" / "fixtures" / "demo_packages" / "sitecustomize.py").read_text()
    blocked = next(
        ast.literal_eval(n.value)
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Assign) and n.targets[0].id == "NOT_IN_THE_DEMOS_SET_UP"
    )
    assert set(FULL_ONLY) <= set(blocked)


def test_an_unclassified_import_is_found(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "a.py").write_text("import os\nimport numpy\n\ndef f():\n    from scipy.stats import t\n")
    assert third_party_imports(tmp_path) == {"numpy": ["pipeline/a.py:2"], "scipy": ["pipeline/a.py:5"]}
