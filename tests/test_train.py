"""Training in one process (world size 1, gloo): DeepSpeed config, schedule, loader, checkpoints, bit-exact resume,
signals, faults (NaN, full disk, killed save), MLflow. The 2-rank launcher tests are in test_train_dist.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DS_BUILD_OPS", "0")
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "torch_extensions")
)

import numpy as np
import pytest
import torch

from data_prep.shards import write_shard
from pipeline.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


RUN_FILES = {"metrics.jsonl", "tracking.json"}  # the run's metrics spool and MLflow pointer, beside the checkpoints


def checkpoint_names(root) -> list[str]:
    """The checkpoint directory's entries other than the run's metrics files, sorted."""
    return sorted(p.name for p in root.iterdir() if p.name not in RUN_FILES)


def clean_env(**extra) -> dict:
    """The environment for a child process, without the process-group variables an in-process run has set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra}


# A model small enough that a step takes milliseconds on CPU (the vocabulary is what makes tiny/* slow).
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
    "schedule.warmup_steps=2",
    "schedule.max_steps=8",
    "train.eval_interval=4",
    "train.eval_batches=2",
    "train.log_interval=4",
    "checkpoint.interval=4",
    "checkpoint.keep_last=2",
    "optim.lr=1e-2",
    "logging.mlflow=false",
    "train.device=cpu",
]


