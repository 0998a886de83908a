"""The `tlf` command: a thin Click wrapper over plain `run(cfg)`-style functions that tests call directly."""

from __future__ import annotations

import functools
import os
import sys
from importlib.metadata import entry_points

import click

from data_prep.configlib import ConfigError, check_once  # (pipeline.config loads torch: the recipes' settings)
from data_prep.files import UnwritableError


class _Group(click.Group):
    """Turns a ConfigError anywhere below into a clean one-line error (exit 2), and an output path that cannot be
    written (data_prep.files.check_writable) into one of exit 1, not a traceback; the components' subcommands
    (`tlf.commands` entry points) load when named, so `tlf prep-data` never imports torch."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ConfigError as e:
            raise click.UsageError(f"config error: {e}") from None
        except UnwritableError as e:
            raise click.ClickException(str(e)) from None

    def list_commands(self, ctx) -> list[str]:
        return sorted({*super().list_commands(ctx), *_entry_points()})

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in _entry_points():
            self.add_command(_entry_points()[name].load(), name)
        return super().get_command(ctx, name)


def config_arguments(command=None, *, once: bool = False):
    """The arguments `CONFIG [OVERRIDES]...` of a command that reads a training config, CONFIG also accepted as
    `--config CONFIG` (as `tlf prep-data --config FILE`): the command gets `config` and `overrides` either way. Two
    configs (`--config` twice too) or an empty one is a usage error; with once=True (`@config_arguments(once=True)`)
    so is a key set twice among the overrides (`configlib.check_once`)."""
    if command is None:
        return functools.partial(config_arguments, once=once)

    @functools.wraps(command)
    def call(*args, config, overrides, config_opt, **kw):
        config, overrides = _one_config(config, config_opt, tuple(overrides))
        if once:
            try:
                check_once(overrides)
            except ConfigError as e:
                raise click.UsageError(f"config error: {e}") from None
        return command(*args, config=config, overrides=overrides, **kw)

    call = click.option(
        "--config",
        "config_opt",
        multiple=True,
        metavar="CONFIG",
        help="The config (a preset such as tiny/t-loopformer, or a YAML file): the same as the positional CONFIG.",
    )(call)
    return click.argument("config", required=False)(click.argument("overrides", nargs=-1)(call))


def _one_config(config: str | None, config_opt: tuple, overrides: tuple) -> tuple[str, tuple]:
    """(the config, the overrides) of the positional CONFIG and `--config`: exactly one of them, naming something (a
    positional `key=value` beside --config is the first override)."""
    if len(config_opt) > 1:
        raise click.UsageError(f"--config given {len(config_opt)} times ({', '.join(config_opt)}); give one")
    if config_opt:
        if config is not None and "=" not in config:
            raise click.UsageError(f"two configs given ({config} and --config {config_opt[0]}); give one")
        config, overrides = config_opt[0], ((config,) if config is not None else ()) + overrides
    elif config is None:
        raise click.UsageError("missing CONFIG: a preset (tlf config list) or a YAML file, or --config FILE")
    if not config.strip():
        raise click.UsageError(f"CONFIG {config!r} names nothing: a preset (tlf config list) or a YAML file")
    return config, overrides


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tlf")
def main() -> None:
    """tlf: pretrain, evaluate and compare T-LoopFormer looped transformers."""


@main.group()
def config() -> None:
    """Inspect presets and resolved configs."""


@config.command("list")
def config_list() -> None:
    """List the shipped presets (SCALE/VARIANT)."""
    from pipeline.config import list_presets

    for name in list_presets():
        click.echo(name)


@config.command("show")
@config_arguments(once=True)
@click.option("--doc", is_flag=True, help="Print every field with its value, type and one-line doc.")
def config_show(config: str, overrides: tuple[str, ...], doc: bool) -> None:
    """Print the resolved CONFIG (preset or YAML file) with OVERRIDES (section.key=value); --doc: every key it has
    (of objective.router, the chosen recipe's) with its value, type and doc."""
    from pipeline.config import field_docs, load_config, to_yaml

    cfg = load_config(config, overrides)
    if doc:
        flat = cfg.flat()
        for key, tp, _default, text in field_docs(cfg):  # tp: the type and range, "float, > 0"
            click.echo(f"{key} = {flat[key]!r}  ({tp})  # {text}")
        return
    click.echo(to_yaml(cfg), nl=False)


# The subcommands live with their components and register themselves as `tlf.commands` entry points
# (setup.py), so this module names no package above it (README "Layout").
COMMAND_GROUP = "tlf.commands"


_EPS: dict = {}


def _entry_points() -> dict:
    """{name: entry point} of the `tlf.commands` group (read once)."""
    if not _EPS:
        eps = entry_points(group=COMMAND_GROUP)
        if not eps:
            raise SystemExit(
                "tlf is not installed: its subcommands are entry points (`pip install -e .` in the "
                "checkout, or `make setup`)"
            )
        _EPS.update({ep.name: ep for ep in eps})
    return _EPS


def strip_local_rank(argv: list[str]) -> list[str]:
    """argv without the `--local_rank=N` / `--local_rank N` (or --local-rank) the DeepSpeed launcher appends to
    every rank's command; N goes to $LOCAL_RANK unless the launcher set it already."""
    out, it = [], iter(argv)
    for a in it:
        name, eq, val = a.partition("=")
        if name in ("--local_rank", "--local-rank"):
            os.environ.setdefault("LOCAL_RANK", val if eq else next(it, "0"))
        else:
            out.append(a)
    return out


def entry() -> None:
    """Console-script entry: drops the `--local_rank=N` the DeepSpeed launcher appends to every rank's
    argv (the rank is also in $LOCAL_RANK), so `deepspeed $(which tlf) train ...` works as is."""
    _entry_points()  # (an uninstalled checkout says so at once)
    main(args=strip_local_rank(sys.argv[1:]), prog_name="tlf")


if __name__ == "__main__":
    entry()
