"""The stages of `bench/gpu_check.sh` (read its header first): each a command of its own with its own time limit,
run one after the other; what each wrote (its JSON), its exit status, seconds and log tail go into one JSON with
the headline figures against the targets; a short table is printed last.

    python bench/gpu_check.py --out DIR [--dry-run] [--stages setup,tests,...]

Standard library only (it runs before anything else is known to import). --dry-run: the same stages on this
machine's CPU at tiny scale (a few minutes), to prove the script before device time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_DIR = REPO / ".gpu"  # bench/gpu_wheels.sh writes it; the device call carries it
STAGES = ("setup", "tests", "train_step", "plan_check", "step_profile", "decode")
# seconds per stage on the GPU: each is cut at its limit (the rest still run); the sum stays under the device
# tool's 600 s per command with room for start-up and the report. train_step and step_profile run five cases each
# (loopformer, t-loopformer under every strategy), each case's start-up (imports, paper-scale build, warm-up; the
# sorted strategy's first FlexAttention compile) the larger part of their time
BUDGET = {"setup": 35, "tests": 90, "train_step": 170, "plan_check": 110, "step_profile": 100, "decode": 50}
TOTAL = 560  # the whole script's deadline on the GPU (s): a stage never runs past it (--total)
TESTS = [
    "tests/test_model.py::test_gather_scatter_equals_dense_reference",
    "tests/test_inference.py::test_prefill_decode_equals_full_forward",
    "tests/test_determinism.py::test_deterministic_on_sets_the_contract",
    "tests/test_mfu.py",
]
STRATEGIES = ("compact", "sorted", "bucketed", "dense")  # model.execution's values (pipeline/config.py)
TARGETS = {
    "time_over_flops": 1.10,  # t-loopformer step time ratio / FLOPs ratio vs loopformer, at most
    "mfu_loopformer": 0.50,  # at least
    "mfu_t_loopformer": 0.45,  # at least
    "plan_within": 0.05,  # |measured / planned - 1|, at most
    "tpot_over_floor_b1": 1.5,  # TPOT at batch 1 / bandwidth floor, at most
}


DRY_NOTE = "CPU dry run: tiny scale, fp32, on this machine's CPU; its figures are not GPU figures"


def commands(dry: bool, work: Path, py: str, gpu: str) -> dict[str, list[str]]:
    """Each stage's command: paper scale, bf16 on the GPU; tiny scale, fp32 on the CPU in a dry run. train_step and
    step_profile run loopformer and t-loopformer under every execution strategy (`--strategies all`)."""
    scale, dev, mb = ("tiny", "cpu", "4") if dry else ("paper", "cuda", "6")
    vocab = "model.vocab_size=50304"
    variants = ["--variants", "loopformer,t-loopformer", "--strategies", ",".join(STRATEGIES)]
    demo = (GPU_DIR / "demo.jsonl") if (GPU_DIR / "demo.jsonl").is_file() else None
    prep = [py, "-m", "data_prep", "prep-data", "--source", "files"]
    prep += ["-i", str(demo or "DEMO"), "-o", str(work / "data"), "--val-every", "20", "-j", "0", "--no-progress"]
    prep += ["--max-tokens", "300000" if dry else "1000000"]
    decode = ["--d-model", "64", "--n-heads", "2", "--d-ff", "160", "--prompt-lens", "32,64", "--tpot-prompt", "32"]
    decode += ["--steps", "4", "--batches", "1,4", "--ttft-batches", "1,4", "--repeats", "2"]
    if not dry:
        decode = ["--device", "cuda", "--dtype", "bf16", "--d-model", "2048", "--n-heads", "32", "--d-ff", "5120"]
        decode += ["--prompt-lens", "128,512,2048", "--ttft-batches", "1,32", "--batches", "1,32", "--repeats", "3"]
    steps = ["--steps", "2", "--warmup", "1", "--threads", "1"] if dry else ["--steps", "5", "--warmup", "2", "--bf16"]
    return {
        "setup": prep,
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={work / 'tests.xml'}"]
        + ["-k", "cuda or test_mfu", *TESTS],
        "train_step": [py, "bench/train_step.py", "--scale", scale, "--device", dev, "--micro-batch", mb]
        + [*variants, "--no-ablations", "--set", vocab, *steps, "--json", str(work / "train_step.json")],
        "plan_check": [py, "bench/plan_check.py", "--data", str(work / "data"), "--gpu", gpu]
        + ["--cases", f"{scale}/t-loopformer,{scale}/t-loopformer:loop"]
        + ["--steps", "4" if dry else "8", "--timeout", "90" if dry else "52", "--json", str(work / "plan_check.json")],
        "step_profile": [py, "bench/step_profile.py", "--scale", scale, "--device", dev, "--micro-batch", mb]
        + [*variants, "--set", vocab, "--warmup", "1", "--timed", "1", "--steps", "1", "--shape-steps", "0"]
        + ["--json", str(work / "step_profile.json")],
        "decode": [py, "bench/decode.py", *decode, "--json", str(work / "decode.json")],
    }


def run_stage(name: str, cmd: list[str], limit: float, log: Path, env: dict) -> dict:
    """Runs one stage in its own process group (killed whole at its limit); its output goes to log."""
    t0 = time.time()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = "timeout"
    secs = time.time() - t0
    tail = log.read_text(errors="replace")[-2500:]
    print(f"[{name}] rc={rc} in {secs:.0f} s (limit {limit:.0f} s)", flush=True)
    return {"rc": rc, "seconds": round(secs, 1), "limit_s": round(limit), "log_tail": tail}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _junit(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"] += 1
            out["failures"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def summary(results: dict) -> dict:
    """The headline figures from the stages' JSON (None where a stage gave none)."""
    s: dict = {}
    ts = results.get("train_step") or {}
    if ts.get("results"):
        r, tg = ts["results"], ts.get("targets", {})
        s["time_over_flops"] = (tg.get("step time ratio / FLOPs ratio") or {}).get("value")
        s["mfu_loopformer"] = (r.get("loopformer") or {}).get("mfu")
        s["mfu_t_loopformer"] = (r.get("t-loopformer") or {}).get("mfu")
        s["tokens_per_s"] = {k: v.get("tokens_per_s") for k, v in r.items()}
        lf = r.get("loopformer") or {}
        s["loopformer"] = {
            "tokens_per_s": lf.get("tokens_per_s"),
            "mfu": lf.get("mfu"),
            "peak_gib": lf.get("alloc_peak_gb"),
        }
        s["strategies"] = {k: dict(v) for k, v in (ts.get("strategies") or {}).items()}
    pc = results.get("plan_check") or {}
    s["plan"] = {
        c["case"]: {k: c.get(k) for k in ("predicted_peak_gb", "measured_peak_gb_max", "peak_ratio_max", "mfu")}
        for c in pc.get("cases", [])
    }
    sp = results.get("step_profile") or {}
    s["profile"] = {
        v: {
            k: r.get(k)
            for k in (
                "wall_ms_per_step",
                "busy_ms_per_step",
                "kernels_per_step",
                "small_kernels_per_step",
                "syncs_per_step",
                "host_reads_per_step",
                "ms_per_step",
            )
        }
        for v, r in (sp.get("variants") or {}).items()
    }
    for k, st in s.get("strategies", {}).items():  # each strategy's profile beside its step figures
        st["profile"] = s["profile"].get(f"t-loopformer {k}")
    dec = results.get("decode") or {}
    for row in dec.get("rows", []):
        if row["metric"] == "TPOT":
            s[f"tpot_b{row['batch']}"] = {
                "ms": row["ms"],
                "over_floor": row.get("over_floor"),
                "bytes_ratio_c": row.get("bytes_ratio_c"),
                "tpot_ratio_c": row["tlf_over"]["loopformer"],
            }
    s["tests"] = results.get("tests")
    return s