def make_shards(directory: Path, windows: int, seq_len: int = 32, seed: int = 0, vocab: int = 512) -> Path:
    """A train split of exactly `windows` sequences of seq_len+1 tokens, and a small val split."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_shard(directory / "t_train_000000.bin", rng.integers(0, vocab, windows * seq_len + 1))
    write_shard(directory / "t_val_000000.bin", rng.integers(0, vocab, 8 * seq_len + 1))
    return directory


def tiny_cfg(tmp: Path, data: Path, *extra: str, preset: str = "tiny/t-loopformer"):
    return load_config(preset, TINY + [f"data.dir={data}", f"checkpoint.dir={tmp}"] + list(extra))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one thread is fastest, and 2 threads on a busy 2-core machine stall on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)  # 5 steps per epoch at batch 2: crosses epochs


# ------------------------------------------------------------------------------------------ pure parts
def test_ds_config_is_built_from_train_config(tmp_path):
    from pipeline.train.ds import build_ds_config

    for stage in range(4):
        cfg = load_config(
            "tiny/t-loopformer",
            [
                f"train.zero_stage={stage}",
                "train.micro_batch_size=3",
                "train.grad_accum_steps=2",
                "train.global_batch_size=12",
                "optim.grad_clip=0.5",
            ],
        )
        ds = build_ds_config(cfg, world_size=2, precision="bf16" if stage % 2 else "fp32")
        assert ds["zero_optimization"]["stage"] == stage
        assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
            12,
            3,
            2,
        )
        assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] == bool(stage % 2)
        assert "optimizer" not in ds and "scheduler" not in ds
    with pytest.raises(ConfigError) as e:
        build_ds_config(cfg, world_size=1, precision="fp32")
    assert "train.global_batch_size=12" in str(e.value) and "world_size=1 = 6" in str(e.value)
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 5, "zero_optimization": {"stage": 3}}))
    cfg.train.ds_config = str(bad)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=5 but train.micro_batch_size=3"):
        build_ds_config(cfg, world_size=2, precision="fp32")
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="zero_optimization.stage=2 but train.zero_stage=3"):
        build_ds_config(cfg, world_size=2, precision="fp32")


def test_lr_schedule_warmup_then_cosine():
    from pipeline.train.ds import lr_multiplier

    cfg = load_config("paper/t-loopformer")
    f = lr_multiplier(cfg)
    lr = lambda s: cfg.optim.lr * f(s)
    assert lr(0) == pytest.approx(6e-4 / 4000) and lr(3999) == pytest.approx(6e-4)
    assert lr(4000) == pytest.approx(6e-4)
    assert lr(4000 + (250000 - 4000) // 2) == pytest.approx((6e-4 + 6e-5) / 2)
    assert lr(250000) == pytest.approx(6e-5) and lr(300000) == pytest.approx(6e-5)
    assert all(lr(s) >= lr(s + 1000) for s in range(4000, 250000, 1000))


def test_param_groups_decay_matrices_only():
    from pipeline.model import LoopedLM
    from pipeline.train.ds import build_optimizer

    cfg = load_config("tiny/t-loopformer", TINY)
    model = LoopedLM(cfg.model)
    opt, _ = build_optimizer(cfg, model)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    plain = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[0]["weight_decay"] == cfg.optim.weight_decay and opt.param_groups[1]["weight_decay"] == 0
    assert "wte.weight" in plain and "wpe.weight" in plain and not any(n.startswith(("wte", "wpe")) for n in decay)
    assert all(model.get_parameter(n).dim() >= 2 for n in decay) and all(
        model.get_parameter(n).dim() < 2 for n in plain - {"wte.weight", "wpe.weight"}
    )


def test_optimizer_implementation(monkeypatch):
    """auto takes the fused AdamW kernel where torch has it and the for-loop one where it does not; each named
    kernel is built as named; a named kernel torch lacks is a config error naming the key. All take equal steps."""
    from pipeline.model import LoopedLM
    from pipeline.train.ds import build_optimizer

    def step(impl):
        torch.manual_seed(0)
        cfg = load_config("tiny/t-loopformer", TINY + [f"optim.implementation={impl}"])
        model = LoopedLM(cfg.model)
        opt, _ = build_optimizer(cfg, model)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return opt, torch.cat([p.detach().flatten() for p in model.parameters()])

    opt, ref = step("auto")
    assert opt.defaults["fused"] is True
    for impl, key, val in [("fused", "fused", True), ("foreach", "foreach", True), ("for-loop", "foreach", False)]:
        opt, w = step(impl)
        assert opt.defaults[key] is val and torch.allclose(w, ref, rtol=1e-6, atol=1e-7), impl
    real = torch.optim.AdamW

    def no_fused(*a, **kw):  # a torch or device without the fused kernel
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(*a, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    opt, w = step("auto")
    assert (
        not opt.defaults["fused"] and opt.defaults["foreach"] is False and torch.allclose(w, ref, rtol=1e-6, atol=1e-7)
    )
    with pytest.raises(ConfigError, match="optim.implementation=fused"):
        step("fused")


def test_single_process_skips_the_identity_all_reduce(tmp_path, data):
    """One process without ZeRO: the engine's all-reduce over a group of one is switched off (ds.initialize), and
    the weights after two optimizer steps of two micro-batches each are bit-identical to running it."""
    from pipeline.train.trainer import Trainer

    def weights(allreduce):
        cfg = tiny_cfg(
            tmp_path / str(allreduce),
            data,
            "train.grad_accum_steps=2",
            "train.global_batch_size=4",
            "train.deterministic=true",
            "logging.mlflow=false",
            "checkpoint.interval=0",
            "train.eval_interval=0",
        )
        t = Trainer.build(cfg, callbacks=[])
        assert t.engine.enable_backward_allreduce is False
        t.engine.enable_backward_allreduce = allreduce
        for _ in range(2):
            t.train_step()
        return [p.detach().clone() for p in t.model.parameters()]

    for a, b in zip(weights(False), weights(True)):
        assert torch.equal(a, b)


def test_loader_is_disjoint_deterministic_and_resumable(tmp_path):
    from pipeline.train.data import TrainLoader

    d = make_shards(tmp_path, windows=23, seq_len=8)
    mk = lambda r, ws=2: TrainLoader(str(d), "train", 8, 3, r, ws, seed=7, vocab_size=512)
    a, b = mk(0), mk(1)
    assert a.micros_per_epoch == 3  # 23 windows // (3 x 2): remainder dropped per epoch
    for micro in range(6):
        ia, ib = set(a.window_ids(micro)), set(b.window_ids(micro))
        assert len(ia) == len(ib) == 3 and not ia & ib
    epoch0 = np.concatenate([np.r_[a.window_ids(m), b.window_ids(m)] for m in range(3)])
    assert len(set(epoch0.tolist())) == 18  # one epoch never repeats a window
    assert not np.array_equal(a.window_ids(0), a.window_ids(3))  # the next epoch is reshuffled
    x0, y0 = a.next()
    assert x0.shape == (3, 8) and torch.equal(x0[:, 1:], y0[:, :-1])
    for _ in range(4):
        a.next()
    state = a.state_dict()
    want = [a.next() for _ in range(3)]
    c = mk(0)
    c.load_state_dict(state)
    got = [c.next() for _ in range(3)]
    assert all(torch.equal(w[0], g[0]) and torch.equal(w[1], g[1]) for w, g in zip(want, got))
    with pytest.raises(ValueError, match="global_batch"):
        mk(0, ws=1).load_state_dict(state)


# ----------------------------------------------------------------------------------- training runs
def _sigterm_at(monkeypatch, micro: int) -> None:
    """Sends this process SIGTERM when the loader hands out global micro-batch `micro` (during that step)."""
    from pipeline.train.data import TrainLoader

    orig = TrainLoader.next

    def nxt(self):
        if self.micro == micro:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(self)

    monkeypatch.setattr(TrainLoader, "next", nxt)


def test_resume_is_bit_exact_and_checkpoints_rotate(tmp_path, data, monkeypatch, capfd):
    from pipeline.model.io import load_model
    from pipeline.train.trainer import run

    full = run(tiny_cfg(tmp_path / "a", data))
    assert len(full.losses) == 8 and full.step == 8 and all(np.isfinite(full.losses))
    root = tmp_path / "a"
    assert (root / "latest").read_text() == "global_step8"
    assert checkpoint_names(root) == ["global_step4", "global_step8", "latest"]  # keep_last=2
    assert sorted(full.val_losses) == [4, 8]
    # the export beside the checkpoint is the trained model
    model, cfg = load_model(root)
    assert cfg.model.d_model == 32 and cfg.name == "tiny/t-loopformer"
    saved = torch.load(root / "global_step8" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.equal(model.state_dict()[k.removeprefix("net.")], v.float()) for k, v in saved.items())

    # resuming needs the same network: an error names every key that differs, not the resumable ones
    with pytest.raises(ConfigError, match=r"differs in model.n_heads \(2 -> 1\), model.d_ff \(64 -> 48\) \("):
        run(
            tiny_cfg(
                root, data, "model.d_ff=48", "model.n_heads=1", "objective.lambda_short=0.5", "schedule.max_steps=9"
            )
        )
    # the objective's weights and the execution knobs may change: the run continues and says so
    changed = ("objective.lambda_short=0.5", "model.router_threshold=0.4", "model.execution=sorted")
    more = run(
        tiny_cfg(tmp_path / "d", data, f"checkpoint.resume={root / 'global_step8'}", "schedule.max_steps=9", *changed)
    )
    assert more.start_step == 8 and more.step == 9 and np.isfinite(more.losses).all()
    out = capfd.readouterr()
    note = [
        line for line in (out.out + out.err).splitlines() if "resuming with the objective or execution changed" in line
    ]
    assert len(note) == 1 and all(
        k in note[0]
        for k in ("router_threshold 0.5 -> 0.4", "execution 'compact' -> 'sorted'", "lambda_short 0.1 -> 0.5")
    ), note

    # resume from step 4 into another dir: steps 5..8 are bit-identical
    part = run(tiny_cfg(tmp_path / "b", data, f"checkpoint.resume={root / 'global_step4'}"))
    assert part.start_step == 4 and part.losses == full.losses[4:]
    assert part.val_losses[8] == full.val_losses[8]

    # SIGTERM during step 3: the step finishes, a checkpoint is saved, the run returns; resume auto finishes it
    _sigterm_at(monkeypatch, 2)
    stopped = run(tiny_cfg(tmp_path / "c", data))
    assert stopped.stopped_by == "SIGTERM" and stopped.step == 3 and stopped.losses == full.losses[:3]
    assert (tmp_path / "c" / "latest").read_text() == "global_step3"
    monkeypatch.undo()
    rest = run(tiny_cfg(tmp_path / "c", data, "checkpoint.resume=auto"))
    assert rest.start_step == 3 and rest.losses == full.losses[3:]


@pytest.mark.parametrize("recipe", ["paper", "budget", "expected", "kinds"])
def test_resume_bit_exact_with_grad_accum_and_zero2(tmp_path, data, recipe, monkeypatch):
    from helpers import RECIPE, loose_kinds, spread_router  # (rank scripts import this module without bench there)
    from pipeline.model import LoopedLM
    from pipeline.train.trainer import Trainer

    # kinds: the router's forecast head (a parameter the network gains: checkpointed, resumed) and the kinds' table
    # (the recipe's state, saved in the training state) that withholds the network's loss and opens the gate
    kinds = recipe == "kinds"
    if kinds:
        loose_kinds(monkeypatch)
    extra = [
        *RECIPE[recipe],
        *(["objective.router.hard_gate=0.5", "objective.router.withhold=0.5"] if kinds else []),
        "train.zero_stage=2",
        "train.grad_accum_steps=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "schedule.max_steps=6",
        "checkpoint.interval=3",
        "train.eval_interval=0",
    ]

    def train(d, *more):  # the kinds recipe from a spread router, so that some answers are routed shallow
        cfg = tiny_cfg(tmp_path / d, data, *extra, *more)
        return Trainer.build(cfg, model=spread_router(LoopedLM(cfg.model)) if kinds else None).fit()

    full = train("a")
    part = train("b", f"checkpoint.resume={tmp_path / 'a' / 'global_step3'}")
    assert part.losses == full.losses[3:]
    logged = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    withheld = [r["router/withheld"] for r in logged if "router/withheld" in r]
    assert len(withheld) == (6 if kinds else 0) and all(0 <= w <= 1 for w in withheld)
    assert not kinds or max(withheld) > 0
    if kinds:  # the resumed table has kinds below the gate (a fresh one, all 1, would withhold their answers)
        saved = torch.load(tmp_path / "a" / "global_step3" / "rank0_state.pt", weights_only=True)["objective"]
        assert 0 < float(saved["kind_rate"].min()) < 0.5


@pytest.mark.parametrize("execution", ["sorted", "bucketed"])
def test_each_strategy_resumes_bit_exact_and_into_another(tmp_path, data, execution):
    """model.execution (compact: the tests above): a run under the strategy resumes bit for bit under
    train.deterministic, and its checkpoint resumes under another strategy (the same model: losses equal to
    rounding). A spread router, so that rows differ in depth and the layouts differ."""
    from helpers import spread_router
    from pipeline.model import LoopedLM
    from pipeline.train.trainer import Trainer

    extra = ["schedule.max_steps=6", "checkpoint.interval=3", "train.eval_interval=0", "train.deterministic=true"]

    def train(d, ex, *more):
        cfg = tiny_cfg(tmp_path / d, data, *extra, f"model.execution={ex}", *more)
        return Trainer.build(cfg, model=None if more else spread_router(LoopedLM(cfg.model))).fit()

    full = train("a", execution)
    resume = f"checkpoint.resume={tmp_path / 'a' / 'global_step3'}"
    assert train("b", execution, resume).losses == full.losses[3:]
    other = train("c", "compact", resume)
    assert other.start_step == 3
    np.testing.assert_allclose(other.losses, full.losses[3:], rtol=1e-5, atol=0)


@pytest.mark.parametrize("target", [1.6, 2.4])
def test_budget_recipe_lands_on_its_target_depth(tmp_path, target):
    """Trained with the budget router recipe, the executed (thresholded) mean depth on held-out tokens lands
    within 10 % of the target and every depth 1..L keeps at least 2 % and at most 70 % of the tokens."""
    from pipeline.model.io import load_model
    from pipeline.train.data import ValLoader
    from pipeline.train.trainer import run

    data = make_shards(tmp_path / "data", windows=64)  # 2k tokens: nearly every id of the 512 is trained on
    run(
        tiny_cfg(
            tmp_path / "run",
            data,
            "model.router_norm=true",
            "objective.router.recipe=budget",
            f"objective.router.target_depth={target}",
            "schedule.max_steps=40",
            "train.eval_interval=0",
            "checkpoint.interval=0",
            "train.log_interval=40",
        )
    )
    model, cfg = load_model(tmp_path / "run")
    idx = torch.cat([x for x, _ in ValLoader(str(data), "val", 32, 8, 0, 1, 512).batches(1)])
    with torch.no_grad():
        depth = model(idx).depth
    share = torch.bincount(depth.flatten() - 1, minlength=cfg.model.loops).float() / depth.numel()
    assert abs(float(depth.float().mean()) / target - 1) < 0.1, (float(depth.float().mean()), share.tolist())
    assert bool((share >= 0.02).all()) and bool((share <= 0.7).all()), share.tolist()


def test_mlflow_run_holds_params_metrics_and_tags(tmp_path, data):
    from mlflow.tracking import MlflowClient

    from pipeline.train.trainer import run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_cfg(
        tmp_path / "ck",
        data,
        "logging.mlflow=true",
        f"logging.tracking_uri={uri}",
        "logging.experiment=t",
        "schedule.max_steps=4",
    )
    res = run(cfg)
    client = MlflowClient(uri)
    r = client.get_run(res.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params == {k: str(v) for k, v in cfg.flat().items()}
    assert r.data.tags["variant"] == "t-loopformer" and r.data.tags["preset"] == "tiny/t-loopformer"
    assert r.data.tags["scale"] == "tiny" and r.data.tags["world_size"] == "1"
    hist = client.get_metric_history(res.run_id, "loss")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [1, 2, 3, 4]
    assert [m.value for m in sorted(hist, key=lambda m: m.step)] == res.losses
    want = {
        "loss_L",
        "loss_S",
        "loss_align",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mem/peak_rss_gb",
        "val/loss",
        "router/full/mean_depth",
        "router/full/depth_share_1",
        "router/short/mean_depth",
        "router/full/compute_ratio",
    }
    assert want <= set(r.data.metrics)
    assert r.data.metrics["lr"] == pytest.approx(3e-4 + 0.5 * (1e-2 - 3e-4) * (1 + np.cos(np.pi * (3 - 2) / (4 - 2))))
    assert r.data.metrics["tokens_per_s"] > 0 and "mfu" not in r.data.metrics  # CPU, no logging.peak_flops
    assert sum(r.data.metrics[f"router/full/depth_share_{i}"] for i in (1, 2, 3)) == pytest.approx(1.0)
    # resuming (a longer schedule) continues the same MLflow run
    res2 = run(
        tiny_cfg(
            tmp_path / "ck",
            data,
            "logging.mlflow=true",
            f"logging.tracking_uri={uri}",
            "logging.experiment=t",
            "schedule.max_steps=6",
        )
    )
    assert res2.run_id == res.run_id and res2.start_step == 4
    assert sorted(m.step for m in client.get_metric_history(res.run_id, "loss")) == [1, 2, 3, 4, 5, 6]


def _nan_at(monkeypatch, calls: set[int]) -> None:
    """Makes the training forward's loss NaN on the given 1-based call numbers."""
    from pipeline.train.objective import Objective

    orig, n = Objective.forward, [0]

    def fwd(self, idx, targets, *a, **k):
        out = orig(self, idx, targets, *a, **k)
        if not k.get("full_only") and not idx.is_meta:  # not validation, nor the planner's trace (tlf plan)
            n[0] += 1
            if n[0] in calls:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Objective, "forward", fwd)


