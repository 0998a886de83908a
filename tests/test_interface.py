"""The engine interface (pipeline/model/interface.py): LoopedLM implements it, and the training objective, the
decoder, the scorer and the Hugging Face wrapper use nothing of a model outside it."""

import ast
import inspect
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.model import LoopedLM
from pipeline.model.interface import LoopedNetwork

ROOT = Path(__file__).resolve().parent.parent
METHODS = {k for k, v in vars(LoopedNetwork).items() if callable(v) and (not k.startswith("_") or k == "__call__")}
MEMBERS = METHODS | set(LoopedNetwork.__annotations__)
# file -> the expressions that hold the model there (the decoder binds `m = self.model`)
USERS = {
    "pipeline/train/objective.py": ("self.net",),
    "pipeline/inference/decode.py": ("self.model", "m", "model"),
    "evaluation/forward.py": ("model",),
    "evaluation/scorer.py": ("model",),
    "pipeline/hf/remote.py": ("self.model",),
}


def test_looped_lm_implements_the_interface():
    model = LoopedLM(load_config("tiny/t-loopformer").model)
    assert isinstance(model, LoopedNetwork)
    for name in METHODS - {"__call__"}:
        want = list(inspect.signature(getattr(LoopedNetwork, name)).parameters)[1:]  # without self
        have = list(inspect.signature(getattr(model, name)).parameters)
        assert have[: len(want)] == want, (name, want, have)  # same names, same order, extras only after


def _uses(path: Path, holders: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, member) of every attribute read or call on an expression in holders."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in holders:
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in holders:
            out.append((node.lineno, "__call__"))
    return out


@pytest.mark.parametrize("rel", sorted(USERS))
def test_users_touch_only_the_interface(rel):
    uses = _uses(ROOT / rel, USERS[rel])
    assert uses, f"{rel}: no use of the model found (is the holder name still {USERS[rel]}?)"
    outside = sorted({(line, a) for line, a in uses if a not in MEMBERS})
    assert not outside, f"{rel} uses model members outside pipeline/model/interface.py: {outside}"
