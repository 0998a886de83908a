"""A manifest says what its shards hold, and every reader holds it to that: `tlf data inspect` (with and without
--verify) and training's reader (`data_prep.shards.ShardSet`, through `pipeline.train.data.build_loaders`) check
each shard's header and size against the manifest's token counts, the split totals against their shards, and the
manifest's fields' presence and types, from the header and a stat alone. Each damage is one line naming the
manifest, the field and both values, never a traceback, and the data directory is left as it was."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from data_prep.shards import HEADER_BYTES, HEADER_INTS, ShardError, ShardSet, read_manifest


def tlf(*argv):
    from pipeline.cli import main

    return CliRunner().invoke(main, list(argv), catch_exceptions=True)


PREP = ["prep-data", "--source", "demo", "-j", "0", "--no-progress", "--max-tokens", "20000", "--shard-tokens", "6000"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A real `tlf prep-data` output of the demo corpus: 3 train shards of 6000 tokens and a val shard."""
    d = tmp_path_factory.mktemp("manifest") / "demo"
    r = tlf(*PREP, "--out", str(d))
    assert r.exit_code == 0, r.output
    m = json.loads((d / "manifest.json").read_text())
    assert len(m["splits"]["train"]["shards"]) >= 3 and m["splits"]["val"]["shards"], m["splits"]
    return d


def digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def damaged(data, tmp_path, edit=None, shard=None):
    """A copy of the data directory with its manifest changed by edit(manifest) and/or shard(path of train shard 1)."""
    d = tmp_path / "d"
    shutil.copytree(data, d)
    if edit is not None:
        m = json.loads((d / "manifest.json").read_text())
        edit(m)
        (d / "manifest.json").write_text(json.dumps(m))
    if shard is not None:
        shard(d / json.loads((d / "manifest.json").read_text())["splits"]["train"]["shards"][1]["name"])
    return d


def set_tokens(m, k, n):
    """Train shard k says n tokens, and the totals agree with it: only the shard's header can tell."""
    sh = m["splits"]["train"]["shards"][k]
    diff = n - sh["tokens"]
    sh["tokens"] = n
    m["splits"]["train"]["tokens"] += diff
    m["total_tokens"] += diff


def truncate(p):
    p.write_bytes(p.read_bytes()[:-10])


def as_uint32(p):
    """The shard's tokens rewritten as 4-byte ids under the same header."""
    raw = p.read_bytes()
    p.write_bytes(raw[:HEADER_BYTES] + np.frombuffer(raw[HEADER_BYTES:], np.uint16).astype(np.uint32).tobytes())


def header_count(p, delta=-1):
    raw = bytearray(p.read_bytes())
    h = np.frombuffer(bytes(raw[:HEADER_BYTES]), np.int32).copy()
    h[2] += delta
    raw[:HEADER_BYTES] = h.tobytes()
    p.write_bytes(bytes(raw))


def drop(path):
    def edit(m):
        *keys, last = path
        obj = m
        for k in keys:
            obj = obj[k]
        del obj[last]

    return edit


def put(path, value):
    def edit(m):
        *keys, last = path
        obj = m
        for k in keys:
            obj = obj[k]
        obj[last] = value

    return edit


# id: (manifest edit, shard damage, strings the one error line must hold)
DAMAGES = {
    "shard-token-count-wrong": (
        lambda m: set_tokens(m, 1, m["splits"]["train"]["shards"][1]["tokens"] + 7),
        None,
        ["manifest.json", "splits.train.shards[1].tokens is 6007", "header says 6000 tokens"],
    ),
    "shard-count-wrong-totals-not": (
        put(("splits", "train", "shards", 0, "tokens"), 5990),
        None,
        ["manifest.json", "splits.train.tokens is", "but splits.train.shards[*].tokens add up to"],
    ),
    "split-total-wrong": (
        lambda m: m["splits"]["val"].update(tokens=m["splits"]["val"]["tokens"] + 1),
        None,
        ["manifest.json", "splits.val.tokens is", "but splits.val.shards[*].tokens add up to"],
    ),
    "split-docs-wrong": (
        lambda m: m["splits"]["train"].update(docs=m["splits"]["train"]["docs"] + 1),
        None,
        ["manifest.json", "splits.train.docs is", "but splits.train.shards[*].docs add up to"],
    ),
    "total-tokens-wrong": (
        lambda m: m.update(total_tokens=m["total_tokens"] - 100),
        None,
        ["manifest.json", "total_tokens is 19900 but splits.*.tokens add up to 20000"],
    ),
    "shard-tokens-missing": (
        drop(("splits", "train", "shards", 0, "tokens")),
        None,
        ["manifest.json", "splits.train.shards[0].tokens is missing"],
    ),
    "total-tokens-missing": (drop(("total_tokens",)), None, ["manifest.json", "total_tokens is missing"]),
    "split-tokens-missing": (
        drop(("splits", "val", "tokens")),
        None,
        ["manifest.json", "splits.val.tokens is missing"],
    ),
    "dtype-missing": (drop(("shard_format", "dtype")), None, ["manifest.json", "shard_format.dtype is missing"]),
    "shard-tokens-a-string": (
        lambda m: m["splits"]["train"]["shards"][0].update(tokens=str(m["splits"]["train"]["shards"][0]["tokens"])),
        None,
        ["manifest.json", "splits.train.shards[0].tokens must be an integer >= 0, not string '6000'"],
    ),
    "shard-tokens-negative": (
        put(("splits", "train", "shards", 2, "tokens"), -1),
        None,
        ["manifest.json", "splits.train.shards[2].tokens must be an integer >= 0, not number -1"],
    ),
    "complete-a-string": (put(("complete",), "yes"), None, ["manifest.json", "complete must be true or false"]),
    "sha256-a-number": (
        put(("splits", "val", "shards", 0, "sha256"), 12),
        None,
        ["manifest.json", "splits.val.shards[0].sha256 must be a string, not number 12"],
    ),
    "shard-a-bare-name": (
        lambda m: m["splits"]["train"]["shards"].__setitem__(0, m["splits"]["train"]["shards"][0]["name"]),
        None,
        ["manifest.json", "splits.train.shards[0] is the bare name"],
    ),
    "format-other": (put(("format",), "other-shards"), None, ["manifest.json", "format is 'other-shards'"]),
    "shard-truncated": (
        None,
        truncate,
        ["_000001.bin", "(truncated or corrupt)", "splits.train.shards[1].tokens is 6000"],
    ),
    "shard-header-count-changed": (
        None,
        header_count,
        ["manifest.json", "splits.train.shards[1].tokens is 6000", "header says 5999 tokens"],
    ),
    "manifest-dtype-uint32": (
        put(("shard_format", "dtype"), "uint32"),
        None,
        ["manifest.json", "shard_format.dtype is 'uint32'", "'uint16'"],
    ),
    "shard-written-as-uint32": (
        None,
        as_uint32,
        ["_000001.bin", "4-byte tokens", "another dtype than uint16", "splits.train.shards[1].tokens is 6000"],
    ),
    "manifest-version-other": (
        put(("shard_format", "version"), 2),
        None,
        ["manifest.json", "shard_format.version is 2 but this reader reads 1"],
    ),
}


