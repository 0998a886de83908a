"""Loss spikes and gradient statistics for long runs (pipeline/train/spikes.py, gradstats.py, ds.discard_update):
a spike is injected as an event (the objective's loss scaled at chosen steps, `inject`), then through the real
trainer: warn logs train/spike and trains as off does; skip leaves weights, AdamW state and LR schedule as they were
and the next steps equal a run that never saw the batch (ZeRO 0-3, with grad-accum, and on 2 gloo ranks); the skip
limit stops `tlf train` with one line; a run killed after a skip resumes bit for bit; grad_norm/<group> and
update_ratio appear at log steps only and equal a direct computation."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_train import PY, REPO, TINY, clean_env, make_shards, one_thread, tiny_cfg  # noqa: F401 (autouse)

# The injected spike: the objective's loss (and so its gradients) x SPIKE_FACTOR at the steps of SPIKE_AT, in this
# process (`inject`) or prepended to a child's script.
INJECT = """
import os
from pipeline.train.objective import Objective
from pipeline.train.trainer import Trainer
_now = [0]
_step, _fwd = Trainer.train_step, Objective.forward
def _train_step(self):
    _now[0] = self.step + 1
    return _step(self)
def _forward(self, *a, **k):
    out = _fwd(self, *a, **k)
    at = {int(s) for s in os.environ.get("SPIKE_AT", "").split(",") if s}
    if _now[0] in at and not k.get("full_only"):  # (validation passes full_only)
        out.loss = out.loss * float(os.environ.get("SPIKE_FACTOR", "30"))
    return out
Trainer.train_step, Objective.forward = _train_step, _forward
"""
# judged from step 6 on (5 losses in the window) at the default 6 sigmas: a 30x loss is thousands of sigmas out,
# the natural steps of these runs below 1
SPIKES = ["train.spike_window=5", "train.eval_interval=0"]


def inject(monkeypatch, steps) -> None:
    monkeypatch.setenv("SPIKE_AT", ",".join(map(str, steps)))
    exec(compile(INJECT, "inject", "exec"), {})  # patches the classes (`unpatched` restores them)


@pytest.fixture(autouse=True)
def unpatched(monkeypatch):
    """Every test ends with the classes `inject` patches as they were."""
    from pipeline.train.objective import Objective
    from pipeline.train.trainer import Trainer

    monkeypatch.setattr(Trainer, "train_step", Trainer.train_step)
    monkeypatch.setattr(Objective, "forward", Objective.forward)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


def metrics(root: Path) -> dict[int, dict]:
    from pipeline.tracking import read_metrics

    return {int(r["step"]): r for r in read_metrics(root / "metrics.jsonl")}


# ------------------------------------------------------------------------------------------- the window
def test_window_judges_once_it_holds_enough_losses():
    from pipeline.train.spikes import MIN_JUDGED, Spikes, window_stats

    assert window_stats([1.0, 2.0, 3.0]) == (2.0, 1.0)  # the sample standard deviation

    class T:
        class cfg:
            class train:
                spike_window, spike_sigma = 100, 6.0

    s = Spikes()
    s.trainer = T
    s.losses = [2.0, 2.1] * (MIN_JUDGED // 2 - 1)
    assert not s.ready()
    s.losses += [2.0, 2.1]
    mean, std = window_stats(s.losses)
    assert s.ready() and s.is_spike(mean + 6.01 * std) and not s.is_spike(mean + 5.99 * std)
    T.cfg.train.spike_window = 5
    s.losses = [2.0] * 4 + [2.1]
    assert s.ready()  # min(20, spike_window)
    assert s.state_dict() == {"losses": s.losses, "in_a_row": 0, "skipped": 0}


def test_policy_off_although_yaml_reads_off_as_false(tmp_path):
    from pipeline.config import ConfigError, load_config

    assert load_config("tiny/t-loopformer", ["train.spike_policy=off"]).train.spike_policy == "off"
    (tmp_path / "run.yaml").write_text("inherit: tiny/t-loopformer\ntrain:\n  spike_policy: off\n")
    assert load_config(str(tmp_path / "run.yaml")).train.spike_policy == "off"
    with pytest.raises(ConfigError, match="'train.spike_policy' expects one of 'off', 'warn', 'skip', got True"):
        load_config("tiny/t-loopformer", ["train.spike_policy=yes"])


# ------------------------------------------------------------------------------------------- warn and skip
def test_warn_logs_the_spike_and_trains_as_off(tmp_path, data, monkeypatch, capfd):
    from pipeline.train.trainer import run

    inject(monkeypatch, [8])
    off = run(tiny_cfg(tmp_path / "off", data, *SPIKES, "train.spike_policy=off", "schedule.max_steps=10"))
    warn = run(tiny_cfg(tmp_path / "warn", data, *SPIKES, "train.spike_policy=warn", "schedule.max_steps=10"))
    assert warn.losses == off.losses and warn.losses[7] > 10 * warn.losses[6]  # the same training, spike included
    assert warn.spikes == [8] and off.spikes == [] and warn.skipped_updates == 0
    m = metrics(tmp_path / "warn")
    assert {s: r["train/spike"] for s, r in m.items()} == {s: float(s == 8) for s in range(1, 11)}
    assert all("train/spike" not in r and "train/skipped_updates" not in r for r in metrics(tmp_path / "off").values())
    assert "train/skipped_updates" not in m[8]
    err = capfd.readouterr().err
    assert err.count("loss spike") == 1
    assert "warning: loss spike at step 8: loss " in err and "training goes on (train.spike_policy=warn)" in err


class Snapshot:
    """Weights, AdamW state, LR-schedule position and DeepSpeed's counters at the end of each step."""

    def __init__(self):
        self.at = {}

    def end_step(self, step):
        e = self.trainer.engine
        self.at[step] = {
            "weights": {k: v.clone() for k, v in self.trainer.model.state_dict().items()},
            "adam": copy.deepcopy(e.optimizer.state_dict()["state"]),
            "last_epoch": e.lr_scheduler.last_epoch,
            "global_steps": e.global_steps,
            "skipped_steps": e.skipped_steps,
        }


