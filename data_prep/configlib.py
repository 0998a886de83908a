"""Dataclass configs read from YAML and `key=value` overrides: the machinery `tlf prep-data`'s `PrepConfig`
(data_prep/config.py) and the training `Config` (pipeline/config.py) share.

A config is a dataclass whose fields are made with `f(default, doc)`; nested dataclass fields are sections.
`set_key` sets a dotted key with type checks; an unknown key or a wrong type raises `ConfigError` naming the
key and its source (file, option or command line). It lives in data_prep, the lowest layer, so both layers
use one copy (README "Layout").
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import field, fields
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem, with the key and the source (file or command line) in its message."""


def f(default: Any, doc: str, **kw):
    """A dataclass field with a one-line doc (shown by `tlf config show --doc` and in docs/configuration.md)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Checks value against a field type; returns (ok, converted value)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        for a in args:
            if a is not type(None):
                ok, v = _type_ok(value, a)
                if ok:
                    return True, v
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "6e-4" as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if tp is list or origin is list:
        return isinstance(value, list), list(value) if isinstance(value, list) else value
    return True, value


def describe(tp: Any) -> str:
    """A field type as the error messages and `--doc` show it."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


# Spellings of other trainers (nanoGPT, litgpt, torchtitan, transformers) -> the key name here; `suggest` looks the
# name up in the section named, then in the others (train.lr -> optim.lr, training.steps -> schedule.max_steps).
ALIASES = {
    "learning_rate": "lr",
    "steps": "max_steps",
    "max_iters": "max_steps",
    "train_steps": "max_steps",
    "warmup": "warmup_steps",
    "warmup_iters": "warmup_steps",
    "lr_warmup_steps": "warmup_steps",
    "gradient_accumulation_steps": "grad_accum_steps",
    "max_norm": "grad_clip",
    "max_seq_length": "block_size",
    "seq_len": "block_size",
    "n_embd": "d_model",
    "dim": "d_model",
    "n_layer": "n_layers",
    "n_head": "n_heads",
    "optimizer": "optim",
    "lr_scheduler": "schedule",
    "training": "train",
}
# The difflib ratio a name of the same section needs to be suggested (loopz -> loops 0.8; logger_name -> run_name
# 0.63 is not: a suggestion that far off misleads more than it helps)
CLOSE = 0.75


def _leaves(obj: Any, prefix: str = "") -> dict[str, list[str]]:
    """{field name: [dotted keys with that name]} over obj and its sections."""
    out: dict[str, list[str]] = {}
    for fl in fields(obj):
        out.setdefault(fl.name, []).append(f"{prefix}{fl.name}")
        cur = getattr(obj, fl.name)
        if dataclasses.is_dataclass(cur):
            for k, v in _leaves(cur, f"{prefix}{fl.name}.").items():
                out.setdefault(k, []).extend(v)
    return out


def suggest(root: Any, section: Any, prefix: str, head: str, rest: str = "") -> list[str]:
    """What an unknown key `prefix + head` (+ `.rest`) may have meant: a close name in its own section, else the
    same name in another section, else the name `ALIASES` gives it, in this section or another ([] when none)."""
    names = [fl.name for fl in fields(section)]
    close = difflib.get_close_matches(head, names, n=1, cutoff=CLOSE)
    if close:
        return _within(root, section, prefix, close[0], rest)
    leaves = _leaves(root)
    for name in (head, ALIASES.get(head)):
        if name in names and name != head:
            return _within(root, section, prefix, name, rest)
        found = [k for k in leaves.get(name, []) if k != f"{prefix}{head}"]
        if found:
            return [k + (f".{rest}" if rest else "") for k in found]
    return []


def _within(root: Any, section: Any, prefix: str, name: str, rest: str) -> list[str]:
    """The suggestion `prefix + name` (+ `.rest`), the rest checked in turn when `name` is a section."""
    cur = getattr(section, name)
    if not rest or not dataclasses.is_dataclass(cur):
        return [f"{prefix}{name}" + (f".{rest}" if rest else "")]
    head, _, tail = rest.partition(".")
    if head in {fl.name for fl in fields(cur)}:
        return [f"{prefix}{name}.{rest}"]
    return suggest(root, cur, f"{prefix}{name}.", head, tail) or [f"{prefix}{name}"]