def one_error_line(r, names):
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert all(n in errors[0] for n in names), (names, errors[0])


@pytest.mark.parametrize("case", list(DAMAGES))
def test_inspect_verify_names_the_damage_and_changes_nothing(case, data, tmp_path):
    edit, shard, names = DAMAGES[case]
    d = damaged(data, tmp_path, edit, shard)
    before = digests(d)
    for argv in (["data", "inspect", str(d), "--verify"], ["data", "inspect", str(d), "-n", "0"]):
        one_error_line(tlf(*argv), names)
    assert digests(d) == before


@pytest.mark.parametrize(
    "case", ["shard-token-count-wrong", "total-tokens-wrong", "shard-tokens-missing", "shard-truncated"]
)
def test_training_reader_checks_the_manifest_at_its_first_read(case, data, tmp_path):
    """build_loaders (what `tlf train` calls) opens data.dir through ShardSet: the same checks, before a batch."""
    from pipeline.config import load_config
    from pipeline.train.data import build_loaders

    edit, shard, names = DAMAGES[case]
    d = damaged(data, tmp_path, edit, shard)
    before = digests(d)
    cfg = load_config("tiny/t-loopformer", [f"data.dir={d}"])
    with pytest.raises(ShardError) as e:
        build_loaders(cfg, 0, 1)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    assert digests(d) == before


def test_intact_data_passes_every_check_from_the_header_alone(data, monkeypatch):
    """The prep-data output reads, and the checks open no shard body: ShardSet reads 256 ints and a stat per shard."""
    from pipeline.config import load_config
    from pipeline.train.data import build_loaders

    r = tlf("data", "inspect", str(data), "--verify", "-n", "1")
    assert r.exit_code == 0 and "sha256 verified for" in r.output and "warning" not in r.output, r.output
    loader, val = build_loaders(load_config("tiny/t-loopformer", [f"data.dir={data}"]), 0, 1)
    x, y = loader.next()
    assert x.shape == (4, 64) and val[0][0] == "val/loss"
    calls, real = [], np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda *a, **kw: calls.append(kw.get("count")) or real(*a, **kw))
    ShardSet(data, "train")
    assert calls and set(calls) == {HEADER_INTS}


def test_missing_checksums_are_a_warning_not_an_error(data, tmp_path):
    """A manifest without sha256 (older prep-data) is read; --verify says which shards it could not verify."""
    d = damaged(data, tmp_path, drop(("splits", "val", "shards", 0, "sha256")))
    r = tlf("data", "inspect", str(d), "--verify", "-n", "0")
    assert r.exit_code == 0, r.output
    assert "warning: 1 shards have no sha256 in the manifest (not verified)" in r.output
    assert len(ShardSet(d, "val", verify=(0, 1))) == read_manifest(d / "manifest.json")["splits"]["val"]["tokens"]


def test_hand_written_manifests_are_checked_for_the_fields_they_hold(data, tmp_path):
    """A manifest without `format` (written by hand, not by prep-data) may leave fields out; those it has must agree."""
    d = tmp_path / "h"
    shutil.copytree(data, d)
    m = json.loads((d / "manifest.json").read_text())
    names = [s["name"] for s in m["splits"]["train"]["shards"]]
    (d / "manifest.json").write_text(json.dumps({"complete": True, "splits": {"train": {"shards": names}}}))
    assert len(ShardSet(d, "train")) == m["splits"]["train"]["tokens"]
    entries = [{"name": n, "tokens": 1} for n in names]
    (d / "manifest.json").write_text(json.dumps({"splits": {"train": {"shards": entries}}}))
    with pytest.raises(ShardError, match=r"manifest.json: splits.train.shards\[0\].tokens is 1 but .*header says"):
        ShardSet(d, "train")


def test_prep_data_rerun_checks_its_shards_against_the_manifest(data, tmp_path):
    """The same prep-data command run again on its output (to resume it, or to find it complete) reads the shards
    the manifest lists with the same check."""
    d = damaged(data, tmp_path, None, header_count)
    before = digests(d)
    one_error_line(
        tlf(*PREP, "--out", str(d)),
        ["cannot resume", "manifest.json: splits.train.shards[1].tokens is 6000", "header says 5999 tokens"],
    )
    assert digests(d) == before
