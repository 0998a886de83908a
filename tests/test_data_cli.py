"""The data commands as a user runs them: prep-data on the demo corpus, inspect, fetch-assets."""

from __future__ import annotations

import json

from click.testing import CliRunner

from data_prep.cli import data, prep_data


def test_prep_data_demo_then_inspect(tmp_path):
    out = tmp_path / "demo"
    runner = CliRunner()
    r = runner.invoke(
        prep_data,
        [
            "--source",
            "demo",
            "--out",
            str(out),
            "--workers",
            "1",
            "--no-progress",
            "--max-tokens",
            "300000",
            "--shard-tokens",
            "100000",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "train: 3 shards" in r.output and "val: 1 shards" in r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] and m["total_tokens"] == 300000 and m["source"]["source"] == "demo"
    r = runner.invoke(data, ["inspect", str(out), "--samples", "2", "--verify"])
    assert r.exit_code == 0, r.output
    assert "complete: True" in r.output and "split train: 3 shards" in r.output
    assert "sha256 verified for 3 shards" in r.output
    assert "[val doc 0," in r.output and "Fellow-Citizens of the Senate" in r.output  # decoded real text


def test_prep_data_yaml_config(tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text(f"source: demo-enwiki\nout: {tmp_path / 'wiki'}\nmax_tokens: 20000\nprogress: false\n")
    r = CliRunner().invoke(prep_data, ["--config", str(y), "workers=0"])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "wiki" / "manifest.json").read_text())
    assert list(m["splits"]) == ["val"] and m["splits"]["val"]["shards"][0]["name"] == "demo-enwiki_val_000000.bin"


def test_fetch_assets_command():
    r = CliRunner().invoke(data, ["fetch-assets"])
    assert r.exit_code == 0, r.output
    assert "assets ready in" in r.output and "demo.jsonl" in r.output


def test_registered_in_tlf():
    import click

    from pipeline.cli import main

    ctx = click.Context(main)
    assert "prep-data" in main.list_commands(ctx)
    assert {"inspect", "fetch-assets"} <= set(main.get_command(ctx, "data").commands)


def test_a_data_command_loads_its_own_command_alone_and_never_imports_torch(tmp_path):
    """`tlf`'s subcommands load when named: `tlf prep-data` starts without torch or the other components' commands
    (it took 3.5 s to print its help when every command loaded at start, 0.3 s now), and `tlf --help` lists them all."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pipeline.cli import entry\n"
        f"sys.argv = ['tlf', 'prep-data', '--source', 'depth-fold', '--out', {str(tmp_path / 'd')!r}, "
        "'depth_docs=8', 'fold_symbols=8', '--no-progress']\n"
        "try:\n    entry()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('torch', 'evaluation.ablate', 'pipeline.train.trainer') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr
    assert (tmp_path / "d" / "manifest.json").is_file()
    from importlib.metadata import entry_points

    listed = CliRunner().invoke(__import__("pipeline.cli").cli.main, ["--help"]).output
    assert all(f"  {ep.name} " in listed for ep in entry_points(group="tlf.commands"))
