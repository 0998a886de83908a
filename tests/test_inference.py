"""Recursion-wise KV cache exactness (docs/design.md §2): prefill + token-by-token decode = one full forward at every
position (fp32, atol 1e-5) for every tiny preset, M < L, and batches whose rows differ in depth and length;
plus proofs that a cache attending to an empty slot fails those checks."""

import numpy as np
import pytest
import torch
from helpers import DEVICES, RECIPE, spread_router

from pipeline.config import list_presets, load_config
from pipeline.inference.cache import LoopView, RecursionKVCache
from pipeline.inference.decode import Decoder
from pipeline.model import LoopedLM

torch.set_num_threads(1)
ATOL = 1e-5
TINY = sorted(p.split("/")[1] for p in list_presets() if p.startswith("tiny/"))
# variant@recipe: a router recipe's network (kinds: the forecast head); variant#strategy: its full forward (the
# oracle) under that model.execution, the decoder's own layout unchanged
CASES = TINY + ["base-loop-router@kinds", "t-loopformer#sorted", "t-loopformer#bucketed"]


def make(variant="t-loopformer", seed=0, device="cpu", *overrides):
    """A tiny model whose layers do something (non-zero modulators) and whose router depths vary a lot.
    variant may name a router recipe: 'base-loop-router@kinds' (tests/helpers.py RECIPE), or an execution strategy:
    't-loopformer#sorted'."""
    torch.manual_seed(seed)
    variant, _, execution = variant.partition("#")
    variant, _, recipe = variant.partition("@")
    extra = [*(RECIPE[recipe] if recipe else []), *([f"model.execution={execution}"] if execution else [])]
    model = LoopedLM(load_config(f"tiny/{variant}", [*extra, *overrides]).model)
    with torch.no_grad():
        for layer in model.layers:
            if layer.modulated:
                layer.modulator[1].weight.normal_(0, 0.05)
                layer.modulator[1].bias.normal_(0, 0.05)
    return spread_router(model, seed).to(device).eval()  # peaky router: tokens spread over all depths


def sequences(lengths=(5, 12, 1), total=20, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50304, (total,), generator=g).to(device) for _ in lengths], list(lengths)


def run(model, M, seqs, lens, dec=None, **kw):
    """Prefill each row's prompt (different lengths, one batch), then teacher-force the rest token by token.
    Returns (max |error| vs the full forward, per-step decode depths (steps, B), the decoder, oracle outputs)."""
    ref = [model(s[None], loops=M) for s in seqs]  # the oracle: one full forward per row
    dec = dec or Decoder(model, loops=M, **kw)
    logits, depth = dec.prefill([s[:n].tolist() for s, n in zip(seqs, lens)], reserve=2, all_logits=True)
    err = max((logits[b, :n] - ref[b].logits[0, :n]).abs().max().item() for b, n in enumerate(lens))
    for b, n in enumerate(lens):
        assert torch.equal(depth[b, :n], ref[b].depth[0, :n])
        assert bool((depth[b, n:] == 0).all())  # padding never runs a loop
    steps = []
    for t in range(len(seqs[0]) - max(lens)):
        tok = torch.stack([s[n + t] for s, n in zip(seqs, lens)])
        lo, d = dec.step(tok)
        for b, n in enumerate(lens):
            err = max(err, (lo[b] - ref[b].logits[0, n + t]).abs().max().item())
            assert int(d[b]) == int(ref[b].depth[0, n + t])
        steps.append(d.cpu())
    return err, torch.stack(steps), dec, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", CASES)
def test_prefill_decode_equals_full_forward(variant, device):
    model = make(variant, device=device)
    L = model.cfg.loops
    for M in sorted({L, max(1, L - 2)}):  # M = L and an elastic budget M < L
        seqs, lens = sequences(device=device)
        err, steps, dec, ref = run(model, M, seqs, lens)
        assert err <= ATOL, f"{variant} M={M}: max error {err}"
        # memory: loop i holds exactly the tokens that ran loop i (sum_i |A_i|), from the oracle's depths;
        # every fed token (all but each row's last) is in the cache
        fed = [n + len(steps) for n in lens]  # tokens of each row that went through prefill or a step
        expect = [int(sum((r.depth[0, :f] >= i).sum() for r, f in zip(ref, fed))) for i in range(1, M + 1)]
        assert dec.cache.entries_per_loop() == expect
        mem = dec.cache.memory()
        assert mem["dense_entries"] == M * sum(fed) and mem["entries"] == sum(expect)
        full = torch.cat([r.depth[0].cpu() for r in ref])
        if variant.startswith("t-loopformer") and M == L:  # depths really vary: within a step, across rows and lengths
            assert len(full.unique()) == M
            assert any(len(row.unique()) > 1 for row in steps)
            assert mem["entries"] < mem["dense_entries"]


