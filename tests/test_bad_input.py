"""Bad input, everywhere, named: each case runs through the real `tlf` entry point (in process,
click's CliRunner) and must exit 2 (usage) or 1 (runtime) with a one-line message naming the file, line, row or key
-- never a traceback. The README's "What happens when..." table lists the same cases."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner

from data_prep.shards import write_shard
from helpers import perturbed_tiny
from pipeline.model.io import save_model

TEXT = "The quick brown fox jumps over the lazy dog. " * 20
TINY = [
    "model.vocab_size=512",
    "model.block_size=32",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.n_layers=2",
    "model.loops=3",
    "model.fourier_dim=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "schedule.max_steps=2",
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "logging.mlflow=false",
    "train.device=cpu",
]
EVAL = ["--tasks", "none", "--no-latency", "--no-mlflow"]


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> Path:
    """Every bad (and a few good) input file, made once."""
    d = tmp_path_factory.mktemp("bad")
    lines = [json.dumps({"text": TEXT})] * 3
    (d / "malformed.jsonl").write_text("\n".join(lines[:2] + ['{"text": "unclosed'] + lines[2:]) + "\n")
    for name, rec in (("null", {"text": None}), ("number", {"text": 7}), ("missing", {"body": TEXT})):
        (d / f"{name}.jsonl").write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    (d / "empty.jsonl").write_text("")
    whole = zstandard.ZstdCompressor().compress(("\n".join(lines * 50) + "\n").encode())
    (d / "trunc.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    (d / "notzstd.jsonl.zst").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"body": [TEXT, TEXT]}), d / "nocol.parquet")
    (d / "good.jsonl").write_text("\n".join(lines) + "\n")

    rng = np.random.default_rng(0)
    for name in ("good", "magic", "trunc", "nosplit", "badmanifest", "schemamanifest"):
        (d / name).mkdir()
        write_shard(d / name / "t_train_000000.bin", rng.integers(0, 512, 20 * 32 + 1))
        write_shard(d / name / "t_val_000000.bin", rng.integers(0, 512, 8 * 32 + 1))
    for split in ("train", "val"):
        bad = bytearray((d / "magic" / f"t_{split}_000000.bin").read_bytes())
        bad[:4] = b"\0\0\0\0"
        (d / "magic" / f"t_{split}_000000.bin").write_bytes(bytes(bad))
    for split in ("train", "val"):
        body = (d / "trunc" / f"t_{split}_000000.bin").read_bytes()
        (d / "trunc" / f"t_{split}_000000.bin").write_bytes(body[:-100])
    (d / "nosplit" / "t_train_000000.bin").unlink()
    (d / "badmanifest" / "manifest.json").write_text('{"complete": true, "splits": ')
    (d / "schemamanifest" / "manifest.json").write_text('{"complete": true, "splits": {"train": {"shards": 3}}}')

    (d / "unknown.yaml").write_text("train:\n  micro_batch_sise: 2\n")
    (d / "wrongtype.yaml").write_text("train:\n  micro_batch_size: two\n")
    (d / "orphan.yaml").write_text("inherit: [no_such_parent.yaml]\n")
    (d / "self.yaml").write_text("inherit: [self.yaml]\n")

    m, cfg = perturbed_tiny("tiny/t-loopformer")
    save_model(d / "model", m, cfg)
    (d / "nomodel").mkdir()
    shutil.copytree(d / "model", d / "truncmodel")
    wf = next(f for f in (d / "truncmodel").iterdir() if f.name.startswith("model."))
    wf.write_bytes(wf.read_bytes()[:200])
    (d / "truncpt").mkdir()  # the same weights as model.pt, cut short
    shutil.copy(d / "model" / "config.yaml", d / "truncpt" / "config.yaml")
    import torch

    torch.save(m.state_dict(), d / "truncpt" / "model.pt")
    (d / "truncpt" / "model.pt").write_bytes((d / "truncpt" / "model.pt").read_bytes()[:5000])
    (d / "emptystore").mkdir()  # a store that exists and holds no experiment
    from pipeline import tracking

    tracking.client(f"sqlite:///{d / 'emptystore' / 'm.db'}").search_experiments()

    # inputs of every command, each a one-line error
    (d / "vocabhigh").mkdir()  # a token id no tokenizer id can be (uint16 allows up to 65535)
    write_shard(d / "vocabhigh" / "t_train_000000.bin", np.array([50256, 60000, 1, 2] * 10))
    (d / "inherit5.yaml").write_text("inherit: 5\n")
    shutil.copytree(d / "good", d / "flipped")  # prep-data's manifest (sha256 per shard), then one byte flipped
    from data_prep.assets import sha256_file

    (d / "flipped" / "manifest.json").write_text(
        json.dumps(
            {
                "complete": True,
                "splits": {
                    s: {
                        "shards": [
                            {"name": f"t_{s}_000000.bin", "sha256": sha256_file(d / "flipped" / f"t_{s}_000000.bin")}
                        ]
                    }
                    for s in ("train", "val")
                },
            }
        )
    )
    body = bytearray((d / "flipped" / "t_train_000000.bin").read_bytes())
    body[2000] ^= 0x01  # a token id that stays below the vocabulary: only the checksum can tell
    (d / "flipped" / "t_train_000000.bin").write_bytes(bytes(body))
    (d / "emptypt").mkdir()
    shutil.copy(d / "model" / "config.yaml", d / "emptypt" / "config.yaml")
    (d / "emptypt" / "model.pt").write_bytes(b"")
    shutil.copytree(d / "model", d / "badcfg")
    (d / "badcfg" / "config.yaml").write_text("model: [unclosed\n")
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model" / "model.safetensors"))
    (d / "wrongshape").mkdir()
    shutil.copy(d / "model" / "config.yaml", d / "wrongshape" / "config.yaml")
    save_file(
        {**state, "wte.weight": state["wte.weight"][:, :-1].contiguous()}, str(d / "wrongshape" / "model.safetensors")
    )
    (d / "nanmodel").mkdir()
    shutil.copy(d / "model" / "config.yaml", d / "nanmodel" / "config.yaml")
    save_file(
        {k: torch.full_like(v, float("nan")) for k, v in state.items()}, str(d / "nanmodel" / "model.safetensors")
    )
    for name, rec in (
        ("runjson_types", {"mlflow_run_id": ["r1"], "tracking_uri": 5, "step": 1}),
        ("runjson_step", {"mlflow_run_id": "r1", "tracking_uri": "sqlite:///x.db", "step": "abc"}),
    ):
        shutil.copytree(d / "model", d / name)
        (d / name / "run.json").write_text(json.dumps(rec))

    # run directories `tlf compare --run-dir` reads
    step = lambda s, **kw: json.dumps({"step": s, "time": 1000 * s, "loss": 5.0 - s, **kw})
    for name, lines in (
        ("m_list", [step(1), "[1, 2, 3]", step(3)]),
        ("m_notjson", [step(1), '{"step": 2, "loss": ', step(3)]),
        ("m_abc", [step(1), step(2, loss="abc"), step(3)]),
        ("m_step", [step(1), json.dumps({"step": "two", "loss": 1.0})]),
        ("m_cut", [step(1), step(2), step(3)[:9]]),  # a kill mid-line: no newline after it
        ("m_tracking", [step(1), step(2)]),
    ):
        (d / name).mkdir()
        (d / name / "metrics.jsonl").write_text("\n".join(lines) + ("" if name == "m_cut" else "\n"))
    (d / "m_tracking" / "tracking.json").write_text("{not json")
    return d


def prep(w, src, *extra):
    return [
        "prep-data",
        "--source",
        "files",
        "-i",
        str(w / src),
        "--out",
        str(w / f"out_{src}"),
        "--no-progress",
        "-j",
        "0",
        *extra,
    ]


def plan(*extra):
    return ["plan", "tiny/t-loopformer", "--gpus", "1", "--gpu", "cpu", *extra]


def compare(w, run_dir, *extra):
    return ["compare", "--run-dir", str(w / run_dir), "--out", str(w / f"cmp_{run_dir}"), *extra]


def train(w, data, *extra):
    return ["train", "tiny/t-loopformer", *TINY, f"data.dir={w / data}", f"checkpoint.dir={w / 'ck' / data}", *extra]


# id: (argv, exit status, strings the message must hold)
CASES = {
    # prep-data inputs
    "jsonl-malformed-line": (lambda w: prep(w, "malformed.jsonl"), 1, ["malformed.jsonl:3"]),
    "jsonl-null-text": (lambda w: prep(w, "null.jsonl"), 1, ["null.jsonl:2", "text"]),
    "jsonl-number-text": (lambda w: prep(w, "number.jsonl"), 1, ["number.jsonl:2", "text"]),
    "jsonl-missing-text": (lambda w: prep(w, "missing.jsonl"), 1, ["missing.jsonl:2", "text"]),
    "empty-file": (lambda w: prep(w, "empty.jsonl"), 1, ["empty.jsonl", "no documents"]),
    "zst-truncated": (lambda w: prep(w, "trunc.jsonl.zst"), 1, ["trunc.jsonl.zst"]),
    "zst-not-zstd": (lambda w: prep(w, "notzstd.jsonl.zst"), 1, ["notzstd.jsonl.zst"]),
    "parquet-no-column": (lambda w: prep(w, "nocol.parquet"), 1, ["nocol.parquet", "text"]),
    "input-missing": (lambda w: prep(w, "nope.jsonl"), 1, ["nope.jsonl"]),
    "prep-out-not-a-dir": (
        lambda w: prep(w, "good.jsonl", "--out", str(w / "good.jsonl" / "out")),
        1,
        ["good.jsonl/out", "Not a directory"],
    ),
    "prep-unknown-key": (lambda w: prep(w, "good.jsonl", "shard_tokns=5"), 2, ["shard_tokns"]),
    "prep-wrong-type": (lambda w: prep(w, "good.jsonl", "shard_tokens=many"), 2, ["shard_tokens"]),
    "prep-bad-manifest": (
        lambda w: (
            prep(w, "good.jsonl")
            if (w / "out_good.jsonl").mkdir(exist_ok=True) or (w / "out_good.jsonl" / "manifest.json").write_text("{")
            else None
        ),
        1,
        ["out_good.jsonl/manifest.json"],
    ),
    # tlf data inspect
    "inspect-wrong-magic": (lambda w: ["data", "inspect", str(w / "magic")], 1, ["magic/t_train_000000.bin", "magic"]),
    "inspect-truncated": (
        lambda w: ["data", "inspect", str(w / "trunc")],
        1,
        ["trunc/t_train_000000.bin", "truncated"],
    ),
    "inspect-bad-manifest": (lambda w: ["data", "inspect", str(w / "badmanifest")], 1, ["badmanifest/manifest.json"]),
    "inspect-manifest-schema": (
        lambda w: ["data", "inspect", str(w / "schemamanifest")],
        1,
        ["schemamanifest/manifest.json"],
    ),
    # tlf train
    "train-wrong-magic": (lambda w: train(w, "magic"), 1, ["magic/t_train_000000.bin", "magic"]),
    "train-truncated": (lambda w: train(w, "trunc"), 1, ["trunc/t_train_000000.bin", "truncated"]),
    "train-no-train-split": (lambda w: train(w, "nosplit"), 1, ["nosplit", "'train'"]),
    "train-bad-manifest": (lambda w: train(w, "badmanifest"), 1, ["badmanifest/manifest.json"]),
    "train-manifest-schema": (lambda w: train(w, "schemamanifest"), 1, ["schemamanifest/manifest.json"]),
    "train-unknown-key-cli": (lambda w: train(w, "good", "train.micro_batch_sise=2"), 2, ["train.micro_batch_sise"]),
    "train-wrong-type-cli": (lambda w: train(w, "good", "train.micro_batch_size=two"), 2, ["train.micro_batch_size"]),
    "train-unknown-key-yaml": (lambda w: ["train", str(w / "unknown.yaml")], 2, ["unknown.yaml", "micro_batch_sise"]),
    "train-wrong-type-yaml": (
        lambda w: ["train", str(w / "wrongtype.yaml")],
        2,
        ["wrongtype.yaml", "micro_batch_size"],
    ),
    "yaml-inherits-missing": (lambda w: ["train", str(w / "orphan.yaml")], 2, ["orphan.yaml", "no_such_parent.yaml"]),
    "yaml-inherits-itself": (lambda w: ["train", str(w / "self.yaml")], 2, ["self.yaml", "cycle"]),
    "train-batch-sizes": (
        lambda w: train(w, "good", "train.global_batch_size=6"),
        2,
        ["train.global_batch_size=6", "train.micro_batch_size=2"],
    ),
    "train-checkpoint-dir-not-a-dir": (
        lambda w: train(w, "good", f"checkpoint.dir={w / 'good.jsonl' / 'ck'}"),
        1,
        ["good.jsonl/ck", "Not a directory"],
    ),
    "train-missing-data-dir": (lambda w: train(w, "nodata"), 1, ["nodata"]),
    # tlf eval
    "eval-missing-path": (lambda w: ["eval", str(w / "nowhere"), *EVAL], 2, ["nowhere", "does not exist"]),
    "eval-no-model": (lambda w: ["eval", str(w / "nomodel"), *EVAL], 1, ["nomodel", "no model export"]),
    "eval-truncated-weights": (
        lambda w: ["eval", str(w / "truncmodel"), *EVAL],
        2,
        ["truncmodel/model.", "unreadable"],
    ),
    "eval-truncated-model-pt": (lambda w: ["eval", str(w / "truncpt"), *EVAL], 2, ["truncpt/model.pt", "unreadable"]),
    "eval-truncated-shard": (
        lambda w: [
            "eval",
            str(w / "model"),
            f"data.dir={w / 'trunc'}",
            "data.extra_val_dirs=[]",
            "--ppl-tokens",
            "64",
            *EVAL,
        ],
        1,
        ["trunc/t_val_000000.bin", "truncated"],
    ),
    "eval-loops-0": (
        lambda w: ["eval", str(w / "model"), "--loops", "0", "--no-ppl", *EVAL],
        2,
        ["--loops", "loop budget 0"],
    ),
    "eval-loops-above-L": (
        lambda w: ["eval", str(w / "model"), "--loops", "9", "--no-ppl", *EVAL],
        2,
        ["9", "model.loops=4"],
    ),
    "eval-wrong-magic": (
        lambda w: [
            "eval",
            str(w / "model"),
            f"data.dir={w / 'magic'}",
            "data.extra_val_dirs=[]",
            "--ppl-tokens",
            "64",
            *EVAL,
        ],
        1,
        ["magic/t_val_000000.bin"],
    ),
    "eval-out-not-a-dir": (
        lambda w: ["eval", str(w / "model"), "--no-ppl", *EVAL, "--out", str(w / "good.jsonl" / "o")],
        1,
        ["good.jsonl/o", "Not a directory"],
    ),
    "eval-unknown-key": (lambda w: ["eval", str(w / "model"), "eval.limt=2", *EVAL], 2, ["eval.limt"]),
    # tlf generate
    "generate-missing-path": (lambda w: ["generate", str(w / "nowhere"), "-p", "hi"], 2, ["nowhere"]),
    "generate-no-model": (lambda w: ["generate", str(w / "nomodel"), "-p", "hi"], 1, ["nomodel", "no model export"]),
    "generate-prompt-too-long": (
        lambda w: ["generate", str(w / "model"), "-p", "word " * 300, "-n", "4"],
        2,
        ["--prompt", "model.block_size=64"],
    ),
    "generate-loops-above-L": (
        lambda w: ["generate", str(w / "model"), "-p", "hi", "-M", "9", "-n", "2"],
        2,
        ["--loops", "loop budget 9"],
    ),
    "generate-loops-0": (lambda w: ["generate", str(w / "model"), "-p", "hi", "-M", "0", "-n", "2"], 2, ["--loops"]),
    "inspect-token-above-vocab": (
        lambda w: ["data", "inspect", str(w / "vocabhigh")],
        1,
        ["vocabhigh/t_train_000000.bin", "60000", "vocabulary"],
    ),
    "train-shard-byte-flipped": (
        lambda w: train(w, "flipped"),
        1,
        ["flipped/t_train_000000.bin", "sha256", "manifest"],
    ),
    "yaml-inherit-not-a-list": (lambda w: ["train", str(w / "inherit5.yaml")], 2, ["inherit5.yaml", "inherit", "5"]),
    "eval-empty-model-pt": (
        lambda w: ["eval", str(w / "emptypt"), "--no-ppl", *EVAL],
        2,
        ["emptypt/model.pt", "unreadable"],
    ),
    "eval-corrupt-export-config": (
        lambda w: ["eval", str(w / "badcfg"), "--no-ppl", *EVAL],
        2,
        ["badcfg/config.yaml", "invalid YAML"],
    ),
    "generate-corrupt-export-config": (
        lambda w: ["generate", str(w / "badcfg"), "-p", "hi", "-n", "2"],
        2,
        ["badcfg/config.yaml", "invalid YAML"],
    ),
    "export-corrupt-export-config": (
        lambda w: ["export", str(w / "badcfg"), "--out", str(w / "exp_badcfg")],
        2,
        ["badcfg/config.yaml", "invalid YAML"],
    ),
    "export-out-under-a-file": (
        lambda w: ["export", str(w / "model"), "--out", str(w / "good.jsonl" / "sub")],
        1,
        ["good.jsonl/sub", "Not a directory"],
    ),
    "export-out-not-an-export": (
        lambda w: ["export", str(w / "model"), "--out", str(w / "good")],
        2,
        ["--out", "/good", "not an export"],
    ),
    "eval-wrong-shape-tensor": (
        lambda w: ["eval", str(w / "wrongshape"), "--no-ppl", *EVAL],
        2,
        ["wrongshape/model.safetensors", "wte.weight", "do not match"],
    ),
    "generate-nan-weights": (
        lambda w: ["generate", str(w / "nanmodel"), "-p", "hi", "-n", "2"],
        2,
        ["nanmodel/model.safetensors", "NaN"],
    ),
    "eval-nan-weights": (
        lambda w: ["eval", str(w / "nanmodel"), "--no-ppl", *EVAL],
        2,
        ["nanmodel/model.safetensors", "NaN"],
    ),
    "eval-run-json-types": (
        lambda w: [
            "eval",
            str(w / "runjson_types"),
            "--tasks",
            "none",
            "--no-latency",
            "--no-ppl",
            f"logging.tracking_uri=sqlite:///{w / 'rj.db'}",
        ],
        2,
        ["runjson_types/run.json", "mlflow_run_id"],
    ),
    "eval-run-json-step": (
        lambda w: [
            "eval",
            str(w / "runjson_step"),
            "--tasks",
            "none",
            "--no-latency",
            "--no-ppl",
            f"logging.tracking_uri=sqlite:///{w / 'rj.db'}",
        ],
        2,
        ["runjson_step/run.json", "'step'", "abc"],
    ),
    # tlf compare
    "compare-missing-store": (
        lambda w: ["compare", "--tracking-uri", f"sqlite:///{w / 'nostore' / 'm.db'}", "--out", str(w / "cmp")],
        2,
        ["no MLflow store", "nostore"],
    ),
    "compare-empty-store": (
        lambda w: ["compare", "--tracking-uri", f"sqlite:///{w / 'emptystore' / 'm.db'}", "--out", str(w / "cmp")],
        2,
        ["emptystore", "tlf"],
    ),
    # tlf plan / compare / eval / ablate / sweep (a `plan-*` case must fail before planning starts)
    "plan-json-under-a-file": (
        lambda w: plan("--json", str(w / "good.jsonl" / "sub" / "plan.json")),
        1,
        ["--json", "good.jsonl/sub/plan.json", "Not a directory", "good.jsonl is a file"],
    ),
    "plan-json-onto-a-directory": (lambda w: plan("--json", str(w / "good")), 1, ["--json", "/good", "Is a directory"]),
    "plan-sweep-micro-batch-0": (lambda w: plan("--sweep", "mb=0"), 2, ["--sweep", "mb=0", ">= 1"]),
    "plan-sweep-micro-batch-negative": (lambda w: plan("--sweep", "mb=2,-1"), 2, ["--sweep", "mb=-1"]),
    "compare-metrics-line-not-an-object": (lambda w: compare(w, "m_list"), 1, ["m_list/metrics.jsonl:2", "list"]),
    "compare-metrics-line-not-json": (lambda w: compare(w, "m_notjson"), 1, ["m_notjson/metrics.jsonl:2", "JSON"]),
    "compare-metric-not-a-number": (
        lambda w: compare(w, "m_abc"),
        1,
        ["m_abc/metrics.jsonl:2", "'loss'", "'abc'", "number"],
    ),
    "compare-step-not-an-integer": (lambda w: compare(w, "m_step"), 1, ["m_step/metrics.jsonl:2", "'step'", "two"]),
    "compare-tracking-json-garbage": (lambda w: compare(w, "m_tracking"), 1, ["m_tracking/tracking.json", "JSON"]),
    "compare-out-under-a-file": (
        lambda w: ["compare", "--run-dir", str(w / "m_cut"), "--out", str(w / "good.jsonl" / "sub")],
        1,
        ["--out", "good.jsonl/sub", "Not a directory"],
    ),
    "eval-loops-empty": (lambda w: ["eval", str(w / "model"), "--loops", "", "--no-ppl", *EVAL], 2, ["--loops", "''"]),
    "eval-loops-blank": (
        lambda w: ["eval", str(w / "model"), "--loops", " ", "--no-ppl", *EVAL],
        2,
        ["--loops", "' '"],
    ),
    "eval-out-dir-override-under-a-file": (
        lambda w: ["eval", str(w / "model"), f"eval.out_dir={w / 'good.jsonl' / 'o'}", "--no-ppl", *EVAL],
        1,
        ["eval.out_dir=", "good.jsonl/o", "Not a directory"],
    ),
    "ablate-out-under-a-file": (
        lambda w: ["ablate", str(w / "model"), "--out", str(w / "good.jsonl" / "o")],
        1,
        ["--out", "good.jsonl/o", "Not a directory"],
    ),
    "sweep-out-under-a-file": (
        lambda w: ["sweep", "tiny", "--variants", "base", "--out", str(w / "good.jsonl" / "o")],
        1,
        ["--out", "good.jsonl/o", "Not a directory"],
    ),
}


# ------------------------------------------------------------------ faults: set up, then check nothing was lost
def _enospc_open(match: str):
    """An `open` for data_prep.files (atomic_write_bytes) whose writes to a file named like `match` fill the disk half way through."""
    import builtins
    import errno

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, b):
            self.fh.write(bytes(b)[: len(b) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")  # as a real write: no file name

        def __getattr__(self, k):
            return getattr(self.fh, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.fh.close()

    return lambda f, *a, **k: Full(builtins.open(f, *a, **k)) if match in str(f) else builtins.open(f, *a, **k)


def prep_full_disk(w, monkeypatch):
    import data_prep.files

    monkeypatch.setattr(data_prep.files, "open", _enospc_open("_train_000002"), raising=False)

    def after(w):  # the last whole shard is kept and the rerun ends byte-identical to an uninterrupted run
        monkeypatch.undo()
        out = w / "out_full"
        assert sorted(p.name for p in out.glob("*.bin")) == ["data_train_000000.bin", "data_train_000001.bin"]
        assert not json.loads((out / "manifest.json").read_text())["complete"]
        cli = _cli(monkeypatch)
        for argv in (PREP_FULL(w), PREP_FULL(w, "out_clean")):
            r = CliRunner().invoke(cli, argv)
            assert r.exit_code == 0, r.output
        files = sorted(p.name for p in (w / "out_clean").iterdir() if p.name != ".lock")
        assert files == sorted(p.name for p in out.iterdir() if p.name != ".lock")
        assert all((out / f).read_bytes() == (w / "out_clean" / f).read_bytes() for f in files)

    return after


def prep_locked(w, monkeypatch):
    import fcntl

    (w / "out_lock").mkdir()
    held = open(w / "out_lock" / ".lock", "w")
    held.write("pid 4242 on testhost")
    held.flush()
    fcntl.flock(held, fcntl.LOCK_EX)
    return lambda w: held.close()


def save_full_disk(w, monkeypatch):
    from pipeline.train import checkpoint

    real = checkpoint._Hashing.write

    def full(self, b):  # DeepSpeed's files are written through the hashing writer; the disk fills in step 2's save
        if "global_step2" in self.fh.name:
            raise OSError(28, "No space left on device")
        return real(self, b)

    monkeypatch.setattr(checkpoint._Hashing, "write", full)

    def after(w):
        from pipeline.model.io import load_model

        ck = w / "ck" / "good"
        assert sorted(p.name for p in ck.iterdir()) == ["global_step1", "latest", "metrics.jsonl", "tracking.json"]
        assert (ck / "latest").read_text() == "global_step1"
        load_model(ck)

    return after


def ds_save_full_disk(w, monkeypatch):
    """DeepSpeed's own save of step 2's model states goes to /dev/full, a device whose every write fails with
    ENOSPC: torch's real zip writer reports it as it does on a full disk ("unexpected pos ...")."""

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    from pipeline.train import checkpoint

    real = checkpoint._Hashing.__init__

    def full(self, fh):
        if "global_step2" in fh.name and "mp_rank_00_model_states" in fh.name:
            fh.write(b"\0" * 100)  # what the disk took before it filled
            fh = open("/dev/full", "wb")  # torch's zip writer writes into it and fails
        real(self, fh)

    monkeypatch.setattr(checkpoint._Hashing, "__init__", full)

    def after(w):
        ck = w / "ck" / "dsfull"
        assert sorted(p.name for p in ck.iterdir()) == [
            "global_step1",
            "latest",
            "metrics.jsonl",
            "tracking.json",
        ]  # no .tmp-global_step2 left

    return after


