"""Host syncs (issue: the router's savings in training): at most one device -> host read per forward pass inside
the model (all |A_i| of a pass from one read) and one per optimizer step in the training loop. Counted with
`bench.testkit.count_host_reads`, which records `.item()/.cpu()/.tolist()/float()/int()/bool()` calls made
from tlf's own files: on a GPU each of those waits for the device's queue."""

from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from bench.testkit import count_host_reads
from pipeline.model import LoopedLM
from pipeline.train.objective import Objective

MODEL = tuple(
    str(Path(__file__).resolve().parent.parent / "pipeline" / "model" / f)  # the forward's files
    for f in ("looped.py", "layers.py", "router.py", "schedule.py", "head_loss.py")
) + (str(Path(__file__).resolve().parent.parent / "pipeline" / "train" / "objective.py"),)  # the objective's
# the loop's files: trainer.py and validation.py (its sum_over_ranks is where the step's read happens)
TRAINER = tuple(
    str(Path(__file__).resolve().parent.parent / "pipeline" / "train" / f) for f in ("trainer.py", "validation.py")
)


def _tiny(variant: str, *extra: str) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(load_config(f"tiny/{variant}", list(extra)).model)


@pytest.mark.parametrize(
    "variant,extra,expected",
    [
        ("t-loopformer", (), 1),  # full + shortcut pass: one read of every loop's |A_i|
        ("t-loopformer", ("model.execution=dense",), 0),  # the dense oracle needs no sizes
        ("t-loopformer", ("model.execution=sorted",), 1),  # each strategy reads the sizes once
        ("t-loopformer", ("model.execution=bucketed",), 1),
        ("loopformer", (), 0),  # no router: every token runs every loop
        ("base-loop", (), 0),
    ],
)
def test_one_host_read_per_forward_pass(variant, extra, expected):
    m = _tiny(variant, *extra).train()
    x, y = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    with count_host_reads(MODEL) as reads:
        Objective(m, load_config(f"tiny/{variant}").objective)(x, y).loss.backward()
    assert len(reads) == expected, reads
    m.eval()
    with count_host_reads(MODEL) as reads, torch.no_grad():
        m(x, loops=2)  # elastic budget M < L
    assert len(reads) == expected, reads


def test_the_counter_sees_reads_and_restores_torch():
    t = torch.ones(2)
    with count_host_reads((str(Path(__file__).resolve()),)) as reads:
        t.sum().item(), float(t[0]), t.tolist(), t.cpu(), bool(t[0])
    assert [r[3] for r in reads] == ["item", "__float__", "tolist", "cpu", "__bool__"]
    assert torch.Tensor.item.__name__ == "item"  # unpatched again


def test_training_loop_reads_once_per_optimizer_step(tmp_path, data):
    from test_train import tiny_cfg

    from pipeline.train.trainer import Trainer

    steps, accum = 3, 2
    cfg = tiny_cfg(
        tmp_path,
        data,
        f"schedule.max_steps={steps}",
        "train.eval_interval=0",
        "checkpoint.interval=0",
        f"train.grad_accum_steps={accum}",
        f"train.global_batch_size={2 * accum}",
    )
    with count_host_reads(TRAINER) as loop_reads, count_host_reads(MODEL) as model_reads:
        res = Trainer.build(cfg).fit()  # the default callbacks
    assert res.step == steps and len(res.losses) == steps
    assert len(loop_reads) == steps, loop_reads  # StepMeter.read: one per optimizer step
    assert len(model_reads) == steps * accum, model_reads  # one per forward (micro-batch)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_train import make_shards

    return make_shards(tmp_path_factory.mktemp("shards"), windows=10)


def test_step_meter_means_flags_and_padded_histograms(tmp_path):
    """StepMeter: parts (loss_router included) averaged over micro-batches, the first non-finite micro-batch
    named, shortcut histograms of different S padded, the signal and a device grad norm read with the rest, and
    the step's work (loops of both passes, heads) for MFU."""
    import torch.distributed as dist

    from pipeline.model.router import DepthStats
    from pipeline.train.objective import ObjectiveOutput, ShortcutStats
    from pipeline.train.trainer import StepMeter, StepWork

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    m = StepMeter(3, "cpu")
    for k, (loss, hist) in enumerate([(2.0, [0.5, 0.5]), (4.0, [0.2, 0.3, 0.5]), (float("nan"), [1.0])]):
        one = torch.tensor(1.0)
        out = ObjectiveOutput(
            loss=torch.tensor(loss),
            depth=torch.zeros(1),
            logits=None,
            full=DepthStats(torch.tensor([0.0, 1.0]), torch.tensor(2.0), one, one),
            short=ShortcutStats(torch.tensor(hist), one, one, one, torch.tensor(float(len(hist)))),
            parts={"loss_L": torch.tensor(loss), "loss_router": torch.tensor(0.1 * (k + 1))},
        )
        m.add(out, k)
    m.grad_norm = torch.tensor(3.0)
    with count_host_reads() as reads:
        r = m.read(True, 1)
    assert len(reads) == 1  # the one read of the step
    assert r["loss"] == pytest.approx(2.0) and r["loss_L"] == pytest.approx(2.0)  # (2 + 4 + dropped NaN) / 3
    assert r["loss_router"] == pytest.approx(0.1) and r["loss_S"] == 0.0  # (0.1 + 0.2 + dropped) / 3
    assert r["bad_micro_batch"] == 3 and r["signal"] is True and r["grad_norm"] == pytest.approx(3.0)
    assert r["router"]["router/short/depth_share_1"] == pytest.approx((0.5 + 0.2 + 1.0) / 3)
    assert r["router"]["router/short/depth_share_3"] == pytest.approx(0.5 / 3)
    assert r["router"]["router/full/mean_depth"] == pytest.approx(2.0)
    assert r["parts"] == ["loss_L", "loss_router"] and r["work"] == StepWork(pytest.approx(3.0), 2)