def test_slot_layout_with_validity_mask_is_exact():
    model = make()
    for M in (4, 3):
        seqs, lens = sequences(lengths=(3, 9, 6))
        err, *_ = run(model, M, seqs, lens, layout="slots")
        assert err <= ATOL


class _EmptySlotsVisible(RecursionKVCache):
    """The authors' public code: slots at original positions, empty (zero) for exited tokens, no mask mu."""

    def _slot_mask(self, causal, i0, ridx, S):
        return causal


def test_attending_to_empty_slots_fails():
    """The same checks that pass above must fail for the authors' slots."""
    model = make()
    seqs, lens = sequences(lengths=(3, 9, 6))
    dec = Decoder(model, loops=4, layout="slots")
    attn = model.layers[0].attn
    dec._new_cache = lambda B, dev: _EmptySlotsVisible(
        4, len(model.layers), B, attn.n_heads, attn.head_dim, torch.float32, dev, layout="slots"
    )
    err, *_ = run(model, 4, seqs, lens, dec=dec)
    assert err > 10 * ATOL, f"attending to empty slots went unnoticed (max error {err})"


class _OneSlotTooMany(RecursionKVCache):
    """A compact cache that reads one entry past each row's length (an empty slot)."""

    def begin_loop(self, i, rows_np):
        v = super().begin_loop(i, rows_np)
        self._ensure(i - 1, v.S + 1)
        return LoopView(v.rows, v.slot, v.S + 1, None)


def test_compact_cache_reading_an_empty_slot_fails():
    model = make()
    seqs, lens = sequences(lengths=(1,), total=12)
    dec = Decoder(model, loops=4)
    attn = model.layers[0].attn
    dec._new_cache = lambda B, dev: _OneSlotTooMany(
        4, len(model.layers), B, attn.n_heads, attn.head_dim, torch.float32, dev
    )
    err, *_ = run(model, 4, seqs, lens, dec=dec)
    assert err > 10 * ATOL, f"reading an empty slot went unnoticed (max error {err})"


def test_decode_reads_no_modulator_weights():
    """Tables are built once per M; poisoning the modulators afterwards must not change decoding."""
    model = make("t-loopformer")
    seqs, lens = sequences(lengths=(4, 7))
    ref_err, *_ = run(model, 3, seqs, lens)
    dec = Decoder(model, loops=3)
    ref = [model(s[None], loops=3) for s in seqs]
    with torch.no_grad():
        for layer in model.layers:
            layer.modulator[1].weight.fill_(float("nan"))
    dec.prefill([s[:n].tolist() for s, n in zip(seqs, lens)])
    for t in range(len(seqs[0]) - max(lens)):
        lo, _ = dec.step(torch.stack([s[n + t] for s, n in zip(seqs, lens)]))
        for b, n in enumerate(lens):
            torch.testing.assert_close(lo[b], ref[b].logits[0, n + t], atol=ATOL, rtol=0)
    assert ref_err <= ATOL


def test_stopped_rows_do_no_work_and_write_nothing():
    model = make()
    seqs, lens = sequences(lengths=(5, 5))
    dec = Decoder(model, loops=4)
    dec.prefill([s[:5].tolist() for s in seqs])
    before = dec.cache.n_host.copy()
    lo, d = dec.step(torch.stack([s[5] for s in seqs]), live=np.array([True, False]))
    assert int(d[1]) == 0 and int(d[0]) >= 1
    assert (dec.cache.n_host[:, 1] == before[:, 1]).all() and dec.cache.pos_host.tolist() == [6, 5]
    assert (dec.cache.n_host[:, 0] - before[:, 0]).tolist() == [1 if i <= int(d[0]) else 0 for i in range(1, 5)]
    ref = model(seqs[0][None, :6], loops=4)
    torch.testing.assert_close(lo[0], ref.logits[0, 5], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["t-loopformer", "t-loopformer@budget"])
def test_frozen_exited_keys_decode_equals_full_forward(variant):
    """model.exited_keys=frozen: the decoder takes its full-depth path (an exited token projects keys and values
    of its final state into every later loop's cache), and that is the model: prefill and decode equal the
    forward at M = L and M < L, and every fed token is in every loop's cache."""
    model = make(variant, 0, "cpu", "model.exited_keys=frozen")
    for M in (4, 2):
        seqs, lens = sequences()
        err, steps, dec, ref = run(model, M, seqs, lens)
        assert err <= ATOL, f"M={M}: max error {err}"
        assert dec.full_depth
        fed = [n + len(steps) for n in lens]
        assert dec.cache.entries_per_loop() == [sum(fed)] * M
        assert len(torch.cat([r.depth[0] for r in ref]).unique()) == M  # the depths really vary


@pytest.mark.parametrize("keys", ["drop", "frozen"])
def test_prefix_exit_schedule_decode_equals_full_forward(keys):
    """model.exit_schedule=prefix (the expected recipe's network): the decoder's modulation tables are the
    model's, so prefill and decode equal the forward at M = L and M < L with either exited-key rule."""
    model = make("t-loopformer@budget", 0, "cpu", "model.exit_schedule=prefix", f"model.exited_keys={keys}")
    for M in (4, 2):
        seqs, lens = sequences()
        err, *_ = run(model, M, seqs, lens)
        assert err <= ATOL, f"M={M}: max error {err}"


