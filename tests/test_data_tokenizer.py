"""Offline assets and the GPT-2 tokenizer: pinned, verified, cached; known encodings."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from data_prep import assets
from data_prep.tokenizer import get_encoding
from data_prep.wikiclean import clean


@pytest.fixture(scope="module")
def files():
    return assets.ensure_assets()


def test_known_gpt2_encodings(files):
    enc = get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    text = "Call me Ishmael. Some years ago—never mind how long precisely"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_bpe_files_are_the_pinned_ones(files, tmp_path, monkeypatch):
    # Placed under tiktoken's cache names, byte-identical to what tiktoken itself would download.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    d = assets.ensure_bpe()
    pinned = dict((m.rsplit("/", 1)[1], sha) for m, sha in assets.GPT2_BPE.members)
    for name, key in assets.BPE_CACHE_NAMES.items():
        assert hashlib.sha256((d / key).read_bytes()).hexdigest() == pinned[name]


def test_second_run_uses_the_cache(files, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("a cached set-up must not call npm or pip")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert assets.ensure_assets() == files


def test_demo_corpus_is_real_text(files):
    docs = [json.loads(line) for line in open(files["demo"])]
    srcs = [d["source"] for d in docs]
    assert sum(s.startswith("sotu/") for s in srcs) == 233
    assert srcs[0] == "sotu/1790_george_washington_n"
    assert "Call me Ishmael" in next(d["text"] for d in docs if d["source"] == "moby-dick/chapter_1")
    wiki = [json.loads(line) for line in open(files["demo-enwiki"])]
    assert len(wiki) > 50
    body = "\n".join(w["text"] for w in wiki)
    for markup in ("{{", "[[", "<ref", "'''", "&nbsp;"):
        assert markup not in body, markup


def test_checksum_mismatch_is_refused(tmp_path):
    dl = tmp_path / "downloads"
    dl.mkdir()
    (dl / assets.GPT2_BPE.filename).write_bytes(b"not the package")
    with pytest.raises(assets.AssetError, match="does not match the pinned"):
        assets.fetch(assets.GPT2_BPE, tmp_path)
    assert (dl / (assets.GPT2_BPE.filename + ".bad")).exists()  # moved aside, nothing silently used


def test_missing_client_names_the_manual_way(tmp_path, monkeypatch):
    monkeypatch.setattr(assets.shutil, "which", lambda name: None)
    with pytest.raises(assets.AssetError, match="by hand"):
        assets.fetch(assets.SOTU, tmp_path)


def test_wiki_markup_cleaning():
    text = (
        "'''Anarchism''' is a [[political philosophy]]<ref>Source</ref> that [[State (polity)|states]]"
        "{{citation needed|date=2015}} oppose.\n{| class=wikitable\n|-\n| a || b\n|}\n"
        "[[File:A.jpg|thumb|A [[flag]]]]\n== History ==\n* Item one\n== References ==\nrefs here"
    )
    out = clean(text)
    assert out == "Anarchism is a political philosophy that states oppose.\n\nHistory\nItem one"
