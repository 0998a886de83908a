"""`tlf plan` (pipeline/plan/): the meta-device trace against what the real step measures at CPU sizes, its
FLOPs against model.flops_per_token, and the command's output and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.config import load_config
from pipeline.memory import SavedTensors, tensor_peak_mib
from helpers import RECIPE, spread_router
from pipeline.model import LoopedLM
from pipeline.model.looped import active_counts
from pipeline.plan.cli import plan_cmd
from pipeline.plan.core import Planner
from pipeline.hardware import gpu
from pipeline.plan.trace import trace_step
from pipeline.train.ds import build_optimizer
from pipeline.train.objective import Objective

B = 4
OVR = [
    "model.vocab_size=8192",
    f"train.micro_batch_size={B}",
    f"train.global_batch_size={B}",
    "train.grad_accum_steps=1",
    "train.precision=fp32",
]


def _measured(cfg):
    """What bench/train_step.py measures on CPU: weights + AdamW state + the peak growth of live tensors during one
    optimizer step whose shortcut pass is the longest (S = L - 1), with a router spread over depths 1..L; and the
    depth map that step ran and the bytes autograd kept for backward."""
    torch.manual_seed(0)
    model = spread_router(LoopedLM(cfg.model).train())
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.model.vocab_size, (B, cfg.model.block_size), generator=g) for _ in range(2))
    L = cfg.model.loops
    sc = torch.tensor([2] + [1] * (L - 2))
    opt, _ = build_optimizer(cfg, model)

    def step():
        Objective(model, cfg.objective)(x, y, sc).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's state exists, as after the bench's warm-up
    persistent = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
    )
    peak = persistent + tensor_peak_mib(step) * 2**20
    counts = None
    if model.router is not None:
        with torch.no_grad():
            counts = active_counts(model.route(model.embed(x)).depth(L, model._theta(None)), L)
    saved = SavedTensors()
    with saved:
        Objective(model, cfg.objective)(x, y, sc)
    return peak, counts, saved.total


# bench/train_step.py's d=512 configuration (bench/README.md `## train_step`), at one micro-batch of 4
D512 = ["model.d_model=512", "model.n_heads=8", "model.d_ff=1280", "model.block_size=256"]


def _config(variant: str, scale: str, *extra):
    """variant may name the expected router recipe, whose training step runs every token through every loop with
    a head per exit: 't-loopformer@expected', or an execution strategy: 't-loopformer#sorted'."""
    variant, _, execution = variant.partition("#")
    variant, _, recipe = variant.partition("@")
    ex = [f"model.execution={execution}"] if execution else []
    return load_config(f"{scale}/{variant}", [*(RECIPE[recipe] if recipe else ()), *ex, *extra])


@pytest.mark.parametrize(
    "variant,size",
    [
        (v, size)
        for v in ("loopformer", "t-loopformer", "t-loopformer@expected", "t-loopformer#sorted", "t-loopformer#bucketed")
        for size in ("tiny", "d512")
        if not (v.endswith("#bucketed") and size == "d512")  # bucketed lays loops out as compact does, longer
    ],
)
def test_planned_peak_matches_the_measured_step(variant, size):
    cfg = _config(variant, "tiny", *OVR) if size == "tiny" else _config(variant, "small", *OVR, *D512)
    peak, counts, saved = _measured(cfg)
    if cfg.objective.router.recipe == "expected":
        counts = None  # the measured step ran every loop whatever the router says; the plan knows it itself
        assert Planner(cfg, gpu("cpu")).counts is None
    pl = Planner(cfg, gpu("cpu"), counts=counts)
    planned = pl.memory(0, "none", B, 1)
    assert abs(planned["peak"] / peak - 1) <= 0.05, (planned["peak"], peak)
    assert sum(pl.trace("none", B).saved.values()) == saved  # the same bytes kept for backward, to the byte
    assert planned["params"] == 4 * sum(p.numel() for p in LoopedLM(cfg.model).parameters())


@pytest.mark.parametrize("variant", ["loopformer", "t-loopformer", "t-loopformer@expected"])
def test_traced_flops_match_flops_per_token(variant):
    cfg = _config(variant, "tiny")
    T, L = cfg.model.block_size, cfg.model.loops
    sc = torch.tensor([2] + [1] * (L - 2))
    full = np.full((1, L), T)  # every token every loop: the formula's attention over the whole context
    tr = trace_step(cfg, 2, torch.float32, full, sc, count_flops=True)
    with torch.device("meta"):
        model = LoopedLM(cfg.model)
    heads = (L if cfg.objective.router.recipe == "expected" else 1) + 1  # a head per exit, and the shortcut pass's
    ref = model.flops_per_token(L + len(sc), T, heads) * 2 * T
    assert abs(tr.flops / ref - 1) <= 0.01, tr.flops / ref
    cfg.train.activation_checkpointing = "loop"  # recomputation is traced: more FLOPs
    assert trace_step(cfg, 2, torch.float32, full, sc, count_flops=True).flops > tr.flops


@pytest.mark.parametrize("ac", ["loop", "layer"])
def test_planned_peak_under_activation_checkpointing_matches_the_measured_step(ac, monkeypatch):
    """A size where the loops, not the LM head, hold the memory: checkpointing frees most of it, in the plan too."""
    from pipeline.model import looped
    from pipeline.train.ac import apply_ac

    cfg = load_config(
        "small/loopformer",
        OVR + ["model.vocab_size=256", "model.block_size=256", f"train.activation_checkpointing={ac}"],
    )
    init = looped.LoopedLM.__init__

    def checkpointed(self, c):  # the model _measured builds, checkpointed as the trainer does
        init(self, c)
        apply_ac(self, ac)

    monkeypatch.setattr(looped.LoopedLM, "__init__", checkpointed)
    peak, _, _ = _measured(cfg)
    monkeypatch.undo()
    pl = Planner(cfg, gpu("cpu"))
    planned = pl.memory(0, ac, B, 1)["peak"]
    assert abs(planned / peak - 1) <= 0.05, (planned, peak)
    assert planned < 0.5 * pl.memory(0, "none", B, 1)["peak"]


def test_the_plan_traces_an_objective_with_a_state_of_its_own():
    """The kinds recipe's table is the objective's buffer, not the network's: the trace moves it to the meta device with the
    network and runs its update there (it failed with `not on the expected device meta`, and then on a boolean
    index, whose size a meta tensor cannot know); the planned peak still matches the measured step."""
    cfg = load_config("tiny/base-loop-router", [*OVR, *RECIPE["kinds"]])
    peak, _, saved = _measured(cfg)
    pl = Planner(cfg, gpu("cpu"))
    planned = pl.memory(0, "none", B, 1)
    assert abs(planned["peak"] / peak - 1) <= 0.05, (planned["peak"], peak)
    assert sum(pl.trace("none", B).saved.values()) == saved


def test_router_depth_lowers_the_plan():
    cfg = load_config("tiny/t-loopformer")
    hw = gpu("cpu")
    shallow, deep = (Planner(cfg, hw, mean_depth=m).memory(1, "none", 4, 1)["activations_loops"] for m in (1.5, 3.5))
    assert shallow < deep


def test_plan_command_json_and_sweep(tmp_path):
    out = tmp_path / "new" / "dir" / "plan.json"  # its directories are made
    r = CliRunner().invoke(
        plan_cmd,
        ["tiny/t-loopformer", "--gpus", "2", "--gpu", "h100-80gb", "train.micro_batch_size=2", "--json", str(out)],
    )
    assert r.exit_code == 0, r.output
    assert "FITS" in r.output and "GPU-hours" in r.output
    assert "[tlf] planning tiny/t-loopformer on 2 x h100-80gb" in r.output  # what bad input must not reach
    p = json.loads(out.read_text())
    assert p["precision"] == "bf16" and p["grad_accum"] == 1 and p["memory"]["fits"]
    assert set(p["checkpointing_modes"]) == {"none", "loop", "layer"}
    assert p["memory"]["peak"] > p["memory"]["params"] + p["memory"]["optimizer"]
    r = CliRunner().invoke(
        plan_cmd,
        [
            "tiny/t-loopformer",
            "--gpus",
            "1",
            "--gpu",
            "cpu",
            "--sweep",
            "zero=0,3",
            "--sweep",
            "ac=none,layer",
            "--json",
            "-",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]  # (the planning line goes to stderr)
    assert len(rows) == 4
    by = {(x["zero_stage"], x["activation_checkpointing"]): x["peak"] for x in rows}
    assert by[(0, "layer")] < by[(0, "none")]


@pytest.mark.parametrize(
    "args, msg",
    [
        (["tiny/t-loopformer", "--gpu", "v100"], "'--gpu': 'v100' is not one of"),
        (["tiny/t-loopformer", "--gpus", "3", "--gpu", "cpu"], "not a multiple of train.micro_batch_size=4 x 3 GPUs"),
        (["tiny/t-loopformer", "--sweep", "zero=5"], "zero=5 is not one of"),
        (["tiny/t-loopformer", "train.nope=1"], "train.nope"),
        (
            [
                "tiny/base",
                "--gpus",
                "1",
                "--gpu",
                "cpu",
                "train.global_batch_size=1",
                "train.micro_batch_size=1",
                "model.d_model=8192",
                "model.n_heads=64",
                "model.d_ff=32768",
            ],
            "does not fit on cpu",
        ),
    ],
)
def test_bad_input_is_one_line(args, msg):
    r = CliRunner().invoke(plan_cmd, args)
    assert r.exit_code != 0 and msg in r.output and "Traceback" not in r.output, r.output


def test_a_bf16_plan_with_fp32_gradient_accumulation_is_one_line(tmp_path):
    """The plan follows DeepSpeed's default for a bf16 ZeRO-1/2 run (gradients and their reduction buffers in
    bf16, the fp32 gradient only inside the optimizer step); a template asking for fp32 accumulation takes paths
    the plan does not model, and says so instead of planning them as the default."""
    from pipeline.train.ds import ds_config_dir

    ds = json.loads((ds_config_dir() / "zero1.json").read_text())
    ds["data_types"] = {"grad_accum_dtype": "fp32"}
    path = tmp_path / "zero1_fp32_accum.json"
    path.write_text(json.dumps(ds))
    args = ["tiny/t-loopformer", "--gpus", "1", "--gpu", "h100-80gb", "train.zero_stage=1", f"train.ds_config={path}"]
    r = CliRunner().invoke(plan_cmd, args)
    assert r.exit_code != 0 and "data_types.grad_accum_dtype=fp32" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) <= 2, r.output  # the planning line, then the error


def test_the_trace_chunks_the_heads_as_the_planned_device_does():
    """The fused heads take 32 x more rows per chunk on a GPU (head_loss.rows_per_chunk): a plan for a GPU traces
    those chunks on the meta device, a plan for the CPU host the CPU's, and the real rule is back afterwards."""
    from pipeline.model import head_loss
    from pipeline.plan.trace import on_meta

    for dev, rows in (("cuda", 1334), ("cpu", 41)):
        with on_meta(None, dev):
            assert head_loss.rows_per_chunk(50304, "meta") == rows
    assert head_loss.rows_per_chunk(50304, "meta") == 1334 and head_loss.rows_per_chunk(50304, "cpu") == 41


@pytest.mark.parametrize("ac", ["none", "loop"])
def test_the_largest_micro_batch_is_the_traces_own(ac):
    """Planner.max_micro_batch: on a device whose memory ends just above the traced peak at micro-batch 25, the
    answer is 25 (its peak fits, 26's does not), whatever a line through micro-batches 1 and 2 says (on a GPU the
    fused heads' chunk buffers are a constant there, and the line's slope came out too low: loopformer with loop
    checkpointing on an A100-40GB planned 191 where 61 fit)."""
    import dataclasses

    from pipeline.plan.core import Planner
    from pipeline.hardware import gpu

    cfg = load_config("tiny/loopformer", [])
    probe = Planner(cfg, gpu("a100-80gb"))
    hw = dataclasses.replace(gpu("a100-80gb"), memory=probe.memory(1, ac, 25, 8)["peak"] + 1)
    p = Planner(cfg, hw)
    assert p.max_micro_batch(1, ac, 8) == 25
    assert p.memory(1, ac, 26, 8)["peak"] > hw.memory
