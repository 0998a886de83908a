"""Gradient statistics (train.grad_stats), at log steps only (`Trainer.is_log_step`): the gradient norm of each
group of parameters, `grad_norm/<group>`, and the size of the step's update against the weights, `update_ratio` =
||w_after - w_before|| / ||w_before|| over the whole model and `update_ratio/<group>` per group (0 for a discarded
update). The groups, by parameter name (`group_of`): embeddings (wte, wpe; the LM head is tied to wte), layers.<i>
(each layer of the shared block, its modulator aside), modulators (each layer's modulator and the time and step
embeddings phi_t, phi_dt that feed them), router, other (the final norm); a group the model lacks is not logged.

The gradients are those the optimizer steps with: averaged over ranks and micro-batches, before clipping (their
total is the logged grad_norm); the weights are the fp32 ones the optimizer updates. Correct under every ZeRO stage
without gathering anything: each rank sums the squares of the elements it holds (`local`: ZeRO 0 holds every
parameter on every rank, counted on rank 0 alone; ZeRO 1 and 2, and ZeRO 0 in bf16, its fragment of each parameter
in the optimizer's fp32 partition, DeepSpeed's `_hp_mapping`; ZeRO 3 its partition, `safe_get_local_grad` /
`safe_get_local_fp32_param`) and the sums travel in the step's one all-reduce and host read (`StepMeter.add_sum`).
Its cost, at log steps: a pass over this rank's gradients and weights, and a copy of its fp32 weights from before
the optimizer step until after it.
"""

from __future__ import annotations

import math

import torch

from pipeline.train.hooks import Callback

EMBEDDINGS = ("wte", "wpe")
CONDITIONING = ("phi_t", "phi_dt")  # the time and step embeddings, whose output the modulators read


def group_of(name: str) -> str:
    """The statistics group of a LoopedLM parameter name (module doc)."""
    parts = name.split(".")
    if parts[0] in EMBEDDINGS:
        return "embeddings"
    if parts[0] in CONDITIONING or (parts[0] == "layers" and "modulator" in parts):
        return "modulators"
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    return "router" if parts[0] == "router" else "other"


def fp32_masters(optimizer) -> dict[int, torch.Tensor]:
    """{id(p): the fp32 weights the optimizer updates for p} where they are not p itself nor in a ZeRO partition:
    ZeRO 0 in bf16 (DeepSpeed's FP16_UnfusedOptimizer, one fp32 tensor beside each parameter); else {}."""
    from pipeline.train.ds import discard_kind

    if discard_kind(optimizer) != "fp16" or not hasattr(optimizer, "fp32_groups"):
        return {}
    pairs = zip(optimizer.fp16_groups, optimizer.fp32_groups)
    return {id(p): m for low, high in pairs for p, m in zip(low, high) if m.shape == p.shape}


def local(
    p: torch.nn.Parameter, rank: int, grad: bool = True, masters: dict | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(gradient, fp32 weights) of parameter p that this rank holds, flat (None: it holds none; gradient None too
    when not `grad`), and whether every rank holds all of them (ZeRO 0; `masters`: `fp32_masters`). The gradient
    only between the step's last backward and its optimizer step."""
    if hasattr(p, "ds_id"):  # ZeRO 3: this rank's partition, without the padding of the last one
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad

        part = p.ds_tensor.ds_numel
        n = max(0, min(part, p.ds_numel - rank * part))
        g = safe_get_local_grad(p).flatten()[:n] if grad else None
        return g, safe_get_local_fp32_param(p).flatten()[:n], False
    if hasattr(p, "_hp_mapping"):  # ZeRO 1/2, ZeRO 0 in bf16: p's fragment in this rank's optimizer partition
        m = p._hp_mapping
        if m is None:
            return None, None, False
        g = m.get_lp_grad_fragment(p._index_in_param_group).flatten() if grad else None
        if g is not None and g.numel() == p.numel():  # bf16's accumulation buffer holds all of p: our fragment
            g = g.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel)
        return g, m.hp_fragment.flatten(), False
    g = p.grad.flatten() if grad and p.grad is not None else None
    return g, (masters or {}).get(id(p), p).detach().flatten(), True


class GradStats(Callback):
    """grad_norm/<group>, update_ratio and update_ratio/<group> at log steps (module doc)."""

    def __init__(self) -> None:
        self.params: list[tuple[int, torch.nn.Parameter]] = []  # (group index, parameter)
        self.groups: list[str] = []
        self.share: list[bool] = []  # per parameter: this rank counts its elements (ZeRO 0: rank 0 alone)
        self.before: list | None = None  # a log step: this rank's fp32 weights before the optimizer step
        self.meter = None  # ... and its StepMeter, whose read brings the sums
        self.masters: dict = {}  # fp32_masters

    def pre_train(self) -> None:
        self.masters = fp32_masters(self.trainer.engine.optimizer)
        for name, p in self.trainer.model.named_parameters():
            if p.requires_grad:
                g = group_of(name)
                if g not in self.groups:
                    self.groups.append(g)
                self.params.append((self.groups.index(g), p))

    def _sums(self, tensors) -> torch.Tensor:
        """(G,) float64: per group, the sum of squares of `tensors` (one per parameter, taken one at a time; None
        adds nothing), each parameter's elements counted once over the ranks (`self.share`)."""
        out = torch.zeros(len(self.groups), dtype=torch.float64, device=self.trainer.device)
        for (i, _), x, share in zip(self.params, tensors, self.share):
            if x is not None and share:
                out[i] += x.double().square().sum()
        return out

    def pre_update(self, step: int, meter) -> bool:
        t = self.trainer
        self.before = self.meter = None
        if not t.cfg.train.grad_stats or not t.is_log_step(step):
            return True
        held = [local(p, t.rank, masters=self.masters) for _, p in self.params]
        self.share = [not replicated or t.rank == 0 for _, _, replicated in held]
        meter.add_sum("grad_stats/grad", self._sums([g for g, _, _ in held]))
        meter.add_sum("grad_stats/weight", self._sums([w for _, w, _ in held]))
        self.before = [w.detach().clone() if w is not None and s else None for (_, w, _), s in zip(held, self.share)]
        self.meter = meter
        return True

    def post_update(self, step: int, meter) -> None:
        if self.before is None:
            return
        after = [local(p, self.trainer.rank, grad=False, masters=self.masters)[1] for _, p in self.params]
        deltas = (a.double() - b if b is not None else None for a, b in zip(after, self.before))
        meter.add_sum("grad_stats/update", self._sums(deltas))
        self.before = None

    def post_step(self, step: int, metrics: dict) -> None:
        got = self.meter.summed if self.meter is not None else {}
        self.meter = None
        if "grad_stats/update" not in got:
            return
        grad, weight, update = got["grad_stats/grad"], got["grad_stats/weight"], got["grad_stats/update"]
        for g, name in enumerate(self.groups):
            metrics[f"grad_norm/{name}"] = math.sqrt(grad[g])
            metrics[f"update_ratio/{name}"] = math.sqrt(update[g] / weight[g]) if weight[g] > 0 else 0.0
        metrics["update_ratio"] = math.sqrt(sum(update) / sum(weight)) if sum(weight) > 0 else 0.0
