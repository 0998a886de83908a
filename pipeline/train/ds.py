"""Everything DeepSpeed: the process group, the DeepSpeed config built from ours, AdamW and its schedule, and
the one call to `deepspeed.initialize` (model code stays single-device).

The DeepSpeed config starts from a template (`train.ds_config`, default `ds_configs/zero{train.zero_stage}.json`);
every `"auto"` value in it is filled from our config, so batch sizes live in `train.*` only:
train_micro_batch_size_per_gpu = train.micro_batch_size, gradient_accumulation_steps = train.grad_accum_steps,
train_batch_size = train.global_batch_size (checked: micro x accum x world size), gradient_clipping =
optim.grad_clip, bf16.enabled = (precision is bf16). A template that fixes a batch size or a ZeRO stage different
from ours is an error naming both values.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
from pathlib import Path

import torch

from data_prep.files import read_json
from pipeline.config import Config, ConfigError
from pipeline.device import resolve_device as _resolve_device

BATCH_KEYS = {
    "train_batch_size": "global_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum_steps",
}


def ds_config_dir() -> Path:
    here = Path(__file__).resolve().parent.parent.parent / "ds_configs"  # source checkout / editable install
    return here if here.is_dir() else Path(sys.prefix) / "share" / "tlf" / "ds_configs"


def resolve_device(cfg: Config) -> str:
    """'cpu' or 'cuda' for train.device (pipeline.device.resolve_device)."""
    return _resolve_device(cfg.train.device, "train.device")


def resolve_precision(cfg: Config, device: str) -> str:
    p = cfg.train.precision
    if p == "auto":
        return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return p


def build_ds_config(cfg: Config, world_size: int, precision: str) -> dict:
    """The DeepSpeed config of this run: the template with every "auto" filled from cfg (see module doc)."""
    cfg.check_world_size(world_size)
    path = Path(cfg.train.ds_config) if cfg.train.ds_config else ds_config_dir() / f"zero{cfg.train.zero_stage}.json"
    if not path.is_file():
        raise ConfigError(f"train.ds_config: DeepSpeed template {path} not found")
    ds = read_json(path, dict)  # a FileFormatError (a ConfigError) naming the template
    t = cfg.train
    for key, ours in BATCH_KEYS.items():
        want = getattr(t, ours)
        have = ds.get(key, "auto")
        if have != "auto" and have != want:
            raise ConfigError(
                f"{path}: {key}={have} but train.{ours}={want}; batch sizes live in train.* "
                f'(set it to "auto" in the template)'
            )
        ds[key] = want
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(cfg.optim.grad_clip)
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = precision == "bf16"
    elif bool(bf16["enabled"]) != (precision == "bf16"):
        raise ConfigError(f"{path}: bf16.enabled={bf16['enabled']} but train.precision resolves to {precision}")
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage", "auto")
    if stage == "auto":
        zero["stage"] = t.zero_stage
    elif stage != t.zero_stage:
        raise ConfigError(f"{path}: zero_optimization.stage={stage} but train.zero_stage={t.zero_stage}")
    for k in ("optimizer", "scheduler"):
        if k in ds:
            raise ConfigError(f"{path}: remove '{k}': tlf builds AdamW and its schedule from optim.* and schedule.*")
    return ds


def lr_multiplier(cfg: Config):
    """f(step) = lr(step) / optim.lr for update number step (0-based): linear warm-up to optim.lr over
    schedule.warmup_steps updates, then cosine to schedule.min_lr at schedule.max_steps, constant, or wsd: stable
    at optim.lr until the last schedule.decay_steps updates, which decay in schedule.decay_shape to min_lr at the
    last update. Under wsd f(step) before the decay does not depend on max_steps, so a stable run extended by a
    larger max_steps continues as a run that had it from the start."""
    s, peak = cfg.schedule, cfg.optim.lr
    floor = s.min_lr / peak if peak > 0 else 0.0

    def f(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        if s.decay == "constant":
            return 1.0
        if s.decay == "wsd":
            progress = min(max((step + 1 - (s.max_steps - s.decay_steps)) / s.decay_steps, 0.0), 1.0)
            return floor + (1.0 - floor) * DECAY_SHAPES[s.decay_shape](progress)
        span = max(s.max_steps - s.warmup_steps, 1)
        progress = min((step - s.warmup_steps) / span, 1.0)
        return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))

    return f


# schedule.decay_shape: the share of (peak - floor) left at progress p in [0, 1] of the final decay
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


def build_optimizer(cfg: Config, model) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over model.param_groups (decay on matrices; none on embeddings, norms, biases) + LambdaLR, with the
    kernel `optim.implementation` names: `fused` (one kernel over all parameters: CUDA, and CPU from torch 2.4),
    `foreach`, `for-loop`, or `auto` = fused where this torch and device have it, else for-loop."""
    o = cfg.optim
    groups = model.param_groups(o.weight_decay)
    impl = o.implementation
    kw = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    for name in ["fused", "for-loop"] if impl == "auto" else [impl]:
        try:
            opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kw[name])
            break
        except RuntimeError as e:  # fused AdamW on a device or torch without the kernel
            if impl != "auto":
                raise ConfigError(f"optim.implementation={impl}: {e}") from None
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(cfg))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a rendezvous; the launchers of benches and tests use it too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory all-reduce, JIT-built by torch on first use


