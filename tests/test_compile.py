"""train.compile per execution strategy: each layer compiled once with dynamic shapes (compact, sorted, dense), the
computed length changing every loop and step without recompiling; under bucketed the whole loop compiled with static
shapes, one graph per bucket length met. The compiled model computes what the eager one does. Backends here are
dynamo's eager/aot_eager (fast, the same tracing and graph breaks as inductor); bench/train_step.py times inductor."""

import pytest
import torch

from helpers import perturbed_tiny, spread_router
from pipeline.config import load_config
from pipeline.train.compile import apply_compile, compile_count, graph_breaks
from pipeline.train.objective import Objective


def _batches(n, T=24):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 50304, (2, T), generator=g), torch.randint(0, 50304, (2, T), generator=g)) for _ in range(n)
    ]


def test_compiled_layers_match_eager_and_do_not_recompile_once_warm():
    torch._dynamo.reset()
    eager, comp = spread_router(perturbed_tiny()[0]), spread_router(perturbed_tiny()[0])
    assert comp.cfg.execution == "compact"
    oc = load_config("tiny/t-loopformer").objective
    eager.train(), comp.train()
    apply_compile(comp, backend="aot_eager")
    counts, lengths = [], set()
    warm = [torch.tensor([4]), torch.tensor([1, 3]), None, torch.tensor([2, 1, 1])]  # S = 1, 2, sampled, 3
    for k, (x, y) in enumerate(_batches(12)):
        short = warm[k] if k < len(warm) else None
        torch.manual_seed(k)
        a = Objective(eager, oc)(x, y, short)
        torch.manual_seed(k)
        b = Objective(comp, oc)(x, y, short)
        a.loss.backward(), b.loss.backward()
        torch.testing.assert_close(a.parts, b.parts, atol=1e-5, rtol=0)
        assert torch.equal(a.depth, b.depth)
        counts.append(compile_count())
        lengths |= {int((a.depth >= i).sum(1).max()) for i in range(2, 5)}
    assert len(lengths) >= 3  # the compacted lengths really varied
    # warm after the first steps (each 0/1-specialised case met once): later steps compile nothing new
    assert 0 < counts[5] == counts[-1] <= 4 * len(comp.layers), counts
    for (n, p), q in zip(eager.named_parameters(), comp.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


@pytest.mark.parametrize("execution", ["sorted", "bucketed", "dense"])
def test_every_strategy_compiled_matches_eager_without_graph_breaks(execution):
    """Each strategy's compiled step (its own compile: layers dynamic, or bucketed's whole loop static) gives the
    eager step's losses and gradients, with no graph break; once warm, later steps compile nothing new."""
    torch._dynamo.reset()
    over = (f"model.execution={execution}",)
    eager, comp = (spread_router(perturbed_tiny(overrides=over)[0]).train() for _ in range(2))
    oc = load_config("tiny/t-loopformer").objective
    apply_compile(comp, backend="aot_eager")
    base, breaks = compile_count(), graph_breaks()  # dynamo's counters are per process
    counts = []
    for k, (x, y) in enumerate(_batches(4)):
        torch.manual_seed(k)
        a = Objective(eager, oc)(x, y, torch.tensor([1, 3]) if k == 0 else None)
        torch.manual_seed(k)
        b = Objective(comp, oc)(x, y, torch.tensor([1, 3]) if k == 0 else None)
        a.loss.backward(), b.loss.backward()
        torch.testing.assert_close(a.parts, b.parts, atol=1e-5, rtol=0)
        assert torch.equal(a.depth, b.depth)
        counts.append(compile_count() - base)
    assert graph_breaks() == breaks
    for (n, p), q in zip(eager.named_parameters(), comp.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n
    if execution == "bucketed":  # one static graph per (bucket length, one-row table or not) met
        assert counts[-1] <= 2 * 8 + 2, counts


def test_bucketed_compiles_the_whole_loop_once_per_bucket_length():
    """Under bucketed the shared block is compiled whole with static shapes: the computed lengths are bucket sizes
    (multiples of ceil(T / 8)), and the graphs follow the lengths met, not the tokens' depths nor the shortcut
    pass's budget (its table's row count is dynamic)."""
    from pipeline.model.looped import bucket_length

    torch._dynamo.reset()
    model = spread_router(perturbed_tiny(overrides=("model.execution=bucketed",))[0]).train()
    oc = load_config("tiny/t-loopformer").objective
    apply_compile(model, backend="eager")
    base, breaks = compile_count(), graph_breaks()  # dynamo's counters are per process
    lengths, seen = set(), []
    T = 24
    for k, (x, y) in enumerate(_batches(8, T)):
        torch.manual_seed(k)
        out = Objective(model, oc)(x, y, [torch.tensor([1, 3]), torch.tensor([2, 2]), torch.tensor([4])][k % 3])
        out.loss.backward()
        lengths |= {bucket_length(int((out.depth >= i).sum(1).max()), T) for i in range(1, 5)} - {0}
        seen.append(compile_count() - base)
    assert len(lengths) >= 3
    assert seen[-1] <= len(lengths) + 2, (seen, lengths)  # + the one-row table of S = 1's budget, 0/1 cases
    assert graph_breaks() == breaks


def test_train_compile_switch_compiles_the_layers(tmp_path, monkeypatch, data):
    from test_train import tiny_cfg

    import pipeline.train.compile as tc
    from pipeline.train.trainer import run

    orig = tc.apply_compile
    calls = []

    def eager_backend(model, backend="inductor"):
        calls.append(model)
        orig(model, backend="eager")

    monkeypatch.setattr(tc, "apply_compile", eager_backend)
    torch._dynamo.reset()
    res = run(tiny_cfg(tmp_path, data, "train.compile=true", "schedule.max_steps=4", "train.eval_interval=0"))
    assert len(calls) == 1 and res.step == 4 and all(x == x for x in res.losses)
    assert compile_count() > 0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_train import make_shards

    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)
