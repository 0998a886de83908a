"""Click parameter types shared by the `tlf` commands, so a bad option is a usage error (exit 2) naming it before
any work starts: finite floats (click's FloatRange lets nan through), an int that may be 0 or `off`, comma lists
(`--loops 1,2,4`), KEY=V1,V2 lists (`tlf plan --sweep`), KEY=VALUE, shell words (`tlf sweep --launcher`) and a
device name. Every numeric option of `tlf` declares its range (tests/test_cli_options.py walks them all).
Only click and the standard library here: every package imports it."""

from __future__ import annotations

import math
import re
import shlex

import click


def describe(t: click.ParamType) -> str:
    """What a value of type t must be, as an error message says it: 'an integer >= 1', 'a number in (0, 1]',
    'one of a, b'."""
    if isinstance(t, click.Choice):
        return "one of " + ", ".join(map(str, t.choices))
    if not isinstance(t, (click.IntRange, click.FloatRange)):
        return f"a valid {t.name}"
    kind = "an integer" if isinstance(t, click.IntRange) else "a number"
    if t.min is not None and t.max is not None:
        if isinstance(t, click.IntRange) and not (t.min_open or t.max_open):
            return f"{kind} in {t.min}..{t.max}"
        return f"{kind} in {'(' if t.min_open else '['}{t.min}, {t.max}{')' if t.max_open else ']'}"
    if isinstance(t, IntOrZero):
        return f"{kind} " + _alternatives([f">= {t.min}", "0", *t.words])
    if t.min is not None:
        return f"{kind} {'>' if t.min_open else '>='} {t.min}"
    return f"{kind} {'<' if t.max_open else '<='} {t.max}"


class Finite(click.FloatRange):
    """A float in a range (bounds as click.FloatRange's), never nan or +-inf."""

    def convert(self, value, param, ctx):
        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


class IntOrZero(click.IntRange):
    """0, or an integer >= min; each of `words` (e.g. 'off') also stands for 0."""

    def __init__(self, min: int, words: tuple[str, ...] = ()):
        super().__init__(min=min)
        self.words = words
        self.name = "integer" + "".join(f" or {w}" for w in words)

    def convert(self, value, param, ctx):
        if str(value).strip().lower() in ("0", *self.words):
            return 0
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:  # click's help shows it as the range: [default: off; x>=1, 0 or off]
        return _alternatives([super()._describe_range(), "0", *self.words])


def _alternatives(parts: list[str]) -> str:
    return ", ".join(parts[:-1]) + " or " + parts[-1]


class CommaList(click.ParamType):
    """Comma-separated values, each of type `item`: a tuple, never empty, its values distinct (unless
    distinct=False); `none` (e.g. 'none') is the empty tuple. Errors name the value as `label` does: with
    label 'loop budget {}', '--loops 1,0' says "loop budget 0 is not an integer >= 1"."""

    name = "list"

    def __init__(self, item: click.ParamType, label: str, example: str, distinct: bool = True, none: str | None = None):
        self.item, self.label, self.example, self.distinct, self.none = item, label, example, distinct, none

    def get_metavar(self, param, ctx) -> str:
        return "V1,V2,..." + (f"|{self.none}" if self.none else "")

    def convert(self, value, param, ctx):
        if isinstance(value, (tuple, list)):
            return tuple(value)
        text = str(value)
        if self.none is not None and text.strip() == self.none:
            return ()
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            what = self.label.format("").strip()
            self.fail(
                f"{value!r} names {'an empty' if any(parts) else 'no'} {what} (expected e.g. {self.example})",
                param,
                ctx,
            )
        out = []
        for p in parts:
            v = self._item(p, param, ctx)
            if self.distinct and v in out:
                self.fail(f"{self.label.format(p)} is given twice in {value!r}", param, ctx)
            out.append(v)
        return tuple(out)

    def _item(self, p: str, param, ctx):
        try:
            return self.item.convert(p, param, ctx)
        except click.BadParameter:
            shown = p if re.fullmatch(r"[-+]?[\d.]+", p) else repr(p)
            self.fail(f"{self.label.format(shown)} is not {describe(self.item)}", param, ctx)


class KeyedList(click.ParamType):
    """KEY=V1,V2,... with KEY one of `keys` (each key's values a CommaList) -> (KEY, values)."""

    name = "key=list"

    def __init__(self, keys: dict[str, CommaList]):
        self.keys = keys

    def get_metavar(self, param, ctx) -> str:
        return "KEY=V1,V2"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        key, eq, vals = str(value).partition("=")
        if key not in self.keys or not vals.strip():
            self.fail(f"{value!r}: expected KEY=V1,V2,... with KEY one of {', '.join(self.keys)}", param, ctx)
        return key, self.keys[key].convert(vals, param, ctx)


class KeyValue(click.ParamType):
    """KEY=VALUE (a non-empty KEY) -> (KEY, VALUE)."""

    name = "key=value"

    def get_metavar(self, param, ctx) -> str:
        return "KEY=VALUE"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        key, eq, val = str(value).partition("=")
        if not eq or not key.strip():
            self.fail(f"{value!r} must look like KEY=VALUE", param, ctx)
        return key, val


class ShellWords(click.ParamType):
    """A string split as a shell splits it (shlex) -> a list of words; an unclosed quote is a usage error."""

    name = "words"

    def get_metavar(self, param, ctx) -> str:
        return '"WORDS..."'

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return shlex.split(str(value))
        except ValueError as e:
            self.fail(f"{value!r}: {str(e).lower()} (quote it as a shell would)", param, ctx)


class Device(click.ParamType):
    """auto, cpu, cuda or cuda:N (whether this machine has it is checked where the device is resolved)."""

    name = "device"

    def get_metavar(self, param, ctx) -> str:
        return "auto|cpu|cuda[:N]"

    def convert(self, value, param, ctx):
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(value)):
            self.fail(f"{value!r} is not auto, cpu, cuda or cuda:N", param, ctx)
        return str(value)