def extensions_dir() -> Path:
    """Where JIT-built extensions (DeepSpeed's shm op) go: $TORCH_EXTENSIONS_DIR, set to <venv>/.cache/
    torch_extensions when unset, so each virtualenv builds against its own torch once and never reuses another
    venv's build from the shared ~/.cache."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / ".cache" / "torch_extensions")
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def _ds_torch():
    """The module deepspeed.comm.torch (an import statement would give the attribute deepspeed.comm.torch, which is
    torch itself)."""
    import importlib

    return importlib.import_module("deepspeed.comm.torch")


def _shm_op(world_size: int, local_rank: int):
    """The shm op's builder for DeepSpeed's TorchBackend: none for a process group of one (nothing to all-reduce
    with; DeepSpeed would JIT-build it for minutes anyway), else DeepSpeed's own, with one line from local rank 0
    when it is about to build (not yet in extensions_dir())."""
    real = _ds_torch().build_shm_op
    if world_size == 1:
        return lambda: None
    root = extensions_dir()

    def build():
        built = [*root.glob(f"{SHM_OP}/{SHM_OP}*.so"), *root.glob(f"*/{SHM_OP}/{SHM_OP}*.so")]  # torch's layouts
        if local_rank == 0 and not built:
            print(
                f"[tlf] building DeepSpeed's {SHM_OP} op into {root} (once per virtualenv; about 30 s, needs "
                f"g++ and ninja)",
                file=sys.stderr,
                flush=True,
            )
        return real()

    return build


def init_distributed(device: str) -> tuple[int, int, int]:
    """Joins (or, in a single process without a launcher, creates) the process group: nccl on CUDA, gloo on CPU.
    Returns (rank, local_rank, world_size)."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator().device_name()
    if (device == "cpu") != (acc == "cpu"):
        raise ConfigError(
            f"train.device resolves to {device} but DeepSpeed's accelerator is {acc} "
            f"(set DS_ACCELERATOR={device} before the run)"
        )
    if not torch.distributed.is_initialized():
        ds_torch = _ds_torch()
        extensions_dir()
        real_build, ds_torch.build_shm_op = (
            ds_torch.build_shm_op,
            _shm_op(int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))),
        )
        try:
            _init_group(device, deepspeed)
        finally:
            ds_torch.build_shm_op = real_build
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if device == "cpu" and local > 1 and "OMP_NUM_THREADS" not in os.environ:
        # ranks sharing the CPU: split the cores (oversubscribed OpenMP threads spin against each other)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return rank, int(os.environ.get("LOCAL_RANK", rank)), ws


def _init_group(device: str, deepspeed) -> None:
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun: a fresh key space per restart
        _init_elastic(backend)
    if "WORLD_SIZE" in os.environ:  # under a launcher: rank, size and rendezvous come from its environment
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        if device == "cpu":
            _unlink_shm_buffer()
    else:  # plain `tlf train`: a process group of one, given explicitly rather than through RANK/WORLD_SIZE/
        # MASTER_PORT in os.environ, which child processes (a later `tlf train` started from the same Python)
        # would inherit and try to rendezvous on a port this process still holds. Only LOCAL_RANK, which the
        # DeepSpeed engine reads, is set.
        os.environ.setdefault("LOCAL_RANK", "0")
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )


