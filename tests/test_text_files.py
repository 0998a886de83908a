"""Every file tlf reads as text goes through data_prep.files' one reader: a missing file, a directory, bytes that are
not UTF-8 (at which offset), invalid JSON (at which line and column) or JSON of another shape is one line naming the
file, through the real `tlf` commands that read manifests, results.json, metrics.jsonl, tracking.json and exports."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from data_prep.configlib import ConfigError
from data_prep.files import FileFormatError, decode_text, read_json, read_text
from data_prep.shards import ShardError, write_shard

BAD = b"\xff\xfe not text"  # what a binary file or a UTF-16 export looks like to a UTF-8 reader


def tlf(*argv):
    from pipeline.cli import main

    return CliRunner().invoke(main, [str(a) for a in argv], catch_exceptions=True)


def one_line(r, code, names):
    """The command failed with `code` and one `Error:` line holding every name, no traceback."""
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == code and len(errors) == 1, (r.exit_code, r.output)
    assert all(str(n) in errors[0] for n in names), (names, errors[0])


def test_read_text_names_the_file_and_the_first_bad_byte(tmp_path):
    f = tmp_path / "a.json"
    f.write_bytes(b'{"a": "caf\xc3\xa9", "b": "\xe9"}')
    with pytest.raises(FileFormatError, match=rf"^{f}: not UTF-8 text \(byte 0xe9 at offset 21\)"):
        read_text(f)
    assert issubclass(FileFormatError, ConfigError) and issubclass(FileFormatError, ValueError)
    with pytest.raises(FileFormatError, match=rf"^{tmp_path / 'nope.json'}: no such file$"):
        read_text(tmp_path / "nope.json")
    with pytest.raises(FileFormatError, match=rf"^{tmp_path}: is a directory, not a file$"):
        read_text(tmp_path)
    with pytest.raises(ShardError, match=rf"^{f}: not UTF-8"):
        read_json(f, error=ShardError)
    f.write_bytes(b"\xef\xbb\xbf" + '{"a": "café",\r\n "b": 1}'.encode())  # a byte-order mark and CRLF: read as text
    assert read_text(f) == '{"a": "café",\n "b": 1}' and read_json(f, dict) == {"a": "café", "b": 1}
    with pytest.raises(FileFormatError, match=r"line 3: not UTF-8 text \(byte 0xff at offset 4\)"):
        decode_text(b"abc\n\xff", "line 3")


def test_read_json_names_line_and_column_and_the_shape_expected(tmp_path):
    f = tmp_path / "r.json"
    f.write_text('{\n  "a": 1,\n  "b": \n}\n')
    with pytest.raises(FileFormatError, match=rf"^{f}: invalid JSON \(line 4, column 1: Expecting value\)$"):
        read_json(f)
    f.write_text("[1, 2]")
    with pytest.raises(FileFormatError, match=rf"^{f}: must be a JSON object, not array$"):
        read_json(f, dict)
    f.write_text('"text"')
    with pytest.raises(FileFormatError, match=r"must be a JSON array, not string$"):
        read_json(f, list)
    assert read_json(f) == "text"


def test_inspect_a_manifest_that_is_not_utf8(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    write_shard(d / "t_train_000000.bin", np.arange(100))
    (d / "manifest.json").write_bytes(b'{"complete": true, "note": "' + BAD + b'"}')
    one_line(tlf("data", "inspect", d), 1, [d / "manifest.json", "not UTF-8 text (byte 0xff at offset 28)"])
    (d / "manifest.json").write_text('{"complete": true,\n "splits": {}}}')
    one_line(tlf("data", "inspect", d), 1, [d / "manifest.json", "invalid JSON (line 2, column 15: Extra data)"])


@pytest.fixture
def run_dir(tmp_path):
    """A training run's directory as `tlf compare --run-dir` reads it: two metrics lines and tracking.json."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2)))
    (d / "tracking.json").write_text(json.dumps({"run_id": None, "tracking_uri": "x", "tags": {"variant": "v"}}))
    return d


def compare(d, tmp_path):
    return tlf("compare", "--run-dir", d, "--out", tmp_path / "cmp")


def test_compare_run_dir_files_that_are_not_utf8(run_dir, tmp_path):
    r = compare(run_dir, tmp_path)
    assert r.exit_code == 0, r.output
    (run_dir / "results.json").write_bytes(b'{"budgets": [], "model": "' + BAD + b'"}')
    one_line(compare(run_dir, tmp_path), 1, [run_dir / "results.json", "not UTF-8 text (byte 0xff at offset 26)"])
    (run_dir / "results.json").write_text('{"budgets": [],}')
    one_line(compare(run_dir, tmp_path), 1, [run_dir / "results.json", "invalid JSON (line 1, column 16"])
    (run_dir / "results.json").unlink()
    (run_dir / "tracking.json").write_bytes(BAD)
    one_line(compare(run_dir, tmp_path), 1, [run_dir / "tracking.json", "not UTF-8 text (byte 0xff at offset 0)"])
    (run_dir / "tracking.json").write_text("[]")
    one_line(compare(run_dir, tmp_path), 1, [run_dir / "tracking.json", "must be a JSON object, not array"])
    (run_dir / "tracking.json").unlink()
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 3, "loss": 1.0, "note\xff": 2}\n')
    one_line(compare(run_dir, tmp_path), 1, [f"{run_dir / 'metrics.jsonl'}:3: not UTF-8 text (byte 0xff at offset 30)"])


def test_an_export_whose_config_is_not_utf8(tmp_path):
    """tlf's transformers export (config.json) read by `tlf generate` and by load_any, what generate and eval call."""
    from pipeline.hf.load import load_any

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_bytes(b'{"model_type": "tlf_looped", "name": "' + BAD + b'"}')
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileFormatError, match=rf"^{d / 'config.json'}: not UTF-8 text \(byte 0xff at offset 38\)"):
        load_any(d)
    one_line(tlf("generate", d, "-p", "hi", "-n", "2"), 2, [d / "config.json", "not UTF-8 text"])
    (d / "config.json").write_text(json.dumps({"model_type": "tlf_looped", "tlf_config": [1]}))
    with pytest.raises(FileFormatError, match=r"config.json: tlf_config and tlf_model must be JSON objects"):
        load_any(d)


def test_deepspeed_template_and_race_file_that_are_not_utf8(tmp_path):
    from evaluation.tasks import TaskDataError, load_race_file
    from pipeline.config import load_config
    from pipeline.train.ds import build_ds_config

    t = tmp_path / "zero.json"
    t.write_bytes(b'{"train_batch_size": "auto"' + BAD + b"}")
    cfg = load_config("tiny/t-loopformer", [f"train.ds_config={t}"])
    with pytest.raises(ConfigError, match=rf"^{t}: not UTF-8 text \(byte 0xff at offset 27\)"):
        build_ds_config(cfg, 1, "fp32")
    race = tmp_path / "race.jsonl"
    race.write_bytes(b'{"article": "a", "problems": []}\n' + BAD + b"\n")
    with pytest.raises(TaskDataError, match=rf"^{race}: not UTF-8 text \(byte 0xff at offset 33\)"):
        load_race_file(race)
    race.write_text('{"article": "a", "problems": []}\n{"article": \n')
    with pytest.raises(TaskDataError, match=rf"^{race}:2: not a JSON line"):
        load_race_file(race)