def test_skip_leaves_weights_adam_and_schedule_as_they_were(tmp_path, data, monkeypatch, capfd):
    from pipeline.train.callbacks import Callback, default_callbacks
    from pipeline.train.trainer import Trainer

    snap = type("Snap", (Snapshot, Callback), {})()
    inject(monkeypatch, [7])
    cfg = tiny_cfg(
        tmp_path, data, *SPIKES, "train.spike_policy=skip", "schedule.max_steps=9", "schedule.warmup_steps=8"
    )
    res = Trainer.build(cfg, default_callbacks() + [snap]).fit()
    a, b = snap.at[6], snap.at[7]
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert a["adam"].keys() == b["adam"].keys() and all(
        torch.equal(x, b["adam"][p][k]) for p, st in a["adam"].items() for k, x in st.items()
    )
    assert (a["last_epoch"], b["last_epoch"], snap.at[8]["last_epoch"]) == (6, 6, 7)  # step 7's update: not taken
    assert (b["global_steps"], b["skipped_steps"], snap.at[9]["skipped_steps"]) == (7, 1, 1)
    assert not torch.equal(snap.at[8]["weights"]["wte.weight"], b["weights"]["wte.weight"])  # step 8 trains on
    assert res.spikes == [7] and res.skipped_updates == 1 and res.step == 9 and len(res.losses) == 9
    m = metrics(tmp_path)
    assert [m[s]["train/skipped_updates"] for s in range(1, 10)] == [0.0] * 6 + [1.0] * 3
    assert [m[s]["train/spike"] for s in range(1, 10)] == [float(s == 7) for s in range(1, 10)]
    lr = lambda s: 1e-2 * min(s + 1, 8) / 8  # warm-up over 8 updates: update k (0-based) at lr * (k + 1) / 8
    assert [m[s]["lr"] for s in (6, 7, 8, 9)] == pytest.approx([lr(5), lr(6), lr(6), lr(7)])  # 7 discarded
    assert "update skipped (train.spike_policy=skip, 1 in a row, 1 in all)" in capfd.readouterr().err


class Rewind:
    """Run A of the pair below: the loader goes back after step `k`, so step k + 1 reads what step k read."""

    def __init__(self, k):
        self.k = k

    def pre_step(self, step):
        if step == self.k:
            self.pos = copy.deepcopy(self.trainer.loader.state_dict())

    def end_step(self, step):
        if step == self.k:
            self.trainer.loader.load_state_dict(self.pos)


