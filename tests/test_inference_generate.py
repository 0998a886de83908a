"""generate() (the API evaluation uses), sampling filters and `tlf generate` from a saved export."""

import re

import pytest
import tiktoken
import torch
from click.testing import CliRunner
from helpers import spread_router

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.inference import cli as inference_cli
from pipeline.inference import generate, sample
from pipeline.model import LoopedLM
from pipeline.model.io import save_model

torch.set_num_threads(1)


def make(variant="t-loopformer", seed=0):
    torch.manual_seed(seed)
    cfg = load_config(f"tiny/{variant}")
    model = LoopedLM(cfg.model)
    with torch.no_grad():
        for layer in model.layers:
            if layer.modulated:
                layer.modulator[1].weight.normal_(0, 0.05)
        spread_router(model, seed)  # (before wte is scaled: the recipe reads h0 at its init scale)
        model.wte.weight.mul_(20)  # sharper logits: greedy choices are far from ties
    return model.eval(), cfg


def greedy_by_recompute(model, prompt, n, M):
    """Reference: no cache, one full forward per new token."""
    seq, toks, deps = list(prompt), [], []
    for _ in range(n):
        out = model(torch.tensor([seq]), loops=M)
        toks.append(int(out.logits[0, -1].argmax()))
        deps.append(int(out.depth[0, -1]))
        seq.append(toks[-1])
    return toks, deps


@pytest.mark.parametrize("M", [4, 2])
def test_greedy_generation_matches_recompute_and_rows_are_independent(M):
    model, _ = make()
    prompts = [[11, 500, 7, 9000, 3], [42], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]
    out = generate(model, prompts, max_new_tokens=10, temperature=0, loops=M)
    for b, p in enumerate(prompts):
        toks, deps = greedy_by_recompute(model, p, 10, M)
        assert out.tokens[b] == toks and out.depths[b] == deps
        assert out.prompt_depths[b] == model(torch.tensor([p]), loops=M).depth[0].tolist()
    assert max(max(d) for d in out.depths) <= M
    alone = generate(model, prompts[1:2], max_new_tokens=10, temperature=0, loops=M)
    assert alone.tokens[0] == out.tokens[1]


def test_sampling_seed_stream_stop_and_vocab_limit():
    model, _ = make()
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(model, prompts, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    b = generate(model, prompts, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    c = generate(model, prompts, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    seen = []
    out = generate(
        model,
        [[1, 2, 3]],
        max_new_tokens=6,
        seed=0,
        vocab_limit=1000,
        callback=lambda s, t, d: seen.append((s, t[0], d[0])),
    )
    assert [t for _, t, _ in seen] == out.tokens[0] and [d for *_, d in seen] == out.depths[0]
    assert [s for s, *_ in seen] == list(range(6)) and max(out.tokens[0]) < 1000
    first = out.tokens[0][2]  # stop at the third token: the row ends there, with the stop token
    stopped = generate(model, [[1, 2, 3]], max_new_tokens=6, seed=0, vocab_limit=1000, stop_token=first)
    k = out.tokens[0].index(first)
    assert stopped.tokens[0] == out.tokens[0][: k + 1]
    with pytest.raises(ValueError, match="block_size"):
        generate(model, [[1] * 60], max_new_tokens=10)


def test_sample_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample(logits, top_k=2, generator=g).tolist()) == {3, 4}
    p = logits[0].softmax(-1)  # top-p 0.8 keeps the smallest prefix of sorted probs reaching 0.8: {4, 3}
    assert p[4] < 0.8 <= p[4] + p[3]
    assert set(sample(logits, top_p=0.8, generator=g).tolist()) == {3, 4}
    assert set(sample(logits, temperature=0).tolist()) == {4}
    assert len(set(sample(logits, temperature=1.0, generator=g).tolist())) == 5


def _byte_tokenizer():
    """An offline BPE with GPT-2's vocabulary size: 256 bytes, then byte pairs, and <|endoftext|> = 50256."""
    ranks = {bytes([i]): i for i in range(256)}
    for r in range(256, 50256):
        ranks[bytes(divmod(r - 256, 256))] = r  # 196 x 256 distinct two-byte tokens
    return tiktoken.Encoding(
        "bytes-test", pat_str=r"\s?\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    model, cfg = make()
    return str(save_model(tmp_path_factory.mktemp("gen") / "model", model, cfg))


def test_cli_streams_text_with_depths(export, monkeypatch):
    enc = _byte_tokenizer()
    monkeypatch.setattr(inference_cli, "get_tokenizer", lambda: enc)
    r = CliRunner()
    args = ["generate", export, "--prompt", "Hello", "--max-new-tokens", "8", "--seed", "3", "--top-k", "20"]
    one = r.invoke(main, args + ["--no-stop"])
    assert one.exit_code == 0, one.output
    two = r.invoke(main, args + ["--no-stop"])
    assert one.output == two.output and one.output.startswith("Hello")
    model, _ = make()
    api = generate(model, [enc.encode_ordinary("Hello")], max_new_tokens=8, seed=3, top_k=20, vocab_limit=enc.n_vocab)
    assert one.output == "Hello" + enc.decode(api.tokens[0]) + "\n"
    shown = r.invoke(main, args + ["--no-stop", "--show-depth", "--loops", "3"])
    assert shown.exit_code == 0, shown.output
    depths = [int(x) for x in re.findall(r"\[(\d)\]", shown.stdout)]
    assert len(depths) == 8 and all(1 <= d <= 3 for d in depths)
    assert "mean depth" in shown.stderr and "KV cache" in shown.stderr
    batch = r.invoke(main, ["generate", export, "-p", "ab", "-p", "a longer prompt", "-n", "4", "-t", "0"])
    assert batch.exit_code == 0 and "--- [0] ---\nab" in batch.output and "--- [1] ---\na longer prompt" in batch.output
    bad = r.invoke(main, ["generate", export, "-p", "x", "--loops", "9"])
    assert bad.exit_code != 0 and "1..4" in bad.output


def test_cli_with_gpt2_tokenizer(export):
    """The real GPT-2 BPE (placed offline by data_prep's asset step) end to end through the CLI."""
    enc = inference_cli.get_tokenizer()
    assert enc.encode("Hello world") == [15496, 995]
    res = CliRunner().invoke(main, ["generate", export, "-p", "Hello world", "-n", "5", "--seed", "0"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("Hello world")
