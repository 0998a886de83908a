"""Bad input: a clear error naming the file (and line) or key, and nothing lost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner

from data_prep import worker
from data_prep.cli import data as data_cli
from data_prep.config import load_prep_config
from data_prep.hf import HubUnreachable
from data_prep.prep import prepare
from data_prep.shards import HEADER_BYTES, ShardError, ShardReader, ShardSet, write_shard
from data_prep.worker import PrepInputError

REPO = Path(__file__).resolve().parent.parent
GOOD = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * 30 for i in range(40)]


def prep(out, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    kw.setdefault("source", "files")
    return prepare(load_prep_config(values={**kw, "out": str(out)}), log=lambda m: None)


def jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def good_lines(n=None):  # None: all of GOOD
    return [json.dumps({"text": t}) for t in GOOD[:n]]


@pytest.mark.parametrize("workers", [0, 2])
def test_malformed_json_line_names_file_and_line(tmp_path, workers):
    lines = good_lines(10)
    lines[6] = '{"text": "unterminated'
    f = jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(PrepInputError, match=rf"{f}:7: malformed JSON line"):
        prep(tmp_path / "o", inputs=[str(f)], workers=workers)


def test_skip_bad_counts_reports_and_skips(tmp_path):
    lines = good_lines(10)
    lines[2], lines[8] = "not json at all", json.dumps({"body": "no text key"})
    f = jsonl(tmp_path / "in.jsonl", lines)
    m = prep(tmp_path / "o", inputs=[str(f)], skip_bad=True, val_every=-1)
    d = m["documents"]
    assert (d["kept"], d["skipped_bad"]) == (8, 2)
    assert d["bad_examples"][0].startswith(f"{f}:3: malformed JSON") and f"{f}:9: no text field" in d["bad_examples"][1]
    clean = jsonl(tmp_path / "clean.jsonl", [x for i, x in enumerate(lines) if i not in (2, 8)])
    prep(tmp_path / "ref", inputs=[str(clean)], val_every=-1)
    assert (tmp_path / "o" / "data_train_000000.bin").read_bytes() == (
        tmp_path / "ref" / "data_train_000000.bin"
    ).read_bytes()


def test_error_mid_run_loses_nothing_and_skip_bad_resumes(tmp_path):
    lines = good_lines()
    lines[33] = "{broken"
    f = jsonl(tmp_path / "in.jsonl", lines)
    kw = dict(inputs=[str(f)], shard_tokens=1500, batch_bytes=4000, val_every=5)
    with pytest.raises(PrepInputError, match=":34: malformed JSON"):
        prep(tmp_path / "o", **kw)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert not m["complete"] and len(m["splits"]["train"]["shards"]) >= 5  # work before the bad line is kept
    before = {p.name: p.read_bytes() for p in (tmp_path / "o").glob("*.bin")}
    m = prep(tmp_path / "o", skip_bad=True, **kw)  # resumes (skip_bad does not change what was written)
    ref = prep(tmp_path / "ref", skip_bad=True, **kw)
    assert m["splits"] == ref["splits"]
    for name, data in before.items():
        if not name.startswith("."):
            assert (tmp_path / "o" / name).read_bytes() == data


def test_missing_text_field(tmp_path):
    f = jsonl(tmp_path / "in.jsonl", [json.dumps({"content": "hello", "id": 1})])
    with pytest.raises(PrepInputError, match=rf"{f}:1: no text field 'text' \(keys: content, id\)"):
        prep(tmp_path / "o", inputs=[str(f)])
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(PrepInputError, match=r"a.parquet: no column 'text' \(columns: body\)"):
        prep(tmp_path / "o2", inputs=[str(tmp_path / "a.parquet")])
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "b.parquet")
    with pytest.raises(PrepInputError, match=r"b.parquet row 2: text field 'text' is null"):
        prep(tmp_path / "o3", inputs=[str(tmp_path / "b.parquet")])
    f2 = jsonl(tmp_path / "num.jsonl", [json.dumps({"text": 5})])
    with pytest.raises(PrepInputError, match=r"num.jsonl:1: text field 'text' holds int"):
        prep(tmp_path / "o4", inputs=[str(f2)])


def test_empty_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PrepInputError, match="empty input: .*empty.jsonl produced no documents"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "empty.jsonl")])
    assert not (tmp_path / "o" / "manifest.json").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.csv").write_text("a,b\n")
    with pytest.raises(PrepInputError, match=r"empty input: directory .*d holds no \.jsonl"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "d")])
    with pytest.raises(PrepInputError, match=r"empty input: glob .*\*\.parquet holds no"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "d" / "*.parquet")])
    with pytest.raises(PrepInputError, match="input not found: .*missing.jsonl"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "missing.jsonl")])
    with pytest.raises(PrepInputError, match="notes.csv: unsupported input format"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "d" / "notes.csv")])


def test_truncated_and_corrupt_zst(tmp_path):
    body = ("\n".join(good_lines()) + "\n").encode()
    whole = zstandard.ZstdCompressor().compress(body)
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(PrepInputError, match=r"cut.jsonl.zst: truncated zstd stream"):
        prep(tmp_path / "o", inputs=[str(tmp_path / "cut.jsonl.zst")], workers=2)
    (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 20)
    with pytest.raises(PrepInputError, match=r"bad.jsonl.zst: corrupt zstd stream"):
        prep(tmp_path / "o2", inputs=[str(tmp_path / "bad.jsonl.zst")])


def test_bad_shards_name_the_file(tmp_path):
    write_shard(tmp_path / "x_train_000000.bin", np.arange(100))
    good = (tmp_path / "x_train_000000.bin").read_bytes()
    cases = {
        "magic": b"\x00\x00\x00\x00" + good[4:],
        "version": good[:4] + b"\x07\x00\x00\x00" + good[8:],
        "truncated": good[:-10],
    }
    msgs = {"magic": "wrong magic 0", "version": "unsupported shard version 7", "truncated": "header says 100 tokens"}
    runner = CliRunner()
    for case, data in cases.items():
        d = tmp_path / case
        d.mkdir()
        p = d / "x_train_000000.bin"
        p.write_bytes(data)
        with pytest.raises(ShardError, match=rf"{p}: {msgs[case]}"):
            ShardReader(p)
        with pytest.raises(ShardError, match=str(p)):
            ShardSet(d, "train")
        r = runner.invoke(data_cli, ["inspect", str(d)])
        assert r.exit_code == 1 and str(p) in r.output and msgs[case] in r.output
    with pytest.raises(ShardError, match="truncated header"):
        (tmp_path / "tiny.bin").write_bytes(good[: HEADER_BYTES - 4])
        ShardReader(tmp_path / "tiny.bin")


def test_token_ids_beyond_uint16_are_an_error(tmp_path, monkeypatch):
    with pytest.raises(ShardError, match=r"token id 70000 does not fit uint16"):
        write_shard(tmp_path / "x_train_000000.bin", [1, 70000])
    assert not (tmp_path / "x_train_000000.bin").exists()

    class WideTokenizer:
        name, n_vocab = "wide", 100277

        def encode_ordinary(self, text):
            return [1, 2, 70000]

    monkeypatch.setattr(worker, "_ENC", WideTokenizer())
    with pytest.raises(PrepInputError, match=r"in.jsonl:1: token id 70000 does not fit uint16"):
        worker.tokenize_task("json", [b'{"text": "x"}'], ["in.jsonl:1"], "text", False)


def test_hub_offline_mode_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        HubUnreachable,
        match=r"dataset 'HuggingFaceFW/fineweb-edu' \(config sample-10BT\).*"
        r"HF_HUB_OFFLINE is set.*--source files",
    ):
        prep(tmp_path / "o", source="fineweb-edu")


def test_hub_source_without_the_hubs_packages_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(
        HubUnreachable, match=r"fineweb-edu.*huggingface_hub is not installed \(make setup.*--source files"
    ):
        prep(tmp_path / "o", source="fineweb-edu")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_unanswering_hub_fails_within_the_timeout(tmp_path):
    """A Hub endpoint that accepts connections and never answers must not hang prep-data."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{srv.getsockname()[1]}", PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "data_prep",
                "prep-data",
                "--source",
                "openwebtext",
                "--out",
                str(tmp_path / "o"),
                "hf_timeout=1",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        srv.close()
    assert r.returncode == 1
    assert "cannot reach the Hugging Face Hub for dataset 'Skylion007/openwebtext'" in r.stderr
    assert "--source files" in r.stderr
    assert time.monotonic() - t0 < 120