def skip_pair(
    tmp: Path, data: Path, stage: int, accum: int, *extra: str, ws: int = 1, micro: int = 2
) -> tuple[list, list]:
    """(A, B): A's step 5 is a spike and skipped, its later steps re-read B's from step 5 on (`Rewind`); B never sees
    the spike. tiny/base-loop: no shortcut schedule keyed on the step number, no objective state."""
    from pipeline.train.callbacks import Callback, default_callbacks
    from pipeline.train.trainer import Trainer

    over = [
        *SPIKES,
        "train.spike_window=4",
        "train.spike_policy=skip",
        f"train.zero_stage={stage}",
        f"train.grad_accum_steps={accum}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={micro * accum * ws}",
        "schedule.max_steps=8",
        "checkpoint.interval=0",
        *extra,
    ]
    os.environ["SPIKE_AT"] = "5"
    rewind = type("R", (Rewind, Callback), {})(5)
    ra = Trainer.build(tiny_cfg(tmp / "a", data, *over, preset="tiny/base-loop"), default_callbacks() + [rewind]).fit()
    os.environ["SPIKE_AT"] = ""
    rb = Trainer.build(tiny_cfg(tmp / "b", data, *over, preset="tiny/base-loop")).fit()
    assert ra.spikes == [5] and rb.spikes == [], (ra.spikes, rb.spikes)
    return ra.losses, rb.losses