def resume_other_data(w, monkeypatch):
    """A run of 2 steps on `good` checkpoints into ck/mismatch; the case resumes it on a directory of other size."""
    (w / "other").mkdir()
    write_shard(w / "other" / "t_train_000000.bin", np.arange(30 * 32 + 1) % 512)
    r = CliRunner().invoke(
        _cli(monkeypatch), train(w, "good", "checkpoint.interval=1", f"checkpoint.dir={w / 'ck' / 'mismatch'}")
    )
    assert r.exit_code == 0, r.output
    return None


def resume_on_three_ranks(w, monkeypatch):
    """A 1-rank run of global batch 4 = 2 x 2 checkpoints into ck/resize; the case resumes it as rank 0 of 3 (the
    launcher's WORLD_SIZE) with the command line of 4 ranks (grad-accum 1): 4 is not a multiple of micro-batch 2
    x 3 ranks, so grad-accum cannot adapt (the README's row, word for word)."""
    r = CliRunner().invoke(
        _cli(monkeypatch),
        train(
            w,
            "good",
            *RESIZE,
            "train.grad_accum_steps=2",
            "schedule.max_steps=1",
            f"checkpoint.dir={w / 'ck' / 'resize'}",
        ),
    )
    assert r.exit_code == 0, r.output
    monkeypatch.setenv("WORLD_SIZE", "3")
    return None


