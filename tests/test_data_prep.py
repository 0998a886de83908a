"""prep-data on real text: shard format, val rule, manifest, every local format, Hub streaming path,
worker-count independence, --max-tokens, config handling."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.assets import ensure_assets
from data_prep.config import load_prep_config
from data_prep.prep import PrepError, prepare
from data_prep.shards import EOT, HEADER_BYTES, MAGIC, ShardError, ShardReader, ShardSet
from data_prep.tokenizer import get_encoding
from pipeline.config import ConfigError


@pytest.fixture(scope="module")
def docs():
    """80 real documents (State of the Union, then Moby-Dick chapters), shortened to keep tests quick."""
    rows = [json.loads(line) for line in open(ensure_assets()["demo"])]
    pick = rows[:40] + rows[-40:]
    return [r["text"][:6000] for r in pick]


def prep(out, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    kw["out"] = str(out)
    return prepare(load_prep_config(values=kw), log=lambda m: None)


def expected(texts, val_every):
    enc = get_encoding()
    streams = {"train": [], "val": []}
    for i, t in enumerate(x for x in texts if x.strip()):
        split = "val" if val_every > 0 and i % val_every == 0 else "train"
        streams[split] += [EOT] + enc.encode_ordinary(t)
    return {s: np.array(v, dtype=np.uint16) for s, v in streams.items() if v}


def stream(d, split):
    s = ShardSet(d, split)
    return s.read(0, s.num_tokens)


def files_of(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".bin"}


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_demo_corpus_prep(tmp_path):
    m = prep(tmp_path, source="demo")
    assert m["complete"] and set(m["splits"]) == {"train", "val"}
    docs = [json.loads(line)["text"] for line in open(ensure_assets()["demo"])]
    assert m["documents"]["kept"] == len(docs) == 371
    assert m["splits"]["val"]["docs"] == 19  # documents 0, 20, ..., 360
    want = expected(docs, 20)
    for split in ("train", "val"):
        got = stream(tmp_path, split)
        assert np.array_equal(got, want[split])
        for sh in m["splits"][split]["shards"]:
            raw = (tmp_path / sh["name"]).read_bytes()
            assert hashlib.sha256(raw).hexdigest() == sh["sha256"]
            header = np.frombuffer(raw[:HEADER_BYTES], dtype=np.int32)
            assert list(header[:3]) == [MAGIC, 1, sh["tokens"]] and not header[3:].any()
            assert len(raw) == HEADER_BYTES + 2 * sh["tokens"]
    assert get_encoding().decode(stream(tmp_path, "val")[1:4].tolist()).startswith("Fellow")
    assert m["tokenizer"]["name"] == "gpt2" and m["resume"] is None


def test_documents_span_shards(tmp_path, docs):
    m = prep(
        tmp_path / "o",
        source="files",
        inputs=[str(write_jsonl(tmp_path / "in.jsonl", docs))],
        shard_tokens=1000,
        val_every=-1,
    )
    shards = m["splits"]["train"]["shards"]
    assert [s["name"] for s in shards[:2]] == ["data_train_000000.bin", "data_train_000001.bin"]
    assert all(s["tokens"] == 1000 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 1000
    assert "val" not in m["splits"]
    want = expected(docs, -1)["train"]
    assert np.array_equal(stream(tmp_path / "o", "train"), want)
    assert sum(s["docs"] for s in shards) == len(docs)
    assert ShardSet(tmp_path / "o", "train").read(990, 20).tolist() == want[990:1010].tolist()  # across a boundary


@pytest.mark.parametrize("val_every", [1, 3])
def test_val_rule(tmp_path, docs, val_every):
    inp = write_jsonl(tmp_path / "in.jsonl", docs[:30])
    m = prep(tmp_path / "o", source="files", inputs=[str(inp)], val_every=val_every)
    want = expected(docs[:30], val_every)
    assert set(m["splits"]) == set(want)
    for s in want:
        assert np.array_equal(stream(tmp_path / "o", s), want[s])


def test_worker_count_gives_identical_bytes(tmp_path, docs):
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    outs = {}
    for w in (0, 1, 2):
        m = prep(
            tmp_path / f"w{w}",
            source="files",
            inputs=[str(inp)],
            workers=w,
            shard_tokens=7000,
            val_every=5,
            batch_bytes=20000,
        )
        outs[w] = (files_of(tmp_path / f"w{w}"), m["splits"])
    assert len(outs[0][0]) > 10
    assert outs[0] == outs[1] == outs[2]


def test_every_local_format_gives_the_same_tokens(tmp_path, docs):
    texts = docs[:25] + ["", "unicode: naïve café — 東京 🚀"]
    want = expected(texts, 4)
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", texts)
    body = (src / "a.jsonl").read_bytes()
    with open(src / "b.jsonl.zst", "wb") as fh:  # two frames, as concatenated .zst files are
        cut = body.index(b"\n", len(body) // 2) + 1
        fh.write(zstandard.ZstdCompressor().compress(body[:cut]) + zstandard.ZstdCompressor().compress(body[cut:]))
    pq.write_table(pa.table({"content": texts}), src / "c.parquet", row_group_size=7)
    (src / "txt").mkdir()
    for i, t in enumerate(texts):
        (src / "txt" / f"{i:03d}.txt").write_text(t)
    cases = {
        "jsonl": dict(inputs=[str(src / "a.jsonl")]),
        "zst": dict(inputs=[str(src / "b.jsonl.zst")]),
        "parquet": dict(inputs=[str(src / "c.parquet")], text_field="content"),
        "txt-dir": dict(inputs=[str(src / "txt")]),
        "txt-glob": dict(inputs=[str(src / "txt" / "0*.txt")]),
        "hf-stream": dict(
            source="hf", hf_dataset="parquet", hf_data_files=[str(src / "c.parquet")], text_field="content"
        ),
    }
    for name, kw in cases.items():
        kw.setdefault("source", "files")
        m = prep(tmp_path / name, val_every=4, batch_bytes=5000, **kw)
        for s in ("train", "val"):
            assert np.array_equal(stream(tmp_path / name, s), want[s]), (name, s)
        assert m["documents"]["skipped_empty"] == 1, name


def test_txt_line_and_paragraph_modes(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph,\nstill first.\n\n\nSecond one.\nmore\n\nThird.")
    enc = get_encoding()
    for mode, parts in {
        "line": ["First paragraph,", "still first.", "Second one.", "more", "Third."],
        "paragraph": ["First paragraph,\nstill first.", "Second one.\nmore", "Third."],
    }.items():
        prep(tmp_path / mode, source="files", inputs=[str(tmp_path / "a.txt")], txt_mode=mode, val_every=-1)
        want = [t for p in parts for t in [EOT] + enc.encode_ordinary(p)]
        assert stream(tmp_path / mode, "train").tolist() == want


def test_max_tokens(tmp_path, docs):
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    m = prep(tmp_path / "o", source="files", inputs=[str(inp)], max_tokens=12345, shard_tokens=5000, val_every=3)
    assert m["total_tokens"] == 12345
    full = expected(docs, 3)
    for s in ("train", "val"):
        got = stream(tmp_path / "o", s)
        assert np.array_equal(got, full[s][: got.size])


def test_the_tokenizer_pool_is_closed_after_an_early_stop_and_terminated_only_on_an_error(tmp_path, docs, monkeypatch):
    """max_tokens stops the reader with tasks still in flight in the pool of tokenizer processes: prep-data lets
    them finish and closes the pool (Pool.terminate, the one shutdown CPython's pool can hang in, is kept for
    errors); either way no tokenizer process outlives the run, and the tokens are those of one process."""
    import multiprocessing as mp
    import multiprocessing.pool as mpp

    from data_prep.worker import PrepInputError

    calls = []

    def spy(name):
        real = getattr(mpp.Pool, name)
        return lambda self: (calls.append(name), real(self))[1]

    for name in ("close", "terminate"):
        monkeypatch.setattr(mpp.Pool, name, spy(name))
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    opts = dict(source="files", inputs=[str(inp)], max_tokens=12345, shard_tokens=5000, val_every=3, batch_bytes=9000)
    prep(tmp_path / "o", **opts, workers=2)  # about 55 tasks of 1-2 documents; the stop comes near the 7th
    assert calls == ["close"] and not mp.active_children()
    prep(tmp_path / "one", **opts)
    assert files_of(tmp_path / "o") == files_of(tmp_path / "one")

    calls.clear()
    rows = [json.dumps({"text": t}) for t in docs[:30]] + [json.dumps({"body": "no text"})]
    (tmp_path / "bad.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(PrepInputError, match="bad.jsonl:31: no text field"):
        prep(tmp_path / "b", source="files", inputs=[str(tmp_path / "bad.jsonl")], batch_bytes=9000, workers=2)
    assert calls == ["terminate"] and not mp.active_children()


def test_rerun_is_a_noop_and_other_options_are_refused(tmp_path, docs):
    inp = write_jsonl(tmp_path / "in.jsonl", docs[:10])
    prep(tmp_path / "o", source="files", inputs=[str(inp)])
    before = files_of(tmp_path / "o")
    assert prep(tmp_path / "o", source="files", inputs=[str(inp)], workers=2)["complete"]  # workers may differ
    assert files_of(tmp_path / "o") == before
    with pytest.raises(PrepError, match="differs in: shard_tokens"):
        prep(tmp_path / "o", source="files", inputs=[str(inp)], shard_tokens=500)
    assert files_of(tmp_path / "o") == before  # refused without touching anything
    m = prepare(
        load_prep_config(
            values=dict(
                source="files", inputs=[str(inp)], out=str(tmp_path / "o"), shard_tokens=500, workers=0, progress=False
            )
        ),
        overwrite=True,
    )
    assert len(m["splits"]["train"]["shards"]) > 1
    assert set(files_of(tmp_path / "o")) == {s["name"] for v in m["splits"].values() for s in v["shards"]}


def test_config_file_overrides_and_unknown_keys(tmp_path):
    y = tmp_path / "prep.yaml"
    y.write_text("prep:\n  source: demo\n  out: data/x\n  shard_tokens: 1000\n")
    cfg = load_prep_config(str(y), {"shard_tokens": 2000, "out": None}, ["val_every=7"])
    assert (cfg.source, cfg.out, cfg.shard_tokens, cfg.val_every) == ("demo", "data/x", 2000, 7)
    y.write_text("source: demo\nout: x\nshard_tokns: 5\n")
    with pytest.raises(ConfigError, match=r"prep.yaml: unknown config key 'shard_tokns' \(did you mean 'shard_tokens'"):
        load_prep_config(str(y))
    with pytest.raises(ConfigError, match="'max_tokens' expects int"):
        load_prep_config(None, {"source": "demo", "out": "x"}, ["max_tokens=lots"])
    with pytest.raises(ConfigError, match="inputs: source=files needs"):
        load_prep_config(None, {"out": "x"})
    with pytest.raises(ConfigError, match="source: 'webtext'"):
        load_prep_config(None, {"out": "x", "source": "webtext"})


def test_incomplete_output_is_refused_by_the_reader(tmp_path, docs):
    inp = write_jsonl(tmp_path / "in.jsonl", docs)
    prep(tmp_path / "o", source="files", inputs=[str(inp)], shard_tokens=3000)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    m["complete"] = False
    (tmp_path / "o" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShardError, match="incomplete"):
        ShardSet(tmp_path / "o", "train")
    assert len(ShardReader(tmp_path / "o" / m["splits"]["train"]["shards"][0]["name"])) == 3000