def test_nan_loss_stops_naming_the_step_or_skips(tmp_path, data, monkeypatch):
    from pipeline.train.trainer import NonFiniteError, run

    _nan_at(monkeypatch, {3})
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 3 .*Last good checkpoint: .*global_step2"):
        run(tiny_cfg(tmp_path / "stop", data, "checkpoint.interval=2"))
    assert (tmp_path / "stop" / "latest").read_text() == "global_step2"
    assert checkpoint_names((tmp_path / "stop")) == ["global_step2", "latest"]

    _nan_at(monkeypatch, {3, 4})
    res = run(tiny_cfg(tmp_path / "skip", data, "train.nan_policy=skip", "schedule.max_steps=4"))
    assert res.skipped == 2 and len(res.losses) == 4 and all(np.isfinite(res.losses))

    _nan_at(monkeypatch, set(range(1, 100)))
    with pytest.raises(NonFiniteError, match="3 non-finite batches in a row"):
        run(tiny_cfg(tmp_path / "skip2", data, "train.nan_policy=skip", "train.nan_skip_limit=3"))


def test_full_disk_during_save_leaves_previous_checkpoint(tmp_path, data, monkeypatch):
    import shutil

    from pipeline.model.io import load_model
    from pipeline.train.checkpoint import CheckpointError
    from pipeline.train.trainer import run

    from pipeline.train import checkpoint

    root = tmp_path / "ck"
    real_write = checkpoint._Hashing.write

    def full_disk(self, b):  # DeepSpeed's files go through the checkpoint's hashing writer: the disk fills mid-file
        if "global_step4" in self.fh.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, b)

    monkeypatch.setattr(checkpoint._Hashing, "write", full_disk)
    with pytest.raises(CheckpointError, match=r"global_step4 failed.*No space left.*global_step2 is intact"):
        run(tiny_cfg(root, data, "checkpoint.interval=2"))
    monkeypatch.undo()
    assert checkpoint_names(root) == ["global_step2", "latest"]  # the temp dir is gone
    assert (root / "latest").read_text() == "global_step2"
    load_model(root)
    res = run(tiny_cfg(root, data, "checkpoint.interval=2", "schedule.max_steps=3"))
    assert res.start_step == 2 and res.step == 3

    # too little free space: refused before anything is written
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1000))
    with pytest.raises(CheckpointError, match=r"not saving .*global_step4.*free.*global_step3 is intact"):
        run(tiny_cfg(root, data, "checkpoint.interval=4", "schedule.max_steps=8"))
    assert checkpoint_names(root) == ["global_step2", "global_step3", "latest"]


