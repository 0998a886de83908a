"""Resume on another world size or ZeRO stage: a checkpoint's DeepSpeed files (any stage 0-3, any number of ranks)
gathered into full per-parameter tensors, then put into this run's engine (any stage, any number of ranks).

The full state, by parameter name: `fp32` (master weights), `exp_avg`, `exp_avg_sq` (AdamW's moments) and AdamW's
step; plus DeepSpeed's step counters and the LR schedule's state. ZeRO 1-3 files are merged with the routines
of DeepSpeed's own `zero_to_fp32` (given the flat moment partitions in place of the flat weights: the same
layout); stage 0 holds plain `torch.optim` state. Every rank reads the whole checkpoint (CPU memory: about 3x the
fp32 weights), so no collective and no temp files. Why not DeepSpeed's universal checkpoint: docs/design.md
("Resume on another world size or ZeRO stage").

Loading: weights go into the module before `deepspeed.initialize` (`load_weights`; ZeRO builds its fp32 master
partitions from them), the moments into the optimizer's partitions after it (`load_optimizer`): torch AdamW's
per-parameter state under stage 0, this rank's slice of each flat group under ZeRO 1/2 (`bit16_groups` order,
padded, `dp` equal partitions) and of each parameter's partition under ZeRO-3 (`ds_tensor` layout).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.train.objective import PREFIX

MOMENTS = ("exp_avg", "exp_avg_sq")


def _load(f: Path) -> dict:
    return torch.load(f, map_location="cpu", weights_only=False)  # DeepSpeed's own files: ours, written by the run


def saved_layout(path: Path) -> tuple[int, int]:
    """(ZeRO stage, data-parallel ranks) of the DeepSpeed files in checkpoint dir `path`."""
    optim = sorted(path.glob("*_optim_states.pt"))
    if not optim:
        return 0, int(_load(path / "mp_rank_00_model_states.pt").get("dp_world_size", 1))
    sd = _load(optim[0])["optimizer_state_dict"]
    return int(sd["zero_stage"]), len(optim)


def full_state(path: Path) -> dict:
    """{"params": {name: {"fp32", "exp_avg", "exp_avg_sq"}}, "step", "engine": {...}, "lr_scheduler"} of
    checkpoint dir `path`, whatever stage and world size wrote it; names are the network's (`LoopedLM`)."""
    out = _full_state(path)
    out["params"] = {_net_name(k): v for k, v in out["params"].items()}
    return out


def _net_name(k: str) -> str:
    """A parameter's name in the network: DeepSpeed's files name it inside the `Objective` wrapper (`net.<name>`),
    or bare when written before the wrapper existed."""
    return k.removeprefix(PREFIX)


def _full_state(path: Path) -> dict:
    stage, ws = saved_layout(path)
    if stage == 0:
        sd = _load(path / "mp_rank_00_model_states.pt")
        out = {"engine": sd, "params": {k: {"fp32": v.float()} for k, v in sd["module"].items()}, "order": None}
        opt = sd["optimizer"]
        ids = [i for g in opt["param_groups"] for i in g["params"]]
        out["order"] = ids  # saved indices in param-group order: names come from the module (load_optimizer)
        out["indexed"] = {i: opt["state"].get(i, {}) for i in ids}
        return out
    from deepspeed.utils import zero_to_fp32 as z

    model_files = z.get_model_state_files(str(path))
    models = z.parse_model_states(model_files)
    optim = [_load(f)["optimizer_state_dict"] for f in z.get_optim_files(str(path))]
    pads = optim[0].get("param_alignment_paddings")
    if stage <= 2:
        groups = {"fp32": [o["single_partition_of_fp32_groups"] for o in optim]}
        inner = [o["base_optimizer_state"]["state"] for o in optim]
    else:
        groups = {"fp32": [o["fp32_flat_groups"] for o in optim]}
        inner = [o["optimizer_state_dict"]["state"] for o in optim]
    n = len(groups["fp32"][0])
    for m in MOMENTS:
        groups[m] = [[st[g][m] for g in range(n)] for st in inner]
    names = [k for s in models[0].param_shapes for k in s]
    params = {k: {} for k in names}
    for key, flat in groups.items():
        if stage <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(ws, flat, models, True, pads)
        else:
            merged = z._get_fp32_state_dict_from_zero3_checkpoint(ws, flat, models, True)
        for k in names:
            params[k][key] = merged[k].contiguous().float()  # ZeRO-3: a GatheredTensor until materialised
    return {"engine": _load(model_files[0]), "params": params, "step": inner[0][0]["step"], "order": None}


def load_weights(model, full: dict) -> None:
    """The checkpoint's fp32 weights into `model` (before deepspeed.initialize); names stage 0's moments."""
    named = dict(model.named_parameters())
    if full["order"] is not None:  # written under stage 0: torch state by index, in model.param_groups order
        names = {id(p): k for k, p in named.items()}  # (read before ZeRO-3 partitions the parameters)
        params = [p for g in model.param_groups(0.0) for p in g["params"]]
        for i, p in zip(full["order"], params):
            st = full["indexed"][i]
            for m in MOMENTS:
                full["params"][names[id(p)]][m] = st[m].float()
            full["step"] = st["step"]
        full["order"] = None
    with torch.no_grad():
        for k, p in named.items():
            p.copy_(full["params"][k]["fp32"].view_as(p))


def load_optimizer(engine, model, full: dict, rank: int) -> None:
    """AdamW's moments and step into this rank's partitions, DeepSpeed's counters and the LR schedule."""
    names = {id(p): k for k, p in model.named_parameters()}
    stage = engine.zero_optimization_stage()
    step = full["step"]
    zo = engine.optimizer
    if stage == 0:
        for g in zo.param_groups:
            for p in g["params"]:
                s = full["params"][names[id(p)]]
                zo.state[p] = {"step": _like_step(step), **{m: s[m].view_as(p).clone() for m in MOMENTS}}
    elif stage <= 2:
        for i, group in enumerate(zo.bit16_groups):
            part = zo.single_partition_of_fp32_groups[i]
            zo.optimizer.state[part] = {
                "step": _like_step(step),
                **{
                    m: _slice([full["params"][names[id(p)]][m] for p in group], rank * part.numel(), part.numel())
                    for m in MOMENTS
                },
            }
    else:
        for j, flat in enumerate(zo.fp32_partitioned_groups_flat):
            group = zo.fp16_groups[j]
            st = {}
            for m in MOMENTS:
                chunks = []
                for p in group:
                    pn = p.partition_numel()
                    chunks.append(_slice([full["params"][names[id(p)]][m]], rank * pn, pn))
                st[m] = torch.cat(chunks)
            zo.optimizer.state[flat] = {"step": _like_step(step), **st}
    sd = full["engine"]
    engine.global_steps, engine.global_samples = sd["global_steps"], sd["global_samples"]
    engine.skipped_steps = sd.get("skipped_steps", 0)
    sched = engine.lr_scheduler
    sched.load_state_dict(sd["lr_scheduler"])
    for g, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):  # the optimizer's own copy of the lr
        g["lr"] = lr


def _slice(tensors: list[torch.Tensor], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the tensors flattened one after another, zero-padded at the end."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    out = torch.zeros(numel, dtype=torch.float32)
    piece = flat[start : start + numel]
    out[: piece.numel()] = piece
    return out


def _like_step(step) -> torch.Tensor:
    return torch.tensor(float(step.item() if isinstance(step, torch.Tensor) else step))
