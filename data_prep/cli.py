"""`tlf prep-data` and `tlf data {inspect,fetch-assets}` (`tlf.commands` entry points in setup.py, which
pipeline/cli.py loads)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from data_prep.config import SOURCES
from data_prep.configlib import ConfigError
from data_prep.foldtask import HOPS_REMOVED


class _Source(click.Choice):
    """A prep-data source; the removed depth-hops source says so, pointing at the fold task."""

    def convert(self, value, param, ctx):
        if value == "depth-hops":
            self.fail(f"source: {HOPS_REMOVED}", param, ctx)
        return super().convert(value, param, ctx)


def _fail(e: Exception) -> None:
    click.echo(f"Error: {e}", err=True)  # as click prints its own usage errors
    sys.exit(1)


@click.command("prep-data", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("overrides", nargs=-1)
@click.option(
    "--config", "config_files", multiple=True, type=click.Path(dir_okay=False), help="YAML file of prep-data options."
)
@click.option("--source", type=_Source(SOURCES), help="Where documents come from (default files).")
@click.option("--input", "-i", "inputs", multiple=True, help="Input file, glob or directory (repeatable).")
@click.option("--out", "-o", help="Output directory.")
@click.option("--text-field", help="JSON key / column holding the text (default text).")
@click.option("--txt-mode", type=click.Choice(["file", "line", "paragraph"]), help="Documents in .txt files.")
@click.option("--hf-dataset", help="Hub dataset id (source=hf).")
@click.option("--hf-config", help="Hub dataset config, e.g. sample-10BT.")
@click.option("--hf-split", help="Hub split (default train).")
@click.option("--name", help="Shard file prefix (default from the source).")
@click.option(
    "--shard-tokens",
    type=click.IntRange(1, 2**31 - 1),
    help="Tokens per shard (default 100000000; the header's int32).",
)
@click.option("--val-every", type=click.IntRange(min=-1), help="Every N-th document to val (0 auto, -1 none).")
@click.option("--max-tokens", type=click.IntRange(min=0), help="Stop after this many tokens (0: all).")
@click.option(
    "--workers",
    "-j",
    type=click.IntRange(min=-1),
    help="Worker processes: tokenizers, or a synthetic source's document makers (-1 all cores, 0 in-process).",
)
@click.option("--skip-bad/--no-skip-bad", default=None, help="Skip malformed records (counted) instead of failing.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr.")
@click.option("--overwrite", is_flag=True, help="Delete this directory's existing shards and start again.")
def prep_data(overrides, config_files, overwrite, inputs, **opts):
    """Tokenize documents into llm.c-format GPT-2 shards (train/val) in --out, resumably.

    OVERRIDES are key=value pairs of the same options (e.g. batch_bytes=2097152), applied last.
    Rerunning the same command after an interruption continues where the last shard ended."""
    from data_prep.config import load_prep_config
    from data_prep.prep import PrepError, prepare_status
    from data_prep.worker import PrepInputError
    from data_prep.assets import AssetError

    if len(config_files) > 1:
        raise click.UsageError(f"--config given {len(config_files)} times ({', '.join(config_files)}); give one")
    config_file = config_files[0] if config_files else None
    values = dict(opts)
    values["inputs"] = list(inputs) if inputs else None
    try:
        cfg = load_prep_config(config_file, values, overrides)
    except ConfigError as e:
        raise click.UsageError(f"config error: {e}") from None
    try:
        m, wrote = prepare_status(cfg, overwrite=overwrite)
    except (PrepError, PrepInputError, AssetError) as e:
        _fail(e)
    except OSError as e:  # a full disk or an unwritable --out: the manifest still describes the last whole shard
        kept = (Path(cfg.out) / "manifest.json").is_file()
        _fail(
            f"{e}"
            + (f"; {cfg.out} keeps every shard written before it: rerun the same command to resume" if kept else "")
        )
    except KeyboardInterrupt:
        click.echo(f"interrupted; rerun the same command to resume from {cfg.out}/manifest.json", err=True)
        sys.exit(130)
    docs = m["documents"]
    if docs.get("skipped_bad"):
        click.echo(
            f"skipped {docs['skipped_bad']} bad records (listed under documents.bad_examples in the manifest)", err=True
        )
    for split, info in m["splits"].items():
        click.echo(f"{split}: {len(info['shards'])} shards, {info['tokens']:,} tokens, {info['docs']:,} documents")
    if wrote:
        click.echo(f"wrote {cfg.out}/manifest.json")
    else:
        click.echo(f"already complete: found {cfg.out}/manifest.json; nothing written (--overwrite starts again)")


@click.group("data")
def data() -> None:
    """Inspect token shards; set up the offline assets."""


@data.command("inspect")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--samples", "-n", type=click.IntRange(min=0), default=3, show_default=True, help="Documents decoded per split."
)
@click.option(
    "--chars", type=click.IntRange(min=1), default=300, show_default=True, help="Characters shown per sample."
)
@click.option("--verify", is_flag=True, help="Also check every shard's sha256 against the manifest.")
def inspect_cmd(directory, samples, chars, verify):
    """Print DIRECTORY's manifest summary, check every shard header, decode a few documents."""
    from data_prep.inspect import inspect
    from data_prep.shards import ShardError

    try:
        click.echo(inspect(directory, samples, chars, verify))
    except (ShardError, OSError) as e:
        _fail(e)


@data.command("fetch-assets")
def fetch_assets():
    """Fetch and verify the offline assets (GPT-2 BPE, demo corpora) into the cache (instant when done)."""
    from data_prep.assets import main

    rc = main()
    if rc:
        sys.exit(rc)


__all__ = ["prep_data", "data", "ConfigError"]
