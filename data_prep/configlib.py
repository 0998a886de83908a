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
    """A dataclass field with a one-line doc (shown by `tlf config show --doc` and in the README)."""
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


def set_key(obj: Any, key: str, value: Any, source: str, prefix: str = "") -> None:
    """Sets obj.<key> (dotted) with type checks; unknown keys are errors, and so are keys listed in the
    dataclass's `MOVED` ({old field: new dotted key}), with a message naming the new key, and in its `REMOVED`
    ({old field: why, and what to use instead})."""
    head, _, rest = key.partition(".")
    names = {fl.name: fl for fl in fields(obj)}
    full = f"{prefix}{head}"
    moved = getattr(type(obj), "MOVED", {}).get(head)
    if moved is not None:
        raise ConfigError(f"{source}: '{full}' moved to '{moved}'")
    removed = getattr(type(obj), "REMOVED", {}).get(head)
    if removed is not None:
        raise ConfigError(f"{source}: '{full}': {removed}")
    if head not in names:
        close = difflib.get_close_matches(head, list(names), n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ConfigError(f"{source}: unknown config key '{full}'{hint}")
    tp = typing.get_type_hints(type(obj))[head]
    cur = getattr(obj, head)
    if dataclasses.is_dataclass(cur):
        if rest:
            set_key(cur, rest, value, source, f"{full}.")
            return
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{full}' is a section; give a mapping, got {value!r}")
        for k, v in value.items():
            set_key(cur, str(k), v, source, f"{full}.")
        return
    if rest:
        raise ConfigError(f"{source}: '{full}' is not a section, so '{prefix}{key}' does not exist")
    ok, v = _type_ok(value, tp)
    if not ok:
        raise ConfigError(f"{source}: '{full}' expects {describe(tp)}, got {value!r}")
    setattr(obj, head, v)


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


def read_yaml_chain(path: Path, seen: tuple = ()) -> list[tuple[str, dict]]:
    """Returns [(source, mapping), ...] in merge order, following `inherit:` (paths relative to the file)."""
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
        if not isinstance(p, str) or not (path.parent / p).is_file():
            raise ConfigError(f"{path}: inherit: {p!r} not found (looked for {path.parent / str(p)})")
        out += read_yaml_chain(path.parent / p, seen + (path,))
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
    """Applies `key=value` strings in place (type-checked), then calls cfg.validate()."""
    for item in overrides:
        k, v = parse_override(item)
        set_key(cfg, k, v, f"command line ({item})")
    if validate:
        cfg.validate()
    return cfg


def field_docs(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """[(dotted key, type, default, doc)] for every field of a config dataclass, sections flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    for fl in fields(cls):
        tp = hints[fl.name]
        if dataclasses.is_dataclass(tp):
            rows += field_docs(tp, f"{prefix}{fl.name}.")
            continue
        default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
        rows.append((f"{prefix}{fl.name}", describe(tp), default, fl.metadata.get("doc", "")))
    return rows
