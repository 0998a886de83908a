"""Side-by-side timing for the benchmarks: every case in a process of its own, timed steps interleaved.

A case's worker builds its model, sends "ready", then answers "step" with the seconds of one timed step and
"stats" with a dict, until "stop". `run_cases` starts the cases one at a time (warm-up included, so start-up
stays quiet), then runs `rounds` rounds in which every case does one step, so machine load hits all cases
alike, and returns each case's median step time (`time_s`) and every round's time in order (`times_s`: round n of
every case is the same step when the workers seed per step) with its stats.
"""

from __future__ import annotations

import multiprocessing as mp

from data_prep.files import write_json as _write_json


def run_cases(worker, specs: dict[str, dict], rounds: int) -> dict[str, dict]:
    ctx = mp.get_context("spawn")
    procs = {}
    for label, spec in specs.items():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(spec, child), daemon=True)
        p.start()
        child.close()  # so a crashed case raises EOFError here instead of hanging
        if parent.recv() != "ready":
            raise RuntimeError(f"case {label} failed to start")
        procs[label] = (p, parent)
    times = {label: [] for label in specs}
    for _ in range(rounds):
        for label, (_, conn) in procs.items():
            conn.send("step")
            times[label].append(conn.recv())
    results = {}
    for label, (p, conn) in procs.items():
        conn.send("stats")
        r = conn.recv()
        conn.send("stop")
        p.join()
        results[label] = {"time_s": sorted(times[label])[len(times[label]) // 2], "times_s": times[label], **r}
    return results


def write_json(path, out: dict) -> None:
    """Writes a benchmark's results (data_prep.files.write_json) and says where."""
    print(f"wrote {_write_json(path, out)}")
