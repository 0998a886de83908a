"""`tlf export --format hf`: transformers loads the directory with trust_remote_code and no tlf importable, and
its logits equal tlf's (fp32, atol 1e-5) for every tiny preset, M < L and padded batches; greedy generate()
equals tlf's generate; the tokenizer files encode like tlf's BPE."""

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers import RECIPE, perturbed_tiny

from pipeline.cli import main
from pipeline.config import list_presets
from pipeline.model.io import save_model

from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
ATOL = 1e-5
# every tiny preset (t-loopformer-budget: the budget recipe's router), and "@recipe": a router recipe's network
# (the exit recipes': prefix exits, frozen keys; kinds: the forecast head too)
TINY = sorted(p for p in list_presets() if p.startswith("tiny/")) + [
    "tiny/t-loopformer@expected",
    "tiny/base-loop-router@kinds",
]


def export_hf(tmp_path, name="tiny/t-loopformer"):
    name, _, recipe = name.partition("@")
    overrides = [*RECIPE[recipe], "model.exited_keys=frozen"] if recipe else []
    model, cfg = perturbed_tiny(name, overrides=overrides)
    src = save_model(tmp_path / "src", model, cfg)
    res = CliRunner().invoke(main, ["export", str(src), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    return model, cfg, tmp_path / "hf"


def load_hf(d):
    return AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_logits_equal_tlf_for_every_preset_and_budget(tmp_path, name):
    model, cfg, d = export_hf(tmp_path, name)
    conf = json.loads((d / "config.json").read_text())
    L = cfg.model.loops
    assert conf["model_type"] == "tlf_looped" and conf["loops"] == L and conf["loops_budget"] == L
    assert conf["router_threshold"] == cfg.model.router_threshold and conf["tlf_model"]["variant"] == cfg.model.variant
    hf = load_hf(d)
    idx = torch.randint(0, 50257, (3, 11), generator=torch.Generator().manual_seed(1))
    for M in sorted({L, max(1, L // 2)}):
        want = model(idx, loops=M).logits
        got = hf(idx, loops=M).logits
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (M, (got - want).abs().max())
    if L > 1:  # the default budget comes from config.json
        assert not torch.allclose(hf(idx).logits, model(idx, loops=L // 2).logits, atol=ATOL)


@torch.no_grad()
def test_padded_batch_with_attention_mask_and_greedy_generate(tmp_path):
    from pipeline.inference import generate

    model, cfg, d = export_hf(tmp_path)
    hf = load_hf(d)
    rows = [[11, 500, 7, 9000, 3, 77, 1], [42, 8], [5, 6, 7, 8]]
    T = max(map(len, rows))
    for side in ("left", "right"):
        ids = torch.full((3, T), 50256)
        mask = torch.zeros(3, T, dtype=torch.long)
        for b, r in enumerate(rows):
            sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
            ids[b, sl], mask[b, sl] = torch.tensor(r), 1
        out = hf(ids, attention_mask=mask, loops=2).logits
        for b, r in enumerate(rows):
            want = model(torch.tensor([r]), loops=2).logits[0]
            assert torch.allclose(out[b][mask[b].bool()], want, atol=ATOL, rtol=0), side
    for M in (4, 2):
        g = generate(model, rows, max_new_tokens=6, temperature=0, loops=M, stop_token=None)
        for b, r in enumerate(rows):
            got = hf.generate(torch.tensor([r]), max_new_tokens=6, do_sample=False, loops=M, eos_token_id=None)
            assert got[0, len(r) :].tolist() == g.tokens[b], (M, b)
    tok = AutoTokenizer.from_pretrained(d)
    from data_prep.tokenizer import encode

    text = "Hello world, the looped transformer's depth varies per token!"
    assert tok(text).input_ids == encode(text)
    card = (d / "README.md").read_text()
    assert cfg.model.variant in card and str(cfg.schedule.max_steps) in card


GUARD = """
import sys, importlib.abc
class NoTlf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pipeline", "data_prep", "evaluation"):
            raise ImportError("tlf must not be imported: " + name)
sys.meta_path.insert(0, NoTlf())
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
idx = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(m(idx).logits, sys.argv[3])
assert not any(k.split(".")[0] in ("pipeline", "data_prep", "evaluation") for k in sys.modules)
"""


@torch.no_grad()
def test_loads_in_a_process_where_tlf_cannot_be_imported(tmp_path):
    model, _, d = export_hf(tmp_path)  # t-loopformer: router + gather-scatter
    src = (d / "modeling_tlf.py").read_text()
    assert "import pipeline" not in src and "from pipeline" not in src
    idx = torch.randint(0, 50257, (2, 9))
    torch.save(idx, tmp_path / "idx.pt")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hfhome"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", GUARD, str(d), str(tmp_path / "idx.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert torch.allclose(torch.load(tmp_path / "out.pt", weights_only=True), model(idx).logits, atol=ATOL, rtol=0)


def test_bundling_refuses_model_code_importing_other_tlf_modules(tmp_path, monkeypatch):
    from pipeline.hf import export as E

    fake = tmp_path / "model"
    fake.mkdir()
    for m in E.MODULES:
        (fake / f"{m}.py").write_text((E.MODEL_DIR / f"{m}.py").read_text())
    (fake / "looped.py").write_text("from pipeline.memory import SavedTensors\n" + (fake / "looped.py").read_text())
    monkeypatch.setattr(E, "MODEL_DIR", fake)
    with pytest.raises(RuntimeError, match=r"looped\.py:1: a tlf import"):
        E.modeling_source()


def test_fine_tuning_keeps_the_head_tied_and_one_step_equals_tlfs(tmp_path):
    """The tied matrix is stored once and tied again after from_pretrained: the parameter count is tlf's, and one
    SGD step on the same batch gives the same logits in transformers and in tlf."""
    from safetensors import safe_open

    model, cfg, d = export_hf(tmp_path)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert "model.lm_head.weight" not in f.keys() and "model.wte.weight" in f.keys()
    hf = load_hf(d)
    assert hf.model.lm_head.weight is hf.model.wte.weight
    assert hf.num_parameters() == sum(p.numel() for p in model.parameters())  # tied: counted once by both
    idx = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(3))
    for m, logits in ((hf, lambda: hf(idx, loops=2).logits), (model, lambda: model(idx, loops=2).logits)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        out = logits()
        torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), idx[:, 1:].flatten()).backward()
        opt.step()
    with torch.no_grad():
        got, want = hf(idx, loops=2).logits, model(idx, loops=2).logits
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()


@torch.no_grad()
def test_loops_from_pretrained_is_the_budget_and_a_bad_one_is_refused(tmp_path):
    model, cfg, d = export_hf(tmp_path)
    idx = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(4))
    for kw in ({"loops": 2}, {"loops_budget": 2}, {"loops": "2"}):  # lm-eval's --model_args ...,loops=2
        hf = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, **kw).eval()
        assert hf.config.loops == hf.config.loops_budget == 2
        assert torch.allclose(hf(idx).logits, model(idx, loops=2).logits, atol=ATOL, rtol=0), kw
    L = cfg.model.loops
    for bad in (0, L + 1, "two"):
        with pytest.raises(ValueError, match=rf"loops={bad!r}: the loop budget must be an integer in 1\.\.{L}"):
            AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, loops=bad)
    conf = json.loads((d / "config.json").read_text())
    conf["loops_budget"] = 2  # an edited config.json: its budget, not `loops` L, is the default
    (d / "config.json").write_text(json.dumps(conf))
    hf = load_hf(d)
    assert hf.config.loops_budget == 2 and torch.allclose(hf(idx).logits, model(idx, loops=2).logits, atol=ATOL, rtol=0)