def verdicts(s: dict) -> dict:
    """Each target: (value, target, met) where the value is there."""
    v = {}

    def put(key, value, target, ok):
        v[key] = {"value": value, "target": target, "met": None if value is None else bool(ok(value))}

    for key, at_least in (("time_over_flops", False), ("mfu_loopformer", True), ("mfu_t_loopformer", True)):
        t = TARGETS[key]
        put(key, s.get(key), t, (lambda x, t=t: x >= t) if at_least else (lambda x, t=t: x <= t))
    for name, st in s.get("strategies", {}).items():  # every strategy against the targets (the JSON compares)
        t, m = TARGETS["time_over_flops"], TARGETS["mfu_t_loopformer"]
        put(f"time_over_flops {name}", st.get("time_over_flops"), t, lambda x, t=t: x <= t)
        put(f"mfu {name}", st.get("mfu"), m, lambda x, m=m: x >= m)
    for case, c in s.get("plan", {}).items():
        r = c.get("peak_ratio_max")
        put(f"plan {case}", r, f"within {TARGETS['plan_within']:.0%}", lambda x: abs(x - 1) <= TARGETS["plan_within"])
    b1 = s.get("tpot_b1") or {}
    floor = TARGETS["tpot_over_floor_b1"]
    for var in ("tlf", "loopformer"):
        put(f"tpot_b1 {var} / floor", (b1.get("over_floor") or {}).get(var), floor, lambda x: x <= floor)
    if b1.get("bytes_ratio_c") is not None:
        put(
            "tpot_b1 tlf/loopformer <= bytes ratio",
            b1["tpot_ratio_c"],
            b1["bytes_ratio_c"],
            lambda x: x <= b1["bytes_ratio_c"],
        )
    return v