def resume_over_bad_metrics(w, monkeypatch):
    """A run of 2 steps checkpoints into ck/badmetrics; then the first line of its metrics.jsonl is broken."""
    r = CliRunner().invoke(
        _cli(monkeypatch), train(w, "good", "checkpoint.interval=1", f"checkpoint.dir={w / 'ck' / 'badmetrics'}")
    )
    assert r.exit_code == 0, r.output
    f = w / "ck" / "badmetrics" / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": \n' + f.read_text().split("\n", 1)[1])
    return None


RESIZE = ["train.global_batch_size=4", "checkpoint.interval=1"]


def PREP_FULL(w, out="out_full"):
    return [
        "prep-data",
        "--source",
        "files",
        "-i",
        str(w / "good.jsonl"),
        "--out",
        str(w / out),
        "--no-progress",
        "-j",
        "0",
        "--shard-tokens",
        "100",
        "--val-every",
        "-1",
    ]


FAULTS = {
    "prep-full-disk": (PREP_FULL, 1, ["data_train_000002.bin", "No space left", "rerun"], prep_full_disk),
    "prep-two-writers": (
        lambda w: prep(w, "good.jsonl", "--out", str(w / "out_lock")),
        1,
        ["out_lock", "another prep-data", "pid 4242 on testhost", ".lock"],
        prep_locked,
    ),
    "train-full-disk-in-save": (
        lambda w: train(w, "good", "checkpoint.interval=1"),
        1,
        ["global_step2 failed", "No space left", "global_step1 is intact"],
        save_full_disk,
    ),
    "train-resume-on-other-data": (
        lambda w: train(w, "other", f"checkpoint.dir={w / 'ck' / 'mismatch'}", "schedule.max_steps=3"),
        1,
        ["data.dir=", "/other", "windows"],
        resume_other_data,
    ),
    "train-resumed-on-a-world-size-that-does-not-divide-the-global-batch": (
        lambda w: train(w, "good", *RESIZE, "train.grad_accum_steps=1", f"checkpoint.dir={w / 'ck' / 'resize'}"),
        2,
        [
            "config error: train.global_batch_size=4 but train.micro_batch_size=2 x train.grad_accum_steps=1 x "
            "world_size=3 = 6"
        ],
        resume_on_three_ranks,
    ),
    "train-resume-over-a-malformed-metrics-line": (
        lambda w: train(w, "good", f"checkpoint.dir={w / 'ck' / 'badmetrics'}", "schedule.max_steps=3"),
        1,
        ["badmetrics/metrics.jsonl:1", "not a JSON line"],
        resume_over_bad_metrics,
    ),
    "train-full-disk-in-deepspeed-save": (
        lambda w: train(w, "good", "checkpoint.interval=1", f"checkpoint.dir={w / 'ck' / 'dsfull'}"),
        1,
        [
            "global_step2 failed",
            "unexpected pos",
            "(disk full? ",
            " MiB free on ",
            "/dsfull)",
            "global_step1 is intact",
        ],
        ds_save_full_disk,
    ),
}
CASES.update({k: v[:3] for k, v in FAULTS.items()})


