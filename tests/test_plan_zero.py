"""The planner's per-rank model states (pipeline/plan/zero.py) against what a real DeepSpeed engine holds: two
gloo ranks under the real launcher build tiny/t-loopformer under ZeRO 1, 2 and 3 in turn and run one step; each
rank sums `untyped_storage().nbytes()` over the distinct storages of the tensors the engine keeps (the padded flat
buffers as allocated), by role; the planner (pipeline.plan.core.Planner, fp32 as on CPU) must give the same bytes
up to DeepSpeed's alignment padding. Gradients are measured where they are held: when the reduction at the end of
backward starts (ZeRO-1: the full gradients) and after it (ZeRO-2/3: the rank's partition); parameters and optimizer
state after the step.

The engines are built and measured in part "plan_zero" of the shared launcher run (tests/two_ranks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, make_shards
from test_train_dist import DIST

STAGES = (1, 2, 3)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (a view into a flat buffer counts the whole buffer, once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _flat(v) -> list:
    if isinstance(v, dict):
        v = list(v.values())
    return [t for x in v for t in _flat(x)] if isinstance(v, (list, tuple)) else [v]


def _listed(opt, *names) -> list:
    """The tensors under these attributes of opt (tensors, lists or dicts of them, nested)."""
    return _flat([getattr(opt, n, None) for n in names])


def held(engine, part: str) -> int:
    """Bytes this rank holds for part: 'params' (the module's weights, ZeRO's flat run-dtype buffers and ZeRO-3's
    partitions), 'grads' (the parameters' .grad and ZeRO's gradient partitions and buffers, less the reduction
    bucket), 'bucket' (ZeRO-2's ipg buffer), 'optimizer' (the fp32 master partition and AdamW's two moments)."""
    opt, params = engine.optimizer, list(engine.module.parameters())
    if part == "params":
        return _bytes(
            [p.data for p in params]
            + [getattr(p, "ds_tensor", None) for p in params]
            + _listed(opt, "bit16_groups_flat", "fp16_partitioned_groups_flat", "lp_param_buffer")
        )
    if part == "grads":
        return _bytes(
            [p.grad for p in params]
            + _listed(
                opt, "averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer", "all_grad_tensors"
            )
        )
    if part == "bucket":
        return _bytes(
            _listed(opt, "ipg_buffer") + _flat([getattr(b, "buffer", None) for b in _listed(opt, "ipg_buckets")])
        )
    moments = [v for st in opt.optimizer.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return _bytes(moments + _listed(opt, "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"))


def _before_reduction(engine) -> dict:
    """Records, once, what the gradients hold when the reduction at the end of backward starts (DeepSpeed's
    epilogue; ZeRO-1 reduces there, at the accumulation boundary): 'grads' (storages), 'full' (the .grad tensors'
    own bytes), 'bucket'."""
    before, opt = {}, engine.optimizer

    def wrap(f):
        def wrapped(*a, **k):
            if not before:
                before.update(
                    grads=held(engine, "grads"),
                    bucket=held(engine, "bucket"),
                    full=sum(
                        q.grad.numel() * q.grad.element_size() for q in engine.module.parameters() if q.grad is not None
                    ),
                )
            return f(*a, **k)

        return wrapped

    for name in ("independent_gradient_partition_epilogue", "overlapping_partition_gradients_reduce_epilogue"):
        if hasattr(opt, name):
            setattr(opt, name, wrap(getattr(opt, name)))
    return before


def _cfg(tmp: str, stage: int):
    from pipeline.config import load_config

    return load_config(
        "tiny/t-loopformer",
        TINY
        + DIST
        + [
            f"data.dir={tmp}/rep",
            f"checkpoint.dir={tmp}/plan_z{stage}",
            f"train.zero_stage={stage}",
            "schedule.max_steps=1",
            "checkpoint.interval=0",
            "train.eval_interval=0",
        ],
    )


def two_rank_part(tmp: str) -> dict:
    """Each rank's part of the shared 2-rank run: an engine per ZeRO stage, one step each, its bytes by role."""
    from pipeline.train.trainer import Trainer

    res = {}
    for stage in STAGES:
        tr = Trainer.build(_cfg(tmp, stage), callbacks=[])
        engine = tr.engine
        x, y = tr.loader.next()
        before = _before_reduction(engine)
        engine.backward(engine(x, y).loss)
        r = {
            "grads_before_reduction": before.get("grads"),
            "grads_full": before.get("full"),
            "grads": held(engine, "grads"),
            "bucket": held(engine, "bucket"),
            "bucket_before": before.get("bucket"),
            "partition": sum(
                t.numel() * t.element_size() for t in _listed(engine.optimizer, "averaged_gradients") if t is not None
            ),
        }
        engine.step()
        r.update(
            params=held(engine, "params"),
            optimizer=held(engine, "optimizer"),
            P=sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
            sizes=sorted(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
        )
        res[stage] = r
    return res


@pytest.mark.slow  # the shared 2-rank launcher run
def test_planned_model_states_equal_what_deepspeed_holds_on_two_ranks(two_ranks):
    from pipeline.plan.core import Planner
    from pipeline.hardware import gpu

    both = two_ranks.part("plan_zero")  # per rank, by stage (JSON: the keys are strings)
    cfg = _cfg(str(two_ranks.tmp), 1)
    pl = Planner(cfg, gpu("cpu"))  # fp32, as the gloo ranks ran
    for stage in STAGES:
        plan = pl.memory(stage, "none", 2, 2)
        for rank, res in enumerate(both):
            r = res[str(stage)]
            # padding: ZeRO-1/2 pad each flat group to a multiple of nccl_start_alignment_factor (2) x N and ZeRO-3
            # each tensor to a multiple of N, so a rank's partition holds at most 2N elements more per tensor
            # (stage_1_and_2.py, stage3.py); at most 3 fp32 copies of a partition (master, exp_avg, exp_avg_sq)
            pad = 3 * 4 * 2 * 2 * len(r["sizes"])
            want = {
                "params": plan["params"],
                "optimizer": plan["optimizer"],
                # gradients: ZeRO-1 holds the full gradients until the reduction at the end of backward (at
                # the accumulation boundary; as views into the reduction bucket), ZeRO-2/3 their partition
                "grads_full" if stage == 1 else "partition": plan["grads"],
            }
            for part, planned in want.items():
                assert 0 <= r[part] - planned <= pad, (stage, rank, part, r[part], planned, pad)
            assert r["partition"] == r["optimizer"] // 3  # the reduced gradients fill the rank's fp32 partition
            # the reduction buffers ZeRO-1/2/3 allocate whole (reduce_bucket_size elements, two with overlap_comm):
            # ZeRO-1/2 during backward (released after the reduction), ZeRO-3 from its construction on
            bucket = max(r["bucket"], r["bucket_before"] or 0)
            assert bucket == plan["reduce_buffers"], (
                stage,
                rank,
                r["bucket"],
                r["bucket_before"],
                plan["reduce_buffers"],
            )
            print(
                f"ZeRO-{stage} rank {rank}: "
                + ", ".join(f"{k} {r[k]} (planned {v:.0f})" for k, v in want.items())
                + f"; reduction bucket {r['bucket_before']}"
            )


def _storages(tensors) -> set:
    return {t.untyped_storage()._cdata for t in tensors if t is not None}


def _bf16_step(engine, x, y) -> dict:
    """One optimizer step of a bf16 ZeRO-1/2 engine, observed: the reduction buffers (setup_buckets, during
    backward), whether any fp32 gradient exists between backward and step, the gradient partition then (bytes),
    the fp32 gradients inside `step()` per group, and the peak of what the step allocates (LiveBytes: new
    storages, the ones that already exist left out)."""
    import torch

    from pipeline.plan.trace import LiveBytes

    opt, seen, buffers = engine.optimizer, {"fp32_grads": []}, {}
    setup, step_group = opt.setup_buckets, opt._optimizer_step

    def setup_buckets(*a, **k):  # called at every gradient; allocates at the first of a backward
        setup(*a, **k)
        buffers.update(
            {t.untyped_storage()._cdata: (t.dtype, t.numel()) for b in opt.ipg_buckets.values() for t in b.buffer}
        )

    def optimizer_step(i):
        held = [j for j, m in enumerate(opt.single_partition_of_fp32_groups) if m.grad is not None]
        seen["fp32_grads"].append((held, opt.single_partition_of_fp32_groups[i].grad.dtype))
        return step_group(i)

    opt.setup_buckets, opt._optimizer_step = setup_buckets, optimizer_step
    engine.backward(engine(x, y).loss)
    seen["fp32_after_backward"] = [m.grad for m in opt.single_partition_of_fp32_groups if m.grad is not None]
    grads = _listed(opt, "averaged_gradients")
    seen["grads"] = _bytes(grads)
    params = list(engine.module.parameters())
    moments = [v for st in opt.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    live = LiveBytes()  # views of what exists (the gradients, the master partition) are not new storages
    live._seen |= _storages(grads + params + moments + _listed(opt, "single_partition_of_fp32_groups"))
    with live:
        engine.step()
    seen["step_peak"] = live.peak()
    seen["buffers"] = list(buffers.values())
    return seen


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_zero_buffers_and_optimizer_step_as_planned(stage, tmp_path):
    """A bf16 ZeRO-1/2 engine (one process, CPU): the reduction buffers are bf16 (`_gradient_reduction_buffer_dtype`
    is the model's dtype unless data_types.grad_accum_dtype says otherwise), and no fp32 gradient is held after
    backward: the master partition's fp32 gradient exists inside `step()` only, one group at a time. So the plan
    counts none at backward's peak and the optimizer step apart (`optimizer_step_bytes`: the gradient partition,
    then the larger of the norm's fp64 copy of the largest gradient and a group's flattened gradient with its fp32
    copy); the second step is measured (the first also creates Adam's moments, optimizer state)."""
    import torch

    from pipeline.hardware import gpu
    from pipeline.plan.core import Planner
    from pipeline.train.trainer import Trainer

    make_shards(tmp_path / "rep", windows=4)
    cfg = _cfg(str(tmp_path), stage)
    for k, v in {"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 2, "grad_accum_steps": 1}.items():
        setattr(cfg.train, k, v)
    tr = Trainer.build(cfg, callbacks=[])
    x, y = tr.loader.next()
    tr.engine.backward(tr.engine(x, y).loss)
    tr.engine.step()
    seen = _bf16_step(tr.engine, x, y)
    plan = Planner(cfg, gpu("cpu")).memory(stage, "none", 2, 1)
    assert {dt for dt, _ in seen["buffers"]} == {torch.bfloat16}
    assert sum(2 * n for _, n in seen["buffers"]) == plan["reduce_buffers"] == 2 * 500_000_000 * (stage == 2) + 1e9
    assert seen["fp32_after_backward"] == [] and seen["fp32_grads"] == [([0], torch.float32), ([1], torch.float32)]
    P = sum(p.numel() for p in tr.engine.module.parameters())
    pad = 2 * 2 * len(seen["fp32_grads"])  # each flat group padded to a multiple of 2 elements (stage_1_and_2.py)
    assert plan["grads"] == 2 * P and 0 <= seen["grads"] - plan["grads"] <= pad  # one rank's partition: all, bf16
    measured = seen["grads"] + seen["step_peak"]
    assert 0 <= measured - plan["optimizer_step"] <= 3 * pad, (measured, plan["optimizer_step"])