def set_key(obj: Any, key: str, value: Any, source: str, prefix: str = "", root: Any = None) -> None:
    """Sets obj.<key> (dotted) with type checks; unknown keys are errors (with `suggest`'s hint; root: the
    whole config, whose other sections it searches), and so are keys listed in the dataclass's `MOVED` ({old
    field: new dotted key}), with a message naming the new key, and in its `REMOVED` ({old field: why, and what
    to use instead}). A section whose class defines `CHOICE` (a field name) and `choices()` ({name: class}) is a
    choice: setting that field makes the section an instance of the chosen class, its fields at their defaults (in
    a mapping, the choice is made before the other keys are set)."""
    root = obj if root is None else root
    head, _, rest = key.partition(".")
    names = {fl.name: fl for fl in fields(obj)}
    full = f"{prefix}{head}"
    _check_known(obj, root, head, rest, names, source, prefix)
    cur = getattr(obj, head)
    if dataclasses.is_dataclass(cur):
        if not rest and not isinstance(value, dict):
            raise ConfigError(f"{source}: '{full}' is a section; give a mapping, got {value!r}")
        items = {rest: value} if rest else {str(k): v for k, v in value.items()}
        choice = getattr(type(cur), "CHOICE", None)
        if choice in items:  # the section's class first: the other keys are the chosen class's
            cur = _chosen(cur, items.pop(choice), source, f"{full}.{choice}")
            setattr(obj, head, cur)
        for k, v in items.items():
            set_key(cur, k, v, source, f"{full}.", root)
        return
    if rest:
        raise ConfigError(f"{source}: '{full}' is not a section, so '{prefix}{key}' does not exist")
    tp = typing.get_type_hints(type(obj))[head]
    ok, v = _type_ok(value, tp)
    if not ok:
        raise ConfigError(f"{source}: '{full}' expects {describe(tp)}, got {value!r}")
    setattr(obj, head, v)


def _check_known(obj: Any, root: Any, head: str, rest: str, names: dict, source: str, prefix: str) -> None:
    """A key moved or removed (the dataclass's MOVED / REMOVED), or not a field: a ConfigError naming it."""
    full = f"{prefix}{head}"
    moved = getattr(type(obj), "MOVED", {}).get(head)
    if moved is not None:
        raise ConfigError(f"{source}: '{full}' moved to '{moved}'")
    removed = getattr(type(obj), "REMOVED", {}).get(head)
    if removed is not None:
        raise ConfigError(f"{source}: '{full}': {removed}")
    if head in names:
        return
    choice = getattr(type(obj), "CHOICE", None)
    if choice is not None:  # a choice's keys are those of the chosen class
        keys = ", ".join(n for n in names if n != choice) or "none"
        raise ConfigError(
            f"{source}: unknown config key '{full}': {choice} {getattr(obj, choice)!r} has the keys {keys}"
        )
    close = suggest(root, obj, prefix, head, rest)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ConfigError(f"{source}: unknown config key '{full}'{hint}")


def _chosen(section: Any, name: Any, source: str, key: str) -> Any:
    """The section as the class `name` chooses: itself if it is that choice already, else a fresh instance."""
    choices = type(section).choices()
    if not isinstance(name, str) or name not in choices:
        raise ConfigError(f"{source}: '{key}' expects one of {', '.join(map(repr, choices))}, got {name!r}")
    if getattr(section, type(section).CHOICE) == name:
        return section
    new = choices[name]()
    setattr(new, type(section).CHOICE, name)
    return new