# DeepSpeed's template of ZeRO 1 with bf16 weights and fp32 gradient accumulation: its BF16_Optimizer
ACC32 = {"bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}}


@pytest.mark.parametrize(
    "stage,accum,precision",
    [(0, 1, "fp32"), (0, 2, "fp32"), (1, 2, "fp32"), (2, 1, "fp32"), (2, 2, "fp32"), (3, 2, "fp32")]
    + [(0, 2, "bf16"), (1, 2, "bf16"), (1, 2, "bf16-acc32"), (3, 1, "bf16")],
)
def test_a_skipped_update_leaves_no_trace_but_the_data_position(tmp_path, data, monkeypatch, stage, accum, precision):
    """Each of DeepSpeed's optimizers (`ds.discard_kind`): AdamW itself (ZeRO 0, fp32), FP16_UnfusedOptimizer (ZeRO 0,
    bf16), the ZeRO 1/2 and ZeRO 3 optimizers, BF16_Optimizer; with grad-accum: no gradient of the spike is left
    for the next step, no AdamW or LR step is taken."""
    extra = [f"train.precision={precision[:4]}"]
    if precision == "bf16-acc32":
        (tmp_path / "ds.json").write_text(json.dumps(ACC32))
        extra.append(f"train.ds_config={tmp_path / 'ds.json'}")
    inject(monkeypatch, [5])
    a, b = skip_pair(tmp_path, data, stage, accum, *extra)
    assert a[:4] == b[:4] and a[5:] == b[4:7]  # bit for bit: A's steps 6-8 are B's 5-7


# ------------------------------------------------------------------------------------------- stops and resumes
def test_skip_limit_stops_tlf_train_with_one_line(tmp_path, data):
    script = INJECT + "\nimport sys\nfrom pipeline.cli import entry\nsys.argv[0] = 'tlf'\nentry()\n"
    over = [*TINY, *SPIKES, f"data.dir={data}", f"checkpoint.dir={tmp_path}", "train.spike_policy=skip"]
    p = subprocess.run(
        [PY, "-c", script, "train", "tiny/t-loopformer", *over, "train.spike_skip_limit=2", "schedule.max_steps=10"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=clean_env(SPIKE_AT="6,7"),
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith("Error: loss spike at step 7: loss "), p.stderr[-3000:]
    assert errors[0].endswith(
        f"2 updates skipped in a row (train.spike_skip_limit=2); stopping. Last good checkpoint: {tmp_path}/global_step4"
    )
    assert "update skipped (train.spike_policy=skip, 1 in a row, 1 in all)" in p.stderr  # step 6's line
    assert sorted(x.name for x in tmp_path.glob("global_step*")) == ["global_step4"]  # nothing saved after


def child(args: list[str], **env) -> dict:
    """bench.faults.CHILD (run() in a child that SIGKILLs itself at KILL_AFTER_SAVE; prints the losses) with the
    spikes of SPIKE_AT injected: exit status, its JSON line, stderr. (bench is importable here, not in the ranks of
    the shared 2-rank run, which import this file.)"""
    from bench.faults import CHILD

    p = subprocess.run(
        [PY, "-c", INJECT + CHILD, *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=clean_env(**env)
    )
    out = json.loads(p.stdout.splitlines()[-1]) if p.returncode == 0 else None
    return {"code": p.returncode, "out": out, "err": p.stderr}


def test_a_run_killed_after_a_skip_resumes_bit_for_bit(tmp_path, data, monkeypatch):
    common = [
        *TINY,
        *SPIKES,
        f"data.dir={data}",
        "train.spike_policy=skip",
        "train.spike_skip_limit=2",
        "train.deterministic=true",
        "checkpoint.interval=2",
        "schedule.max_steps=12",
    ]
    from helpers import run_here  # (bench, which helpers imports, is not importable in the shared run's ranks)
    from pipeline.train.spikes import SpikeError

    # the killed runs are children (bench.faults.CHILD); the others call its entry, run(), in this process
    inject(monkeypatch, [6, 10])
    one = run_here([*common, f"checkpoint.dir={tmp_path / 'one'}"])
    # killed right after the save of step 6, the step of a skip: the window, the counters and the skipped update
    # are in that checkpoint
    killed = child([*common, f"checkpoint.dir={tmp_path / 'two'}"], SPIKE_AT="6,10", KILL_AFTER_SAVE="6")
    assert killed["code"] == -9
    again = run_here([*common, f"checkpoint.dir={tmp_path / 'two'}"])  # the resume, in this process too
    assert again["start"] == 6
    assert again["losses"] == one["losses"][6:]  # bit for bit
    m1, m2 = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m1[s]["train/skipped_updates"] for s in (5, 6, 9, 10, 12)] == [0.0, 1.0, 1.0, 2.0, 2.0]
    assert all(m1[s]["train/skipped_updates"] == m2[s]["train/skipped_updates"] for s in range(1, 13))
    # the count of skips in a row is saved too: killed after the first of two in a row, the resume stops at the
    # second (had it restarted the count at 0, it would train on)
    three = [*common, f"checkpoint.dir={tmp_path / 'three'}"]
    assert child(three, SPIKE_AT="6,7", KILL_AFTER_SAVE="6")["code"] == -9
    monkeypatch.setenv("SPIKE_AT", "6,7")  # (read at each step by the injection above)
    with pytest.raises(SpikeError, match=r"2 updates skipped in a row \(train.spike_skip_limit=2\)"):
        run_here(three)


# ------------------------------------------------------------------------------------------- gradient statistics
class Direct:
    """At the log steps, each group's gradient norm and update ratio from p.grad and the weights (ZeRO 0)."""

    def __init__(self, direct: bool):
        self.direct, self.got, self.logged = direct, {}, {}

    def pre_update(self, step, meter):
        if self.direct and self.trainer.is_log_step(step):
            named = list(self.trainer.model.named_parameters())
            self.w = {n: p.detach().double().clone() for n, p in named}
            self.g = {n: p.grad.double().clone() if p.grad is not None else torch.zeros(1) for n, p in named}
        return True

    def post_update(self, step, meter):
        from pipeline.train.gradstats import group_of

        if not self.direct or not self.trainer.is_log_step(step):
            return
        sums = {}
        for n, p in self.trainer.model.named_parameters():
            s = sums.setdefault(group_of(n), [0.0, 0.0, 0.0])
            s[0] += float(self.g[n].square().sum())
            s[1] += float(self.w[n].square().sum())
            s[2] += float((p.detach().double() - self.w[n]).square().sum())
        self.got[step] = {f"grad_norm/{k}": math.sqrt(v[0]) for k, v in sums.items()}
        self.got[step].update({f"update_ratio/{k}": math.sqrt(v[2] / v[1]) for k, v in sums.items()})
        total = [sum(v[i] for v in sums.values()) for i in range(3)]
        self.got[step]["update_ratio"] = math.sqrt(total[2] / total[1])

    def log_metrics(self, step, m):
        self.logged[step] = {k: v for k, v in m.items() if k.startswith(("grad_norm", "update_ratio"))}


def grad_stats_run(tmp: Path, data: Path, *extra: str, direct: bool = True) -> tuple:
    """(logged, direct): per step, the grad_norm* and update_ratio* metrics logged, and at the log steps their
    direct computation from p.grad and the weights (ZeRO 0; direct=False: none)."""
    from pipeline.train.callbacks import Callback, default_callbacks
    from pipeline.train.trainer import Trainer

    direct = type("D", (Direct, Callback), {})(direct)
    over = ["schedule.max_steps=9", "train.log_interval=4", "train.eval_interval=0", "checkpoint.interval=0"]
    cfg = tiny_cfg(tmp, data, *over, *extra)
    Trainer.build(cfg, default_callbacks() + [direct]).fit()
    return direct.logged, direct.got


def test_grad_stats_at_log_steps_equal_a_direct_computation(tmp_path, data):
    logged, direct = grad_stats_run(tmp_path / "z0", data, "train.zero_stage=0")
    groups = ["embeddings", "layers.0", "modulators", "layers.1", "router", "other"]
    keys = {"grad_norm", "update_ratio", *(f"grad_norm/{g}" for g in groups), *(f"update_ratio/{g}" for g in groups)}
    assert [s for s in logged if set(logged[s]) == keys] == [1, 4, 8, 9]  # the log steps: first, every 4th, last
    assert all(set(logged[s]) == {"grad_norm"} for s in (2, 3, 5, 6, 7))
    for s in (1, 4, 8, 9):
        for k, v in direct[s].items():
            assert logged[s][k] == pytest.approx(v, rel=1e-12, abs=1e-15), (s, k)
        total = math.sqrt(sum(logged[s][f"grad_norm/{g}"] ** 2 for g in groups))
        assert total == pytest.approx(logged[s]["grad_norm"], rel=1e-5)  # the groups make up the whole norm
        assert 0 < logged[s]["update_ratio"] < 1
    # the same run under ZeRO 1, 2 (fp32 master fragments, `_hp_mapping`) and 3 (partitions) logs the same values
    for stage in (1, 2, 3):
        other, _ = grad_stats_run(tmp_path / f"z{stage}", data, f"train.zero_stage={stage}", direct=False)
        for s in (1, 4, 8, 9):
            assert set(other[s]) == keys
            assert other[s] == pytest.approx(logged[s], rel=1e-4, abs=1e-9), (stage, s)


@pytest.mark.parametrize("stage,precision", [(0, "bf16"), (1, "bf16"), (1, "bf16-acc32"), (3, "bf16")])
def test_grad_stats_in_bf16_make_up_the_grad_norm(tmp_path, data, stage, precision):
    """bf16 weights: the gradients each optimizer holds (FP16_UnfusedOptimizer's bf16 ones, ZeRO's partitions,
    BF16_Optimizer's fp32 accumulation) make up the grad norm it reports, and the update ratio is of its fp32 ones."""
    extra = [f"train.zero_stage={stage}", "train.precision=bf16", "schedule.max_steps=4"]
    if precision == "bf16-acc32":
        (tmp_path / "ds.json").write_text(json.dumps(ACC32))
        extra.append(f"train.ds_config={tmp_path / 'ds.json'}")
    logged, _ = grad_stats_run(tmp_path / "run", data, *extra, direct=False)
    for s in (1, 4):
        groups = [v for k, v in logged[s].items() if k.startswith("grad_norm/")]
        assert math.sqrt(sum(v * v for v in groups)) == pytest.approx(logged[s]["grad_norm"], rel=1e-5)
        assert 0 < logged[s]["update_ratio"] < 1


def test_grad_stats_off_logs_none(tmp_path, data):
    logged, _ = grad_stats_run(tmp_path, data, "train.grad_stats=false", "schedule.max_steps=2")
    assert all(set(m) == {"grad_norm"} for m in logged.values())


# ------------------------------------------------------------------------------------------- 2 gloo ranks
def two_rank_part(tmp: str) -> dict:
    """On each rank of the shared 2-rank run: the skip pair under ZeRO 2 with grad-accum, and the gradient
    statistics of ZeRO 1 and 3 at the log steps (compared with a 1-rank ZeRO 0 run in the test)."""
    import torch.distributed as dist

    from pipeline.train.ds import init_distributed
    from pipeline.train.objective import Objective
    from pipeline.train.trainer import Trainer

    rank, _, _ = init_distributed("cpu")  # (the launcher's process group, made by the parts before)
    data = Path(tmp) / "spike_data"
    if rank == 0:
        make_shards(data, windows=10)
    dist.barrier()
    real = Trainer.train_step, Objective.forward
    exec(compile(INJECT, "inject", "exec"), {})
    try:
        out = {"pair": list(skip_pair(Path(tmp) / "spike_pair", data, 2, 2, ws=2, micro=1))}  # ZeRO 2, accum 2
    finally:
        Trainer.train_step, Objective.forward = real
    for stage in (1, 3):
        over = (f"train.zero_stage={stage}", *DIST2)
        logged, _ = grad_stats_run(Path(tmp) / f"gstats{stage}", data, *over, direct=False)
        out[f"z{stage}"] = {str(s): m for s, m in logged.items()}
    return out


DIST2 = ["train.micro_batch_size=1", "train.global_batch_size=2"]  # 2 ranks x 1 = the 1-rank run's batch of 2


@pytest.mark.slow
def test_two_gloo_ranks_skip_and_grad_stats(two_ranks, tmp_path):
    r0, r1 = two_ranks.part("spikes")
    a, b = r0["pair"]
    assert r1["pair"] == [a, b] and a[:4] == b[:4] and a[5:] == b[4:7]
    logged, _ = grad_stats_run(tmp_path, two_ranks.tmp / "spike_data", "train.zero_stage=0")
    for stage in ("z1", "z3"):
        assert r0[stage] == r1[stage]
        for s in ("1", "4", "8", "9"):
            assert r0[stage][s] == pytest.approx(logged[int(s)], rel=1e-4, abs=1e-9), (stage, s)
