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
from test_train import TINY
from test_train_dist import DIST

pytestmark = pytest.mark.slow  # real multi-process runs (`-m 'not slow'` skips them)

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
