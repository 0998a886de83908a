"""Dataclass configs read from YAML and `key=value` overrides: the machinery `tlf prep-data`'s `PrepConfig`
(data_prep/config.py) and the training `Config` (pipeline/config.py) share.

A config is a dataclass whose fields are made with `f(default, doc, **range)`; nested dataclass fields are sections.
A field declares its type (the annotation) and its range (`f`'s keywords, a `Range` in its metadata). `set_key` sets
a dotted key with type and range checks; an unknown key, a wrong type or a value out of range raises `ConfigError`
naming the key, the value and its source (file, option, command line or stored config). YAML files are read with
`read_yaml_mapping`, which refuses a key given twice. It lives in data_prep, the lowest layer, so both layers use
one copy (README "Layout").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import math
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem, with the key and the source (file or command line) in its message."""


@dataclass(frozen=True)
class Items:
    """A list key's elements: their type and their `Range` (`each`)."""

    type: type
    range: "Range"


def each(tp: type, **bounds) -> Items:
    """The elements of a list key: `items=each(int, ge=1)` (bounds: `Range`'s keywords)."""
    return Items(tp, Range(**bounds))


@dataclass(frozen=True)
class Range:
    """What a key's value may be beyond its type, declared with the field (`f`'s keywords): bounds gt / ge / lt / le
    (numbers), finite (floats: no nan or inf unless False), nonempty (a str or list with an element), unique (a list
    without repeats), items (a list's elements, `each`). A number key declares a bound or says unbounded=True
    (tests/test_config_bounds.py walks every key)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    finite: bool = True
    nonempty: bool = False
    unique: bool = False
    items: Items | None = None
    unbounded: bool = False

    def __post_init__(self) -> None:
        if (self.gt is not None and self.ge is not None) or (self.lt is not None and self.le is not None):
            raise ValueError("a range has one lower bound (gt or ge) and one upper bound (lt or le)")
        if self.unbounded and self.bounded:
            raise ValueError("unbounded=True with a bound")

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.gt, self.ge, self.lt, self.le))

    def span(self) -> str:
        """The bounds as messages and docs show them: '> 0', '>= 1', 'in [0, 1)' ('' when there are none)."""
        lo, hi = _first(self.ge, self.gt), _first(self.le, self.lt)
        if hi is None:
            return "" if lo is None else f"{'>=' if self.ge is not None else '>'} {lo}"
        if lo is None:
            return f"{'<=' if self.le is not None else '<'} {hi}"
        return f"in {'[' if self.ge is not None else '('}{lo}, {hi}{']' if self.le is not None else ')'}"

    def text(self) -> str:
        """The whole range, as `--doc` and docs/configuration.md show it beside the type ('' when there is none)."""
        parts = [self.span(), "non-empty" if self.nonempty else "", "distinct" if self.unique else ""]
        if self.items is not None and self.items.range.text():
            parts.append(f"each {self.items.range.text()}")
        return ", ".join(p for p in parts if p)

    def problem(self, value: Any) -> str | None:
        """Why value (of the key's type) is out of the range, as the end of a message ('must be > 0, got -1.0');
        None when it is in it."""
        if isinstance(value, float) and self.finite and not math.isfinite(value):
            return f"must be a finite number{' ' + self.span() if self.span() else ''}, got {value!r}"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not self._within(value):
            return f"must be {self.span()}, got {value!r}"
        if self.nonempty and isinstance(value, (str, list)) and not value:
            return f"must not be empty, got {value!r}"
        if isinstance(value, list):
            return self._list_problem(value)
        return None

    def _within(self, x: float) -> bool:
        return not (
            (self.gt is not None and not x > self.gt)
            or (self.ge is not None and not x >= self.ge)
            or (self.lt is not None and not x < self.lt)
            or (self.le is not None and not x <= self.le)
        )

    def _list_problem(self, value: list) -> str | None:
        """A list's repeats (unique) and its elements out of their range (items)."""
        if self.unique:
            twice = next((x for i, x in enumerate(value) if x in value[:i]), None)
            if twice is not None:
                return f"must list each element once, got {twice!r} twice in {value!r}"
        for x in value if self.items is not None else ():
            why = self.items.range.problem(x)
            if why:
                return f"elements {why} in {value!r}"
        return None


def _first(*xs):
    """The first of xs that is not None (None if all are), as a bound is shown."""
    return next((x for x in xs if x is not None), None)


def f(
    default: Any,
    doc: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    finite: bool = True,
    nonempty: bool = False,
    unique: bool = False,
    items: type | Items | None = None,
    unbounded: bool = False,
    **kw,
):
    """A dataclass field with a one-line doc (shown by `tlf config show --doc` and in docs/configuration.md) and its
    range (`Range`: gt/ge/lt/le bounds, finite, nonempty, unique; items, a list's element type or `each(...)`)."""
    items = Items(items, Range()) if isinstance(items, type) else items
    meta = {"doc": doc, "range": Range(gt, ge, lt, le, finite, nonempty, unique, items, unbounded)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def range_of(fl: dataclasses.Field) -> Range:
    """A field's declared `Range` (an empty one for a field not made with `f`, such as a section)."""
    return fl.metadata.get("range", Range())


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Checks value against a field type; returns (ok, converted value)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
        if word in typing.get_args(tp):  # YAML 1.1 reads off/on (and no/yes) as booleans: the choice meant
            return True, word
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


def describe(tp: Any, items: Items | None = None) -> str:
    """A field type as the error messages and `--doc` show it (items: a list's elements, 'list of int')."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    name = getattr(tp, "__name__", str(tp))
    return f"{name} of {describe(items.type)}" if items is not None else name


def _items_ok(value: list, items: Items | None) -> tuple[bool, Any]:
    """Checks a list's elements against their declared type (`Items`); returns (ok, the list converted)."""
    if items is None:
        return True, value
    got = [_type_ok(x, items.type) for x in value]
    return all(ok for ok, _ in got), [v for _, v in got]


def describe_range(tp: Any, rng: Range) -> str:
    """A field's type and range as `--doc` and docs/configuration.md show them: 'float, > 0', 'list of int, distinct,
    each >= 1', 'float, any finite' (a key declared unbounded)."""
    number = tp in (int, float)
    free = ("any finite" if tp is float and rng.finite else "any") if rng.unbounded else ""
    loose = "nan and inf allowed" if tp is float and not rng.finite else ""
    return ", ".join(s for s in (describe(tp, rng.items), rng.text(), free if number else "", loose) if s)


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
    setattr(obj, head, _checked(obj, names[head], value, source, full))


def _checked(obj: Any, fl: dataclasses.Field, value: Any, source: str, key: str) -> Any:
    """value as field fl of obj holds it (a float from an int or "6e-4", a list's elements converted), or a
    ConfigError naming the key, the value, the type or range it misses and the source."""
    tp, rng = typing.get_type_hints(type(obj))[fl.name], range_of(fl)
    ok, v = _type_ok(value, tp)
    if ok and isinstance(v, list):
        ok, v = _items_ok(v, rng.items)
    if not ok:
        raise ConfigError(f"{source}: '{key}' expects {describe(tp, rng.items)}, got {value!r}")
    why = rng.problem(v) if v is not None else None
    if why:
        raise ConfigError(f"{source}: '{key}' {why}")
    return v


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


class _Repeated(Exception):
    """A key given twice in one YAML document (`_OnceLoader`)."""


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader without YAML 1.1's base-60 numbers (dropped in YAML 1.2): `2:3` is the string it reads as
    (train.profile_steps=2:3), not the integer 123; `1:30` not 90."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":int", ":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(  # SafeLoader's int and float patterns less their base-60 forms
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class _OnceLoader(_Loader):
    """yaml.SafeLoader refusing a key given twice in one document, where PyYAML keeps the last silently: the same key
    twice in a mapping (a second block of a section too), or one dotted key spelled twice (`optim.lr: 1` and
    `optim: {lr: 2}`, which `set_key` would both set). Merge keys (`<<: *anchor`) are YAML's own override."""

    def construct_document(self, node):
        if isinstance(node, yaml.MappingNode):
            _once(node, "", {}, (id(node),))
        return super().construct_document(node)


def _once(node: yaml.MappingNode, prefix: str, seen: dict[str, int], path: tuple) -> None:
    """Raises _Repeated when a dotted key of node (its keys prefixed, a nested mapping's keys below its own)
    is in seen ({dotted key: line}) already; records the others. path: the ids of the mappings above, node's too."""
    for key, value in node.value:
        if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
            continue
        name, line = f"{prefix}{key.value}", key.start_mark.line + 1
        if name in seen:
            raise _Repeated(f"'{name}' given twice (line {seen[name]} and line {line})")
        seen[name] = line
        if isinstance(value, yaml.MappingNode) and id(value) not in path:  # (an alias may hold its own anchor)
            _once(value, f"{name}.", seen, (*path, id(value)))


def read_yaml_mapping(path: Path, what: str = "sections") -> dict:
    """A YAML file whose top level is a mapping; a missing or unreadable file, text that is not UTF-8, bad YAML, a
    key given twice (`_OnceLoader`) or another shape is a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8-sig")
        data = yaml.load(text, Loader=_OnceLoader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    except _Repeated as e:
        raise ConfigError(f"{path}: {e}") from None
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
    out: list[tuple[str, dict]] = []
    for p in _parents(path, data.pop("inherit")) if "inherit" in data else ():
        found = path.parent / p if (path.parent / p).is_file() else None
        if found is None and resolve is not None:
            found = resolve(p)
        if found is None:
            also = "; no preset has that name either" if resolve is not None else ""
            raise ConfigError(f"{path}: inherit: {p!r} not found (looked for {path.parent / p}{also})")
        out += read_yaml_chain(Path(found), seen + (path,), resolve)
    out.append((str(path), data))
    return out


def _parents(path: Path, parents: Any) -> list[str]:
    """The names of a file's `inherit:` (a name or a list of names); one that names nothing (empty, null, '', an
    entry that is not a non-empty string) is a ConfigError naming the file."""
    names = [parents] if isinstance(parents, str) else parents
    if names is not None and not isinstance(names, list):
        raise ConfigError(f"{path}: inherit: must be a file name or a list of file names, not {parents!r}")
    if not names:
        raise ConfigError(f"{path}: inherit: names nothing ({parents!r}); name a file or a preset, or remove it")
    for p in names:
        if not isinstance(p, str) or not p.strip():
            raise ConfigError(f"{path}: inherit: {p!r} is not a file or preset name")
    return names


def parse_override(item: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value parsed as a YAML scalar)."""
    if "=" not in item:
        raise ConfigError(f"command line: override {item!r} must look like section.key=value")
    key, _, raw = item.partition("=")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw != "" else ""
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


def check_once(overrides: list[str] | tuple, source: str = "command line") -> None:
    """`key=value` strings that set one key twice (a mapping value counts as its keys: `optim={lr: 1}` sets
    optim.lr) are a ConfigError naming both; a later value never silently replaces an earlier one on one line."""
    seen: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            continue  # parse_override's error
        for key in _leaf_keys(*parse_override(item)):
            if key in seen:
                raise ConfigError(f"{source}: '{key}' given twice ({seen[key]} and {item})")
            seen[key] = item


def _leaf_keys(key: str, value: Any) -> list[str]:
    """The dotted keys `key=value` sets: key, or a mapping value's keys below it."""
    if not isinstance(value, dict) or not value:
        return [key]
    return [k for sub, v in value.items() for k in _leaf_keys(f"{key}.{sub}", v)]


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
    """[(dotted key, type and range (`describe_range`), default, doc)] for every field of a config dataclass, sections flattened. Given a class,
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
        rows.append((f"{prefix}{fl.name}", describe_range(tp, range_of(fl)), default, fl.metadata.get("doc", "")))
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