def test_killed_save_leaves_a_loadable_checkpoint(tmp_path, data):
    from pipeline.model.io import load_model
    from pipeline.train.trainer import run

    root = tmp_path / "ck"
    args = TINY + [f"data.dir={data}", f"checkpoint.dir={root}", "checkpoint.interval=2"]
    from bench.faults import CHILD  # dies inside the save of step 4: DeepSpeed's files and the rank state written

    p = subprocess.run(
        [PY, "-c", CHILD, *args], capture_output=True, text=True, timeout=300, env=clean_env(KILL_IN_SAVE="4")
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert (root / "latest").read_text() == "global_step2"
    assert checkpoint_names(root) == [".tmp-global_step4", "global_step2", "latest"]
    load_model(root)  # generation/evaluation see the previous complete export
    res = run(tiny_cfg(root, data, "checkpoint.interval=2", "schedule.max_steps=4"))
    assert res.start_step == 2 and res.step == 4
    assert checkpoint_names(root) == ["global_step2", "global_step4", "latest"]


def test_cli_errors_are_clear(tmp_path, data):
    env = clean_env(WORLD_SIZE="1")
    p = subprocess.run(
        [PY, "-m", "pipeline.train", "tiny/t-loopformer", "train.global_batch_size=8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2
    assert (
        "train.global_batch_size=8" in p.stderr
        and "train.micro_batch_size=4" in p.stderr
        and "world_size=1" in p.stderr
    )
    p = subprocess.run(
        [PY, "-m", "pipeline.train", "tiny/t-loopformer", "train.bogus=1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert p.returncode == 2 and "unknown config key 'train.bogus'" in p.stderr
    p = subprocess.run(
        [
            PY,
            "-m",
            "pipeline.train",
            "tiny/t-loopformer",
            *TINY,
            f"data.dir={tmp_path}/nothing",
            f"checkpoint.dir={tmp_path}/ck",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert p.returncode == 1 and "nothing: no 'train' shards" in p.stderr


def _study_overrides(tmp_path, data) -> list[str]:
    """A two-step study run of TINY in tmp_path (bench/testkit.py `train_case`)."""
    return [*TINY, f"data.dir={data}", f"checkpoint.dir={tmp_path}", "schedule.max_steps=2", "checkpoint.resume=none"]


def test_a_study_reuses_a_finished_run_only_for_the_same_preset_and_overrides(tmp_path, data):
    """bench/testkit.py `train_case` with reuse (bench/depth_need.py --reuse): a checkpoint dir that holds a
    finished run of the same spec gives that run's result back, marked reused, and trains nothing; another spec
    in the same dir, or no reuse, trains."""
    from bench.testkit import STUDY_CASE, train_case

    ov = _study_overrides(tmp_path, data)
    spec = {"preset": "tiny/base-loop", "overrides": ov, "reuse": True}
    first = train_case(spec)
    assert "reused" not in first and (tmp_path / STUDY_CASE).is_file() and first["dir"] == str(tmp_path)
    assert train_case(spec) == {**first, "reused": True}
    other = train_case({**spec, "overrides": [*ov, "optim.lr=5e-3"]})  # another spec: trained, and now the one saved
    assert "reused" not in other and other["wall_s"] != first["wall_s"]
    assert "reused" not in train_case({**spec, "reuse": False})


def test_a_study_does_not_reuse_a_run_a_signal_stopped(tmp_path, data, monkeypatch):
    """A run that SIGTERM ended early returns normally (the trainer checkpoints and stops): `train_case` must not
    mark it finished, or `--reuse` would report a half-trained model as the case's result."""
    import pipeline.train.trainer as trainer
    from bench.testkit import STUDY_CASE, train_case

    real = trainer.run

    def stopped(cfg, overwrite=False):  # the real run, then the result a SIGTERM after step 1 gives
        return dataclasses.replace(real(cfg, overwrite), step=1, stopped_by="SIGTERM")

    monkeypatch.setattr(trainer, "run", stopped)
    train_case({"preset": "tiny/base-loop", "overrides": _study_overrides(tmp_path, data), "reuse": True})
    assert not (tmp_path / STUDY_CASE).exists()


def test_a_study_merges_the_cases_of_an_earlier_one_of_the_same_task(tmp_path):
    """bench/depth_need.py --merge: the cases an earlier study's JSON holds and this one does not join it, read
    back with int seeds, budgets and levels (JSON writes them as strings); a case run now is kept as run; a study
    of other steps is refused with the key named."""
    import json

    from bench.depth_need import merge

    def case(acc):
        return {"preset": "p", "seeds": {0: {"levels": {1: {"accuracy": acc, "accuracy_by_level": {1: acc}}}}}}

    head = {"task": {"levels": 2}, "steps": 10, "documents_per_step": 4, "seeds": [0], "windows": 8}
    old = {**head, "cases": {"a": case(0.1), "b": {**case(0.2), "summary": {"x": 1}}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    res = {**head, "cases": {"a": case(0.9)}}
    merge(res, str(path))
    assert res["cases"]["a"] == case(0.9) and res["cases"]["b"] == case(0.2) and res["merged_from"] == str(path)
    with pytest.raises(SystemExit, match="steps"):
        merge({**head, "steps": 11, "cases": {}}, str(path))