def read_yaml_mapping(path: Path, what: str = "sections") -> dict:
    """A YAML file whose top level is a mapping; a missing file, bad YAML or another shape is a ConfigError."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of {what}")
    return data


def read_yaml_chain(path: Path, seen: tuple = (), resolve=None) -> list[tuple[str, dict]]:
    """Returns [(source, mapping), ...] in merge order, following `inherit:`: each entry a file path relative to
    the file, or a name `resolve` turns into a path (a preset name such as tiny/t-loopformer; the caller's
    resolver, as this layer knows no presets; None when it is not one)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: inherit cycle ({' -> '.join(str(p) for p in seen)})")
    data = read_yaml_mapping(path)
    parents = data.pop("inherit", []) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list):
        raise ConfigError(f"{path}: inherit: must be a file name or a list of file names, not {parents!r}")
    out: list[tuple[str, dict]] = []
    for p in parents:
        found = path.parent / p if isinstance(p, str) and (path.parent / p).is_file() else None
        if found is None and isinstance(p, str) and resolve is not None:
            found = resolve(p)
        if found is None:
            also = "; no preset has that name either" if resolve is not None else ""
            raise ConfigError(f"{path}: inherit: {p!r} not found (looked for {path.parent / str(p)}{also})")
        out += read_yaml_chain(Path(found), seen + (path,), resolve)
    out.append((str(path), data))
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value parsed as a YAML scalar)."""
    if "=" not in item:
        raise ConfigError(f"command line: override {item!r} must look like section.key=value")
    key, _, raw = item.partition("=")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def apply_overrides(cfg: Any, overrides: list[str] | tuple, validate: bool = True) -> Any:
    """Applies `key=value` strings in place (type-checked, `set_keys`: a key that chooses a section's class, e.g.
    objective.router.recipe, before the others wherever it stands on the line), then calls cfg.validate()."""
    set_keys(cfg, [(*parse_override(item), f"command line ({item})") for item in overrides])
    if validate:
        cfg.validate()
    return cfg


def set_keys(cfg: Any, items: list[tuple[str, Any, str]]) -> None:
    """Sets (dotted key, value, source) items with `set_key`, a key that chooses a section's class (its `CHOICE`)
    first and the rest in the order given, so the chosen class's keys are never set and then dropped by the
    choice."""
    for k, v, source in sorted(items, key=lambda t: not _is_choice(cfg, t[0])):  # stable
        set_key(cfg, k, v, source)


def _is_choice(cfg: Any, key: str) -> bool:
    """Whether the dotted key names the choosing field (`CHOICE`) of the section it lands in."""
    *path, last = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part, None)
        if not dataclasses.is_dataclass(obj):
            return False
    return getattr(type(obj), "CHOICE", None) == last


def field_docs(cls: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """[(dotted key, type, default, doc)] for every field of a config dataclass, sections flattened. Given a class,
    a choice section lists its choosing field, then every choice's own fields (their docs led by `[choice]`);
    given an instance, the fields its sections have (the chosen class's), with their current values."""
    rows = []
    hints = typing.get_type_hints(cls if isinstance(cls, type) else type(cls))
    for fl in fields(cls):
        tp = hints[fl.name]
        default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
        if isinstance(cls, type) and dataclasses.is_dataclass(tp):
            rows += _section_docs(tp, f"{prefix}{fl.name}.")
            continue
        if not isinstance(cls, type):
            default = getattr(cls, fl.name)
            if dataclasses.is_dataclass(default):
                rows += field_docs(default, f"{prefix}{fl.name}.")
                continue
        if fl.name == getattr(cls, "CHOICE", None):
            tp = Literal[tuple(type(cls).choices() if not isinstance(cls, type) else cls.choices())]
        rows.append((f"{prefix}{fl.name}", describe(tp), default, fl.metadata.get("doc", "")))
    return rows


def _section_docs(tp: type, prefix: str) -> list[tuple[str, str, Any, str]]:
    """`field_docs` of a section's class; a choice section: its choosing field, then each choice's own fields."""
    rows = field_docs(tp, prefix)
    choice = getattr(tp, "CHOICE", None)
    if choice is None:
        return rows
    for name, sub in tp.choices().items():
        rows += [(k, t, d, f"[{name}] {doc}") for k, t, d, doc in field_docs(sub, prefix) if k != prefix + choice]
    return rows
