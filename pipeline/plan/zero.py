"""Per-rank bytes of the model states (parameters, gradients, optimizer state) under DeepSpeed ZeRO 0-3 with
AdamW over N data-parallel ranks (docs/design.md §8).

The rules follow DeepSpeed's own code and estimators:
- `deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs`: 2P (bf16 weights) + 16P/N
  (fp32 master, Adam moments, fp32 gradient partition) per GPU for ZeRO-1/2;
- `deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`: 18P/N (bf16 weights and gradients
  partitioned too) + the largest layer gathered at once (4 x its parameters in its estimate);
- what `DeepSpeedZeroOptimizer` holds (stage_1_and_2.py): the flat bf16 (or fp32) weights on every rank, the
  rank's fp32 partition `single_partition_of_fp32_groups` (a clone, also in fp32 runs), its gradient partition
  in the run's dtype and Adam's exp_avg/exp_avg_sq on that partition; ZeRO-1 keeps full gradients until it
  reduces them at the end of the accumulation's last backward (then only its partition; tests/test_plan_zero.py),
  ZeRO-2 partitions them as they are reduced. The fp32 gradient a bf16 run's master partition needs is made
  inside `step()`, one parameter group at a time, and freed after the group's update: it is part of the optimizer
  step's peak (`optimizer_step_bytes`), not of the backward's (DeepSpeed's estimator counts it as held, hence
  its 16P/N). ZeRO-3 also partitions the weights (stage3.py), except that a parameter
  of at most `stage3_param_persistence_threshold` elements (DeepSpeed's default and ds_configs/zero3.json: 1e5)
  is "persistent": gathered once and kept whole on every rank beside its partition
  (parameter_offload.py `mark_persistent_parameters`); only the others are gathered per layer.
- ZeRO-0 fp32: the engine calls torch's AdamW directly (full weights, gradients, moments). ZeRO-0 bf16 runs
  DeepSpeed's `BF16_Optimizer` (bf16_optimizer.py): bf16 weights and gradients, a full fp32 gradient
  accumulator, and the fp32 master and moments partitioned over the ranks as under ZeRO-1.
"""

from __future__ import annotations


def model_state_bytes(
    P: int, stage: int, ranks: int, bf16: bool, largest_param: int = 0, persistent: int = 0
) -> dict[str, float]:
    """{params, grads, optimizer} bytes per rank for P parameters. ZeRO-3: largest_param, the numel of the largest
    non-persistent tensor (gathered whole while its layer runs); persistent, the numel of the persistent ones
    (`persistent_numel`)."""
    N = ranks
    w = 2 if bf16 else 4  # bytes of a weight/gradient element as the engine runs it
    adam = 8 * P / N  # exp_avg + exp_avg_sq (fp32) on this rank's partition
    master = 4 * P / N  # fp32 master partition (stage 1-3 and BF16_Optimizer)
    if stage == 0 and not bf16:
        return {"params": 4.0 * P, "grads": 4.0 * P, "optimizer": 8.0 * P}
    if stage == 0:  # BF16_Optimizer
        return {"params": 2.0 * P, "grads": 2.0 * P + 4.0 * P, "optimizer": master + adam}
    if stage == 1:
        return {"params": float(w * P), "grads": float(w * P), "optimizer": master + adam}
    if stage == 2:
        return {"params": float(w * P), "grads": w * P / N, "optimizer": master + adam}
    # stage 3: partitioned weights + the persistent ones whole + the largest other tensor gathered while it runs
    return {
        "params": w * P / N + w * persistent + w * largest_param,
        "grads": w * P / N + 4 * P / N * bf16,
        "optimizer": master + adam,
    }


def persistent_numel(sizes, threshold: int) -> tuple[int, int]:
    """ZeRO-3: (numel of the persistent parameters, numel of the largest other one) for tensors of these sizes
    and `stage3_param_persistence_threshold` (model_persistence_threshold left at DeepSpeed's unlimited default)."""
    return sum(n for n in sizes if n <= threshold), max([n for n in sizes if n > threshold], default=0)


def optimizer_step_bytes(stage: int, ranks: int, bf16: bool, group_sizes, largest_param: int) -> float:
    """ZeRO-1/2 (`DeepSpeedZeroOptimizer.step`, stage_1_and_2.py): the bytes beside the model states while the
    optimizer steps, when backward's activations are gone: the rank's gradient partition in the run's dtype, and
    the largest of what the step makes for a moment (tests/test_plan_zero.py measures both on a bf16 engine):
    - the gradient norm (`get_grad_norm_direct`): an fp64 copy of one gradient tensor at a time, 8 bytes per
      element of the largest one in the partition;
    - each parameter group in turn: its gradient partition flattened (run dtype) and, in a bf16 run, the fp32 copy
      the master partition steps with, freed after the group's update (fused AdamW makes nothing more).
    0 under the other stages: their step's peak is not modelled apart."""
    if stage not in (1, 2):
        return 0.0
    w = 2 if bf16 else 4
    part = max(group_sizes) / ranks  # the largest group's partition, elements
    return w * sum(group_sizes) / ranks + max(8 * min(largest_param, part), (w + 4 * bf16) * part)