def _init_elastic(backend: str) -> None:
    """The process group under torchrun, its keys prefixed with the restart count: the agent's store outlives a
    restart, and gloo ranks of a restarted group would otherwise read the dead attempt's addresses ("Gloo
    connectFullMesh failed ... Connection refused"). deepspeed.init_distributed then finds the group made."""
    from datetime import timedelta

    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the store, else rank 0
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        ws,
        is_master=not agent and rank == 0,
        timeout=timedelta(minutes=30),
    )
    store = torch.distributed.PrefixStore(f"tlf/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=ws)


def _unlink_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce (ranks on one machine) gives each rank a shared-memory buffer,
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (about 69 MB), that nothing
    removes: every run, and every killed run, left its buffers in RAM until reboot. Once every rank has mapped every
    buffer (`init_distributed` returns after that; the barrier makes it true for all ranks), each rank removes its
    own buffer's name: the mappings stay valid, and the memory goes back when the last process exits."""
    torch.distributed.barrier()
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{torch.distributed.get_rank()}"
    )
    try:
        os.unlink(Path("/dev/shm") / name)
    except OSError:  # no shm op (not built, ranks on several machines) or another OS: nothing to remove
        pass


def initialize(model, optimizer, scheduler, ds_config: dict):
    """The one `deepspeed.initialize` call: returns the engine (which owns optimizer and schedule).

    One process without ZeRO: the engine's gradient all-reduce after each backward would flatten every gradient
    into buckets, "reduce" them over a group of one and copy them back (about 2% of a d=512 CPU step, the same
    work on a GPU): it is switched off, which changes no gradient (tests/test_train.py). ZeRO stages keep it:
    their optimizer's partitions are filled by that reduction."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    if engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False
    return engine


def discard_update(engine) -> None:
    """engine.step() at the accumulation boundary with the update discarded (train.spike_policy=skip): the step's
    gradients are dropped and neither the optimizer (weights, AdamW moments and step count) nor the LR schedule
    steps, while DeepSpeed's counters move on as for a step whose fp16 gradients overflowed (global_steps and
    global_samples, skipped_steps + 1). It is that overflow branch of the optimizer that runs, its detection
    forced for this one call (`forced_overflow`): each ZeRO stage drops its own partitioned gradient buffers."""
    if not engine.is_gradient_accumulation_boundary():
        raise RuntimeError("discard_update: not at a gradient accumulation boundary")
    with forced_overflow(engine.optimizer):
        engine.step()


def discard_kind(optimizer) -> str:
    """Which of DeepSpeed's optimizers `optimizer` is, for `forced_overflow`: zero3, zero12 (ZeRO 1 and 2), fp16
    (ZeRO 0 in bf16: DeepSpeed's FP16 optimizers hold the fp32 master weights), bf16 (its BF16_Optimizer, another
    configuration's) or torch (ZeRO 0 in fp32: the AdamW itself); "" for another (an update cannot be discarded)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    kinds = (
        (DeepSpeedZeroOptimizer_Stage3, "zero3"),
        (DeepSpeedZeroOptimizer, "zero12"),
        ((FP16_Optimizer, FP16_UnfusedOptimizer), "fp16"),
        (BF16_Optimizer, "bf16"),
        (torch.optim.Optimizer, "torch"),
    )
    return next((name for cls, name in kinds if isinstance(optimizer, cls)), "")


@contextlib.contextmanager
def forced_overflow(opt):
    """Inside it, opt.step() takes its overflow branch (drop the gradients, set opt.overflow, update nothing), by
    instance attributes that shadow the methods deciding it; the loss scale is left alone (no overflow happened)."""

    def overflow(*args, **kwargs) -> bool:
        opt.overflow = True
        return True

    def drop(closure=None) -> None:  # BF16_Optimizer.step's branch for a non-finite norm; a torch optimizer: none
        overflow()  # (the engine then clears the torch optimizer's gradients itself: engine.zero_grad)
        if kind == "bf16":
            opt.clear_hp_grads()
            opt.clear_lp_grads()

    kind = discard_kind(opt)
    keep_scale = {"_update_scale": lambda *a, **k: None}
    patches = {
        "zero3": {"_overflow_check_and_loss_scale_update": overflow, **keep_scale},
        "zero12": {"check_grad_overflow": True, "check_overflow": overflow, **keep_scale},
        "fp16": {"step": lambda closure=None: opt._skip_invalid_grad_norm(), **keep_scale},
        "bf16": {"step": drop},
        "torch": {"step": drop, "overflow": True},
    }.get(kind)
    if patches is None:
        raise RuntimeError(f"cannot discard an update of {type(opt).__name__}: not one of DeepSpeed's optimizers")
    saved = {k: vars(opt)[k] for k in patches if k in vars(opt)}
    try:
        for k, v in patches.items():
            setattr(opt, k, v)
        yield
    finally:
        for k in patches:
            if k in saved:
                setattr(opt, k, saved[k])
            elif k in vars(opt):
                delattr(opt, k)