def environment(py: str, env: dict) -> dict:
    code = (
        "import json, sys, torch\n"
        "d = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
        "d['gpu'] = torch.cuda.get_device_name() if torch.cuda.is_available() else None\n"
        "from pipeline.hardware import this_gpu; g = this_gpu(); d['gpu_row'] = g.name if g else None\n"
        "try:\n import deepspeed; d['deepspeed'] = deepspeed.__version__\n"
        "except Exception as e:\n d['deepspeed'] = f'import failed: {e}'\n"
        "print(json.dumps(d))"
    )
    try:
        p = subprocess.run([py, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        info = json.loads(p.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        info = {"error": str(e)}
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    info.update(host=platform.node(), cpus=os.cpu_count(), commit=rev.stdout.strip() or None)
    return info


def show(s: dict, v: dict, stages: dict, dry: bool) -> None:
    print("\n== gpu_check summary ==" + (f"  ({DRY_NOTE})" if dry else ""))
    for name, st in stages.items():
        print(f"  stage {name:<13} rc={st['rc']!s:<8} {st['seconds']:6.0f} s")
    for key, x in v.items():
        val = x["value"]
        shown = "n/a" if val is None else (f"{val:.3f}" if isinstance(val, float) else str(val))
        tgt = f"{x['target']:.3g}" if isinstance(x["target"], float) else x["target"]
        print(f"  {key:<42} {shown:>8}  target {tgt}  {'' if x['met'] is None else ('met' if x['met'] else 'MISSED')}")
    for var, p in s.get("profile", {}).items():
        ms = ", ".join(f"{k} {val:.1f}" for k, val in sorted((p.get("ms_per_step") or {}).items()))
        print(
            f"  profile {var}: {p.get('wall_ms_per_step') or 0:.1f} ms/step, {p.get('kernels_per_step')} kernels, {ms}"
        )
    if s.get("strategies"):
        lf = s.get("loopformer") or {}
        print(f"  {'strategy':<11} {'tokens/s':>9} {'MFU %':>7} {'peak GiB':>9} {'time/FLOPs':>10}  (vs loopformer)")
        for name, st in [*s["strategies"].items(), ("loopformer", {**lf, "time_over_flops": 1.0})]:
            cells = [st.get(k) for k in ("tokens_per_s", "mfu", "peak_gib", "time_over_flops")]
            tok, mfu, peak, tf = ("n/a" if c is None else c for c in cells)
            print(
                f"  {name:<11} {tok if tok == 'n/a' else f'{tok:.0f}':>9} {mfu if mfu == 'n/a' else f'{100 * mfu:.2f}':>7}"
                f" {peak if peak == 'n/a' else f'{peak:.3f}':>9} {tf if tf == 'n/a' else f'{tf:.3f}':>10}"
            )
    t = s.get("tests") or {}
    print(
        f"  tests: {t.get('passed')} passed, {t.get('failed')} failed, {t.get('skipped')} skipped {t.get('failures') or ''}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder that gets gpu_check.json and gpu_check.log")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny scale: the same stages on this machine")
    ap.add_argument("--stages", default=",".join(STAGES), help="a subset, e.g. to rerun the ones that failed")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--total", type=float, help=f"deadline of the whole run, s (default {TOTAL}; dry run 4x)")
    ap.add_argument("--work", help="scratch folder (shards, stage JSON, logs); default a new one under /tmp")
    a = ap.parse_args(argv)
    start = time.time()
    total = a.total or TOTAL * (4 if a.dry_run else 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)  # only the report and the log go here ($OUT: few files come back)
    work = Path(a.work or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_BUILD_OPS="0")
    if a.dry_run:
        env["DS_ACCELERATOR"] = "cpu"
    info = environment(a.python, env)
    print(f"environment {json.dumps(info)}", flush=True)
    gpu = "cpu" if a.dry_run else info.get("gpu_row") or "h200"  # tlf plan's --gpu row for this device
    cmds = commands(a.dry_run, work, a.python, gpu)
    if "DEMO" in cmds["setup"]:  # a dry run without .gpu/: the demo corpus of this machine's asset cache
        code = "from data_prep.assets import ensure_assets; print(ensure_assets()['demo'])"
        p = subprocess.run([a.python, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        cmds["setup"][cmds["setup"].index("DEMO")] = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "DEMO"
    stages, results = {}, {}
    for name in [s for s in STAGES if s in a.stages.split(",")]:
        left = total - (time.time() - start)
        limit = min(BUDGET[name] * (4 if a.dry_run else 1), left - 5)
        if limit < 10:
            stages[name] = {"rc": "skipped", "seconds": 0, "limit_s": 0, "log_tail": "no time left"}
            continue
        stages[name] = run_stage(name, cmds[name], limit, work / f"{name}.log", env)
        results[name] = _junit(work / "tests.xml") if name == "tests" else _load(work / f"{name}.json")
    s = summary(results)
    v = verdicts(s)
    report = {
        "dry_run": a.dry_run,
        **({"note": DRY_NOTE} if a.dry_run else {}),
        "environment": info,
        "seconds": round(time.time() - start, 1),
        "stages": {k: {**st, "result": results.get(k)} for k, st in stages.items()},
        "summary": s,
        "targets": v,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    with open(out / "gpu_check.log", "w") as fh:
        for name in stages:
            log = work / f"{name}.log"
            fh.write(f"\n===== {name} =====\n" + (log.read_text(errors="replace") if log.exists() else "(no log)\n"))
    show(s, v, stages, a.dry_run)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.log'} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
