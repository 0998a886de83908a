"""What the train-time shard check (`data.verify`, data_prep.shards.ShardSet) costs, on the demo data, and what it
would cost on a 25B-token corpus.

The demo corpus goes through `prepare()` into a temp dir (small shards, so there are several), then, interleaved
over --trials (best of each counts, so load hits both alike):
  read:    one epoch of TrainLoader batches (T=--seq, mb=--mb, 1 rank), data.verify off
  verify:  the same epoch with data.verify on (every shard hashed at its first read)
  hash:    sha256 of every shard file alone (the check's whole work): its throughput in MB/s
The projection: a 25B-token corpus is 50 GB of uint16 shards; the check hashes each byte once per run, split over
the ranks (shard k on rank k % world), so its cost is 50 GB / (throughput x ranks) once per run (and again at each
restart), and the stall at one shard's first read is shard bytes / throughput (prep-data's default 100M-token
shards: 200 MB). Writes JSON (default bench/results/shard_verify.json).

    .venv/bin/python bench/shard_verify.py --trials 5
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.interleave import write_json


def _epoch(d: Path, verify: bool, seq: int, mb: int) -> float:
    from pipeline.train.data import TrainLoader

    t = time.perf_counter()
    loader = TrainLoader(str(d), "train", seq, mb, 0, 1, 0, 50304, verify)
    for _ in range(loader.micros_per_epoch):
        loader.next()
    return time.perf_counter() - t


def _hash_all(files: list[Path]) -> float:
    from data_prep.assets import sha256_file

    t = time.perf_counter()
    for f in files:
        sha256_file(f)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--shard-tokens", type=int, default=200_000)
    ap.add_argument("--tokens", type=float, default=25e9, help="corpus size to project for")
    ap.add_argument("--ranks", type=int, default=8, help="ranks to project for")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "shard_verify.json"))
    args = ap.parse_args()

    from data_prep.config import load_prep_config
    from data_prep.prep import prepare

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "demo"
        prepare(
            load_prep_config(
                values=dict(source="demo", out=str(d), shard_tokens=args.shard_tokens, workers=0, progress=False)
            ),
            log=lambda m: None,
        )
        files = sorted(d.glob("*_train_*.bin"))
        nbytes = sum(f.stat().st_size for f in files)
        best = {"read": float("inf"), "verify": float("inf"), "hash": float("inf")}
        for _ in range(args.trials):
            best["read"] = min(best["read"], _epoch(d, False, args.seq, args.mb))
            best["verify"] = min(best["verify"], _epoch(d, True, args.seq, args.mb))
            best["hash"] = min(best["hash"], _hash_all(files))
    mbps = nbytes / best["hash"] / 1e6
    big = args.tokens * 2
    out = {
        "machine": platform.processor() or platform.machine(),
        "shards": len(files),
        "train_bytes": nbytes,
        "trials": args.trials,
        "epoch_read_s": best["read"],
        "epoch_read_verify_s": best["verify"],
        "verify_over_read": best["verify"] / best["read"],
        "hash_s": best["hash"],
        "hash_MBps": mbps,
        "projection": {
            "tokens": args.tokens,
            "bytes": big,
            "ranks": args.ranks,
            "per_run_s_one_rank": big / (mbps * 1e6),
            "per_run_s_each_of_ranks": big / (mbps * 1e6) / args.ranks,
            "stall_per_100M_token_shard_s": 200e6 / (mbps * 1e6),
        },
    }
    print(
        f"demo train split: {len(files)} shards, {nbytes / 1e6:.1f} MB; one epoch read {best['read']:.3f} s, "
        f"with data.verify {best['verify']:.3f} s (x{out['verify_over_read']:.2f}); sha256 {mbps:.0f} MB/s"
    )
    p = out["projection"]
    print(
        f"{args.tokens / 1e9:.0f}B tokens ({big / 1e9:.0f} GB): {p['per_run_s_one_rank']:.0f} s of hashing per run "
        f"on one rank, {p['per_run_s_each_of_ranks']:.0f} s on each of {args.ranks}; "
        f"{p['stall_per_100M_token_shard_s']:.2f} s stall at the first read of a 100M-token shard"
    )
    write_json(args.out, out)


if __name__ == "__main__":
    main()