def test_full_depth_ablation():
    """(b) of the benchmark: every token writes every loop. Same as the model when every depth is M; with the
    router on it stores M * T entries where the recursion-wise cache stores sum_i |A_i|."""
    model = make("loopformer")
    seqs, lens = sequences(lengths=(3, 8))
    err, *_ = run(model, 4, seqs, lens, full_depth=True)
    assert err <= ATOL
    model = make("t-loopformer")
    seqs, lens = sequences(lengths=(3, 8))
    ref = [model(s[None], loops=4) for s in seqs]
    dec = Decoder(model, loops=4, full_depth=True)
    dec.prefill([s[:n].tolist() for s, n in zip(seqs, lens)])
    for t in range(len(seqs[0]) - max(lens)):
        dec.step(torch.stack([s[n + t] for s, n in zip(seqs, lens)]))
    fed = [n + len(seqs[0]) - max(lens) for n in lens]
    assert dec.cache.entries_per_loop() == [sum(fed)] * 4
    rw = [int(sum((r.depth[0, :f] >= i).sum() for r, f in zip(ref, fed))) for i in range(1, 5)]
    assert sum(rw) < 4 * sum(fed)


def test_partial_batches_take_both_read_paths_exactly():
    """Loop i with most rows running reads the whole batch's cache (masked, no copy); with few rows running
    it gathers their entries. Both must be exact; this batch makes both happen."""
    model = make()
    seqs, lens = sequences(lengths=(2, 7, 4, 9, 1, 5), total=16, seed=3)
    kinds = []  # (rows running the loop, read the whole batch?) of every decode loop
    dec = Decoder(model, loops=4)
    orig = dec._new_cache

    def recording_cache(B, dev):
        cache = orig(B, dev)
        begin = cache.begin_loop

        def rec(i, rows):
            v = begin(i, rows)
            kinds.append((len(rows), v.full_read))
            return v

        cache.begin_loop = rec
        return cache

    dec._new_cache = recording_cache
    err, *_ = run(model, 4, seqs, lens, dec=dec)
    assert err <= ATOL
    assert any(f for _, f in kinds) and any(not f and 0 < n < 6 for n, f in kinds)


def test_each_decoder_builds_its_own_tables_from_the_current_weights():
    from pipeline.inference.decode import modulation_tables

    model = make("loopformer")
    a, b = Decoder(model, loops=4).tables, Decoder(model, loops=2).tables
    assert len(a[0]) == 10 and len(b[0]) == 3  # K = M(M+1)/2 rows per layer
    assert Decoder(model, loops=4).tables[0] is not a[0]  # never shared between decoders
    assert modulation_tables(make("base-loop"), 3) is None


@pytest.mark.parametrize("change", ["data_mul", "data_copy", "vector_to_parameters"])
def test_decoding_follows_weight_changes_that_bypass_autograd(change):
    """Weights changed through `.data` (or `vector_to_parameters`, as distributed optimizers do) move neither
    the parameter's identity nor its version counter: a decoder made afterwards must still see them."""
    model, other = make("loopformer"), make("loopformer", seed=7)
    idx = torch.randint(0, 50304, (2, 9), generator=torch.Generator().manual_seed(3))
    Decoder(model, loops=4).prefill(idx, all_logits=True)  # used once before the change
    if change == "data_mul":
        model.layers[0].modulator[1].weight.data.mul_(3)
    elif change == "data_copy":
        for p, q in zip(model.parameters(), other.parameters()):
            p.data.copy_(q.data)
    else:
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(other.parameters()), model.parameters())
    logits, _ = Decoder(model, loops=4).prefill(idx, all_logits=True)
    assert (logits - model(idx, loops=4).logits).abs().max().item() <= ATOL


def test_generate_after_a_dtype_change_uses_tables_of_the_new_dtype():
    from pipeline.inference.generate import generate

    model = make("t-loopformer")
    prompts = [[5, 6, 7, 8], [9, 10]]
    generate(model, prompts, max_new_tokens=3, temperature=0)  # fp32 use first
    model.to(torch.bfloat16)
    dec = Decoder(model, loops=4)
    assert all(t.dtype == torch.bfloat16 for t in dec.tables)
    g = generate(model, prompts, max_new_tokens=3, temperature=0)
    assert [len(t) for t in g.tokens] == [3, 3]
    idx = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits, _ = dec.prefill(idx, all_logits=True)
    # bf16 (8 mantissa bits): the forward's straight-through factor 1 + s - sg(s) rounds, the decoder skips it
    assert (logits.float() - model(idx, loops=4).logits.float()).abs().max().item() <= 2e-2
