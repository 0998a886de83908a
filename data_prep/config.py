"""`PrepConfig`: every option of `tlf prep-data`, one doc line each.

Filled, in order, from the defaults, a YAML file (`--config FILE`, a flat mapping of these keys, or a
`prep:` section holding one), the command-line options, then `key=value` overrides. Unknown keys, wrong
types and inconsistent values raise `ConfigError` naming the key and its source.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from data_prep import foldtask
from data_prep.configlib import ConfigError, apply_overrides, check_once, f, read_yaml_mapping, set_key

FOLD = "depth-fold"  # the synthetic task with a known depth need per answer (data_prep/foldtask.py)
SOURCES = ("files", "demo", "demo-enwiki", "hf", "fineweb-edu", "openwebtext", FOLD)
# Named Hugging Face sources: (dataset, default config, split)
HF_ALIASES = {
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train"),
    "openwebtext": ("Skylion007/openwebtext", "", "train"),
}
DEMO_VAL_EVERY = 20
DEFAULT_VAL_EVERY = 0  # 0: val chosen by tokens (data_prep/valsplit.py)


@dataclass
class PrepConfig:
    source: str = f(
        "files",
        "Where documents come from: files (local), demo (State of the Union + Moby-Dick), "
        "demo-enwiki (gensim's enwiki sample), hf (any Hub dataset), fineweb-edu, openwebtext, "
        "depth-fold (the fold task: synthetic left fold of a Latin-square operation, a known depth need per answer).",
    )
    inputs: list = f(
        [],
        "Local inputs (source=files): files, globs or directories of .jsonl, .jsonl.zst, "
        ".parquet or .txt; directories are searched recursively; order is sorted by path.",
        items=str,
    )
    text_field: str = f(
        "text", "Field (jsonl key / parquet column / Hub column) holding a document's text.", nonempty=True
    )
    txt_mode: str = f(
        "file", "How .txt files split into documents: file (one per file), line, or paragraph (blank-line separated)."
    )
    hf_dataset: str = f("", "Hub dataset id for source=hf (e.g. HuggingFaceFW/fineweb-edu).")
    hf_config: str = f("", "Hub dataset config name (e.g. sample-10BT, sample-100BT); empty for the default.")
    hf_split: str = f("train", "Hub dataset split to stream.")
    hf_data_files: list = f(
        [],
        "Data files for source=hf with a packaged builder (hf_dataset=parquet/json/text), "
        "e.g. a local mirror read through the streaming code path.",
        items=str,
    )
    hf_timeout: float = f(15.0, "Seconds allowed to reach the Hub before failing with a clear error.", gt=0)
    out: str = f("", "Output directory (manifest.json and the shards).")
    name: str = f("", "Shard file prefix <name>_<split>_<index>.bin; empty: derived from the source.")
    shard_tokens: int = f(
        100_000_000,
        "Tokens per shard (the last shard of a split may be shorter; at most 2^31-1, the header's int32 count).",
        ge=1,
        le=2**31 - 1,
    )
    val_every: int = f(
        0,
        "Validation rule: document number i (0-based, in input order, counting only documents "
        "kept) goes to the val split when i % val_every == 0; 0 picks 20 for demo, 1 (all "
        "val) for demo-enwiki, otherwise val is chosen by tokens (10% of them until val holds 10,000, then 1%, "
        "at most 10M: docs/data.md); 1 puts everything in val; -1 writes no val split.",
        ge=-1,
    )
    max_tokens: int = f(0, "Stop once this many tokens (all splits, EOTs included) are written; 0: whole input.", ge=0)
    workers: int = f(
        -1,
        "Worker processes that tokenize (source=depth-fold: make documents); -1: all cores; 0: in the main process.",
        ge=-1,
    )
    batch_bytes: int = f(1 << 20, "Text per task sent to a worker (bytes, approximate).", ge=1)
    skip_bad: bool = f(False, "Skip (count and report) malformed lines and records without text instead of failing.")
    progress: bool = f(True, "Show a tqdm progress bar (tokens, tokens/s, ETA) on stderr.")
    seed: int = f(0, "source=depth-fold: seed of the generated documents (same seed and options: same bytes).", ge=0)
    depth_levels: int = f(
        4,
        "source=depth-fold: levels 1..L (a level-k segment folds k + 1 cells; its answer needs k loops).",
        ge=1,
        le=foldtask.MAX_LEVELS,
    )
    depth_docs: int = f(20000, "source=depth-fold: documents generated (max_tokens, if set, may cut it).", ge=1)
    fold_symbols: int = f(
        16,
        "source=depth-fold: symbols m of the folded operation g (an m x m Latin square).",
        ge=2,
        le=foldtask.MAX_SYMBOLS,
    )
    fold_rule_seed: int = f(0, "source=depth-fold: seed of the operation g (fixed for the whole stream).", ge=0)
    fold_typed: bool = f(
        False,
        "source=depth-fold: the cells x_1..x_k are input tokens of their own, the first cell and the answer state "
        "tokens (else one set of symbol tokens for all).",
    )
    fold_rule: str = f(
        "cyclic",
        "source=depth-fold: how g is drawn: cyclic (an isotope of the group Z_m) or random (a Latin square built row "
        "by row, no group behind it).",
    )
    fold_layout: str = f(
        "ordered",
        "source=depth-fold: ordered (a document is one segment per level, 1..L, the level a function of the "
        "position) or slots (a document is one slot of L + 3 tokens holding one segment of a uniformly drawn level; "
        "train with model.block_size a multiple of L + 3, so a window holds whole slots of mixed levels).",
    )

    # Config files written for the removed depth-hops source name its own options: each is a one-line error.
    REMOVED = {k: foldtask.HOPS_REMOVED for k in ("depth_chains", "depth_queries")}

    def validate(self) -> None:
        self._check_source()
        self._check_output()
        if self.source == FOLD:
            self._check_fold()

    def _check_source(self) -> None:
        """Where the documents come from: the source and the options that say what it reads."""
        if self.source == "depth-hops":
            raise ConfigError(f"source: {foldtask.HOPS_REMOVED}")
        if self.source not in SOURCES:
            raise ConfigError(f"source: {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.source == "files" and not self.inputs:
            raise ConfigError("inputs: source=files needs at least one input (file, glob or directory)")
        if self.source != "files" and self.inputs:
            raise ConfigError(f"inputs: given, but source={self.source} does not read local files (use source=files)")
        if self.source == "hf" and not self.hf_dataset:
            raise ConfigError("hf_dataset: source=hf needs a dataset id")
        if self.hf_data_files and self.source != "hf":
            raise ConfigError("hf_data_files: only used with source=hf")
        if self.txt_mode not in ("file", "line", "paragraph"):
            raise ConfigError(f"txt_mode: {self.txt_mode!r} is not one of file, line, paragraph")

    def _check_output(self) -> None:
        """What is written where, and by how many processes."""
        if not self.out:
            raise ConfigError("out: the output directory is required (--out DIR)")
        if self.name and ("/" in self.name or "_" in self.name):
            raise ConfigError(
                f"name: {self.name!r} must not contain '/' or '_' (shards are <name>_<split>_<index>.bin)"
            )

    def _check_fold(self) -> None:
        """The fold task's rule and layout (source=depth-fold; its sizes' ranges are checked as they are set)."""
        if self.fold_rule not in foldtask.RULES:
            raise ConfigError(f"fold_rule: {self.fold_rule!r} is not one of {', '.join(foldtask.RULES)}")
        if self.fold_layout not in foldtask.LAYOUTS:
            raise ConfigError(f"fold_layout: {self.fold_layout!r} is not one of {', '.join(foldtask.LAYOUTS)}")

    # Resolved values -------------------------------------------------------------------------------
    def resolved_val_every(self) -> int:
        if self.val_every:
            return self.val_every
        if self.source == "demo-enwiki":
            return 1  # a held-out perplexity set of another domain: all of it is val
        return DEMO_VAL_EVERY if self.source in ("demo", FOLD) else DEFAULT_VAL_EVERY

    def resolved_name(self) -> str:
        if self.name:
            return self.name
        if self.source == "files":
            return "data"
        if self.source == "hf":
            return self.hf_dataset.rsplit("/", 1)[-1].replace("_", "-").lower() or "hf"
        return self.source

    def resolved_workers(self) -> int:
        return (os.cpu_count() or 1) if self.workers == -1 else self.workers

    def hf_target(self) -> tuple[str, str, str]:
        """(dataset, config, split) for the Hub sources."""
        if self.source in HF_ALIASES:
            ds, cfg, split = HF_ALIASES[self.source]
            return ds, self.hf_config or cfg, self.hf_split or split
        return self.hf_dataset, self.hf_config, self.hf_split

    def fingerprint(self) -> dict:
        """The options that decide the bytes, resolved (the manifest's `source`; a rerun with the same is a no-op
        or resumes)."""
        return {
            **{k: getattr(self, k) for k in OUTPUT_KEYS},
            "val_every": self.resolved_val_every(),
            "name": self.resolved_name(),
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Options that change the bytes written; the rest (workers, progress, ...) may differ on resume.
OUTPUT_KEYS = (
    "source",
    "inputs",
    "text_field",
    "txt_mode",
    "hf_dataset",
    "hf_config",
    "hf_split",
    "hf_data_files",
    "name",
    "shard_tokens",
    "val_every",
    "max_tokens",
    "seed",
    "depth_levels",
    "depth_docs",
    "fold_symbols",
    "fold_rule_seed",
    "fold_rule",
    "fold_typed",
    "fold_layout",
)


def changed_options(recorded: dict, wanted: dict) -> list[str]:
    """The output options (sorted) in which a manifest's recorded `source` differs from `wanted`. An option the
    manifest does not record (it predates the option) counts as its default, and one it records that no longer
    exists (depth_chains, depth_queries: the removed depth-hops source's) is not compared, so adding or removing
    an option does not refuse the outputs made before it."""
    fields = {f.name: f.default for f in dataclasses.fields(PrepConfig)}
    old = {k: v for k, v in recorded.items() if k in fields}
    return sorted(k for k in set(old) | set(wanted) if old.get(k, fields.get(k)) != wanted.get(k))


def load_prep_config(
    yaml_file: str | None = None, values: dict | None = None, overrides: list[str] | tuple = ()
) -> PrepConfig:
    """Defaults < YAML file < values (from CLI options; None entries ignored) < key=value overrides (a key given
    twice among them is an error)."""
    check_once(overrides)
    cfg = PrepConfig()
    if yaml_file:
        path = Path(yaml_file)
        data = read_yaml_mapping(path, "prep-data options")
        if set(data) == {"prep"}:
            data = data["prep"]
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: 'prep' must be a mapping of prep-data options")
        for k, v in data.items():
            set_key(cfg, str(k), v, str(path))
    for k, v in (values or {}).items():
        if v is not None:
            set_key(cfg, k, v, f"option --{k.replace('_', '-')}")
    apply_overrides(cfg, list(overrides), validate=False)
    cfg.validate()
    return cfg
