"""prep-data throughput against raw tiktoken on the same text, in the same run.

Input: the demo corpus (State of the Union + Moby-Dick) and the enwiki sample, as one jsonl repeated
--repeat times. Measured, best of --trials (interleaved, so changing load hits all alike):
  raw_batch:  tiktoken `encode_ordinary_batch(texts)` on the texts already in memory (its default threads)
  raw_1core:  `encode_ordinary` in a loop on one core (the per-core reference)
  prep_wN:    `prepare()` end to end (read jsonl, parse, tokenize in N workers, write shards + manifest)
Rates are document tokens per second (EOTs not counted). Ratios: prep_wN / raw_batch, and per worker
prep_wN / (N * raw_1core) (N=0 means in-process: counted as 1). Also tokens per CPU-second of the
workers (vs raw tiktoken's on one core) and of the main process (what one reader can feed): these do not
depend on other load, and give the 64-core estimate. Writes JSON (default bench/results/prep_data.json).

    .venv/bin/python bench/prep_data.py --workers 1 2 --repeat 3 --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.interleave import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3, help="copies of the corpus in the input file")
    ap.add_argument("--trials", type=int, default=3, help="runs per measurement; the fastest counts")
    ap.add_argument("--batch-bytes", type=int, default=1 << 20, help="prep-data batch_bytes (text per worker task)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prep_data.json"))
    args = ap.parse_args()

    from data_prep.assets import ensure_assets
    from data_prep.config import load_prep_config
    from data_prep.prep import prepare
    from data_prep.tokenizer import get_encoding

    files = ensure_assets()
    enc = get_encoding()
    lines = [line for k in ("demo", "demo-enwiki") for line in open(files[k], encoding="utf-8")]
    texts = [json.loads(line)["text"] for line in lines] * args.repeat
    tmp = Path(tempfile.mkdtemp(prefix="tlf-bench-"))
    try:
        inp = tmp / "corpus.jsonl"
        inp.write_text("".join(lines) * args.repeat, encoding="utf-8")
        n_tokens = sum(len(t) for t in enc.encode_ordinary_batch(texts))
        res: dict = {
            "input": {
                "documents": len(texts),
                "tokens": n_tokens,
                "bytes": inp.stat().st_size,
                "repeat": args.repeat,
                "batch_bytes": args.batch_bytes,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "load_avg_1m": os.getloadavg()[0],
                "date": time.strftime("%Y-%m-%d %H:%M"),
            },
            "rates_tok_s": {},
            "seconds": {},
        }

        import resource

        def cpu_now(who) -> float:
            u = resource.getrusage(who)
            return u.ru_utime + u.ru_stime

        def prep_run(w: int) -> None:
            out = tmp / f"out{w}"
            shutil.rmtree(out, ignore_errors=True)
            m = prepare(
                load_prep_config(
                    values=dict(
                        source="files",
                        inputs=[str(inp)],
                        out=str(out),
                        workers=w,
                        progress=False,
                        batch_bytes=args.batch_bytes,
                    )
                ),
                log=lambda s: None,
            )
            assert m["documents"]["kept"] == len(texts)
            assert m["total_tokens"] == n_tokens + len(texts)

        # Trials are interleaved (raw, prep, raw, prep, ...) so that changing load on a shared machine hits
        # every measurement alike; the fastest trial of each counts, CPU times are averaged.
        runs = {
            "raw_batch": lambda: enc.encode_ordinary_batch(texts),
            "raw_1core": lambda: [enc.encode_ordinary(t) for t in texts],
        }
        runs.update({f"prep_w{w}": (lambda w=w: prep_run(w)) for w in args.workers})
        times: dict = {k: [] for k in runs}
        cpu: dict = {k: {"main_cpu_s": 0.0, "workers_cpu_s": 0.0} for k in runs}
        for _ in range(args.trials):
            for k, fn in runs.items():
                m0, c0, t0 = cpu_now(resource.RUSAGE_SELF), cpu_now(resource.RUSAGE_CHILDREN), time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
                cpu[k]["main_cpu_s"] += (cpu_now(resource.RUSAGE_SELF) - m0) / args.trials
                cpu[k]["workers_cpu_s"] += (cpu_now(resource.RUSAGE_CHILDREN) - c0) / args.trials
        res["seconds"] = {k: min(v) for k, v in times.items()}
        raw_cpu_s = cpu["raw_1core"]["main_cpu_s"]
        res["cpu_seconds_per_run"] = cpu
        for k, s in res["seconds"].items():
            res["rates_tok_s"][k] = n_tokens / s
        r = res["rates_tok_s"]
        res["ratios"] = {}
        for w in args.workers:
            res["ratios"][f"prep_w{w}/raw_batch"] = r[f"prep_w{w}"] / r["raw_batch"]
            res["ratios"][f"prep_w{w}/(w*raw_1core)"] = r[f"prep_w{w}"] / (max(w, 1) * r["raw_1core"])
        res["ratios"]["raw_batch/raw_1core"] = r["raw_batch"] / r["raw_1core"]
        # Per CPU-second rates do not depend on how busy the machine is: a worker's tokens per CPU-second
        # against raw tiktoken's, and the main process's (what one reader can feed).
        res["cpu_rates_tok_per_cpu_s"] = {"raw_1core": n_tokens / raw_cpu_s}
        for w in args.workers:
            if w > 0:
                res["cpu_rates_tok_per_cpu_s"][f"prep_w{w}_workers"] = n_tokens / cpu[f"prep_w{w}"]["workers_cpu_s"]
                res["cpu_rates_tok_per_cpu_s"][f"prep_w{w}_main"] = n_tokens / cpu[f"prep_w{w}"]["main_cpu_s"]
                res["ratios"][f"prep_w{w}_worker_cpu/raw_cpu"] = (
                    res["cpu_rates_tok_per_cpu_s"][f"prep_w{w}_workers"] / res["cpu_rates_tok_per_cpu_s"]["raw_1core"]
                )
        # 64 cores: 63 workers at the per-CPU-second worker rate of the widest run, capped by the main process.
        wmax = max(w for w in args.workers if w > 0)
        per_worker = res["cpu_rates_tok_per_cpu_s"][f"prep_w{wmax}_workers"]
        main_cap = res["cpu_rates_tok_per_cpu_s"][f"prep_w{wmax}_main"]
        res["estimate_64_cores"] = {
            "per_worker_tok_s": per_worker,
            "main_process_cap_tok_s": main_cap,
            "tok_s": min(63 * per_worker, main_cap),
            "hours_for_25B": 25e9 / min(63 * per_worker, main_cap) / 3600,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(args.out, res)
    print(
        f"input: {res['input']['documents']} documents, {n_tokens:,} tokens; cpus {os.cpu_count()}, "
        f"load {res['machine']['load_avg_1m']:.1f}"
    )
    for k, v in res["rates_tok_s"].items():
        print(f"  {k:>10}: {v / 1e6:6.2f} M tok/s  ({res['seconds'][k]:.2f} s)")
    for k, v in res["ratios"].items():
        print(f"  {k:>24}: {v:.2f}")
    for k, v in res["cpu_rates_tok_per_cpu_s"].items():
        print(f"  {k:>17}: {v / 1e6:6.2f} M tok per CPU-second")
    e = res["estimate_64_cores"]
    print(
        f"  64 cores (63 workers at {e['per_worker_tok_s'] / 1e6:.2f} M, main process cap "
        f"{e['main_process_cap_tok_s'] / 1e6:.0f} M): {e['tok_s'] / 1e6:.0f} M tok/s, "
        f"25B tokens in {e['hours_for_25B'] * 60:.0f} min"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