def test_cli_config_errors_are_clean(tmp_path):
    from data_prep.cli import prep_data

    r = CliRunner().invoke(prep_data, ["--source", "demo", "--out", str(tmp_path), "shard_tokns=5"])
    assert r.exit_code == 2 and "unknown config key 'shard_tokns'" in r.output and "Traceback" not in r.output


def test_one_prep_data_per_output_directory(tmp_path):
    import fcntl
    from data_prep.prep import PrepError

    f = jsonl(tmp_path / "in.jsonl", good_lines(3))
    (tmp_path / "o").mkdir()
    with open(tmp_path / "o" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(PrepError, match="another prep-data is writing there"):
            prep(tmp_path / "o", inputs=[str(f)])
    assert prep(tmp_path / "o", inputs=[str(f)])["complete"]


def test_shard_checksum_is_verified_once_lazily_on_its_rank_and_old_manifests_still_load(tmp_path):
    """data.verify: a same-size byte flip is found at the shard's first read, on the rank that owns the
    shard (k % world size); manifests listing names only, or entries without sha256, are read unchecked."""
    from data_prep.assets import sha256_file

    for k in range(2):
        write_shard(tmp_path / f"t_train_{k:06d}.bin", np.arange(100) + k)
    sums = [sha256_file(tmp_path / f"t_train_{k:06d}.bin") for k in range(2)]
    body = bytearray((tmp_path / "t_train_000001.bin").read_bytes())
    body[HEADER_BYTES + 10] ^= 1  # token 5 of shard 1: 6 -> 7, still a valid id
    (tmp_path / "t_train_000001.bin").write_bytes(bytes(body))

    def manifest(entries):
        (tmp_path / "manifest.json").write_text(
            json.dumps({"complete": True, "splits": {"train": {"shards": entries}}})
        )

    manifest([{"name": f"t_train_{k:06d}.bin", "sha256": s} for k, s in enumerate(sums)])
    ok = ShardSet(tmp_path, "train", verify=(0, 2))  # rank 0 of 2 owns shard 0 only: shard 1 is not its to check
    assert ok.read(95, 10).tolist() == [95, 96, 97, 98, 99, 1, 2, 3, 4, 5]
    bad = ShardSet(tmp_path, "train", verify=(0, 1))
    assert bad.read(0, 10).tolist() == list(range(10))  # shard 0 is fine; shard 1 not read yet, not hashed
    with pytest.raises(ShardError, match=r"t_train_000001.bin: sha256 .* differs from the manifest"):
        bad.read(100, 2)
    for entries in ([f"t_train_{k:06d}.bin" for k in range(2)], [{"name": f"t_train_{k:06d}.bin"} for k in range(2)]):
        manifest(entries)
        assert ShardSet(tmp_path, "train", verify=(0, 1)).read(100, 6).tolist() == [1, 2, 3, 4, 5, 7]
