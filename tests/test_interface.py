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
    "pipeline/train/recipes/__init__.py": ("net",),  # the router recipes: the network the objective hands them
    "pipeline/train/recipes/kinds.py": ("step.net",),
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


def test_every_path_runs_its_loops_through_loop():
    """The semantics of one loop live in `LoopedLM.loop`: the gather-scatter path, the dense reference, the
    scorer's tree masks, the decoder's prefill and its one-token steps all call it, once per loop they run."""
    import torch

    from pipeline.inference.decode import Decoder

    torch.manual_seed(0)
    model = LoopedLM(load_config("tiny/t-loopformer").model).eval()
    calls = []
    real = model.loop

    def counted(h, i, *args, **kwargs):
        calls.append(i)
        return real(h, i, *args, **kwargs)

    model.loop = counted
    x = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        for ex in ("compact", "sorted", "bucketed", "dense"):
            calls.clear()
            out = model(x, loops=3, execution=ex)
            assert calls == list(range(1, int(out.depth.max()) + 1 if ex != "dense" else 4)), (ex, calls)
        calls.clear()
        model.hidden_states(x, 3, mask=torch.ones(2, 8, 8, dtype=torch.bool).tril())
        assert calls and calls == sorted(calls)
        dec = Decoder(model, loops=3, router=False)
        calls.clear()
        dec.prefill(x.tolist())
        assert calls == [1, 2, 3]
        calls.clear()
        dec.step(torch.tensor([1, 2]))
        assert calls == [1, 2, 3]
