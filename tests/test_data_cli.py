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
    from pipeline.cli import main

    assert "prep-data" in main.commands and {"inspect", "fetch-assets"} <= set(main.commands["data"].commands)