def _cli(monkeypatch):
    from pipeline.cli import main
    from pipeline.train import cli as train_cli

    monkeypatch.setattr(train_cli, "_exit", lambda code: sys.exit(code))
    return main


@pytest.fixture
def cli(monkeypatch):
    """pipeline.cli.main, with `tlf train`'s os._exit turned into sys.exit so it can run in process."""
    return _cli(monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named(case, w, cli, monkeypatch):
    monkeypatch.chdir(w)
    build, code, names = CASES[case]
    after = FAULTS[case][3](w, monkeypatch) if case in FAULTS else None
    r = CliRunner().invoke(cli, build(w), catch_exceptions=True)
    out = r.output
    assert "Traceback" not in out and r.exception is None or isinstance(r.exception, SystemExit), (out, r.exception)
    assert r.exit_code == code, (r.exit_code, out)
    msg = [ln for ln in out.splitlines() if ln.lower().startswith(("error", "usage"))]
    line = next((ln for ln in out.splitlines() if all(n in ln for n in names)), None)
    assert line is not None and msg, out  # one line names the place
    if case.startswith("plan-"):  # refused before the minutes of tracing: the plan never started
        assert "[tlf] planning" not in out, out
    if after is not None:
        after(w)


def test_compare_skips_a_cut_last_line_with_one_warning(w, cli):
    """What a kill leaves at the end of metrics.jsonl (a line without its newline) is skipped with one warning naming
    the file and line; the whole lines before it are read."""
    r = CliRunner().invoke(cli, compare(w, "m_cut"))
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    warn = [ln for ln in r.output.splitlines() if ln.startswith("Warning:")]
    assert len(warn) == 1 and "m_cut/metrics.jsonl:3: incomplete last line" in warn[0], r.output
    rows = (w / "cmp_m_cut" / "table3.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[4] == "3.0", rows  # the training loss of step 2, the last whole one


def test_empty_prompt_is_not_an_error_it_starts_from_endoftext(w, cli):
    """The README's table: an empty prompt samples unconditionally (from <|endoftext|>), exit 0."""
    r = CliRunner().invoke(cli, ["generate", str(w / "model"), "-p", "", "-n", "3", "--seed", "0", "--show-depth"])
    assert r.exit_code == 0, r.output
    assert "mean depth" in r.output and "Traceback" not in r.output
