"""Zero-shot tasks during training (`train.zeroshot_interval`): `ZeroShot`, a training callback that evaluation
registers as a `tlf.callbacks` entry point (setup.py), so pipeline, which runs it, never imports evaluation.

Every `train.zeroshot_interval` steps it scores the tasks the eval section chooses (`eval.tasks`, `eval.limit`,
`eval.loops`, `eval.batch_size`, `eval.source`, `eval.table_metric`) with `tlf eval`'s scorer and metric code and
adds `tlf eval`'s metric keys (`eval/M{M}/<task>/{acc,acc_norm,...,n}`, `eval/M{M}/avg_acc`; evaluation/results.py
`flatten`) to that step's metrics, which the trainer writes to metrics.jsonl and MLflow. Rank r scores the examples
i with i % world_size == r; each rank's per-example outcomes (`scorer.example_outcomes`, zeros at the other ranks'
examples) are summed over the ranks in one all-reduce, so every rank holds every example's outcome and the metrics
are computed from them as `tlf eval` computes them (`scorer.outcome_metrics`).

The network it scores holds the weights `tlf eval` would load from the checkpoint of that step: the trained network
itself when its weights are fp32 and whole (ZeRO 0-2), else an fp32 copy of them (bf16, or gathered under ZeRO-3;
`pipeline.model.io.state_for_export`, what the checkpoint's export holds). Training is not changed: the DeepSpeed
engine is put in eval mode and back into the mode it was in, no gradient is recorded, the scoring draws no random
number (building the fp32 copy does), and every generator's state (python, numpy, torch, CUDA) is put back after
each evaluation.

Its cost is said at the start (seconds per evaluation, from `estimate.py`'s measured sample of the scorer's work)
and, after the first evaluation, as measured: seconds and its share of the run at the run's step time so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.config import Config, ConfigError
from pipeline.train import checkpoint as ckpt
from pipeline.train.callbacks import Callback
from pipeline.train.logger import fmt_duration, log
from pipeline.train.validation import sum_over_ranks


@dataclass
class Plan:
    """What every evaluation of the run scores, loaded once at the start."""

    cfg: Config
    inp: object  # evaluation.evaluate._Inputs: the tasks, their tokenised requests, the skipped ones
    budgets: list  # [(requested M, effective M)] (evaluate.resolve_budgets: eval.loops, else L)
    rank: int
    world_size: int

    def effective(self) -> list[int]:
        return sorted({m for _, m in self.budgets})

    def mine(self, n: int) -> list[int]:
        """The examples of a task of n that this rank scores."""
        return list(range(self.rank, n, self.world_size))

    def examples(self) -> int:
        return sum(len(td.examples) for td in self.inp.tasks.values())


def load_plan(cfg: Config, rank: int, world_size: int) -> Plan:
    """The tasks as `tlf eval` loads them (evaluate.load_inputs, without perplexity): a task whose data cannot be
    reached is skipped with one warning line unless eval.strict. An unknown task name, or a task that cannot be
    loaded under eval.strict, is a ConfigError before the first step."""
    from evaluation.evaluate import load_inputs, resolve_budgets
    from evaluation.tasks import TaskDataError, spec

    ev = cfg.eval
    try:
        for name in ev.tasks:
            spec(name)
        inp = load_inputs(dataclasses.replace(cfg, eval=dataclasses.replace(ev, perplexity=False)), _warn)
    except TaskDataError as e:
        raise ConfigError(f"eval.tasks (train.zeroshot_interval={cfg.train.zeroshot_interval}): {e}") from None
    return Plan(cfg, inp, resolve_budgets(cfg, []), rank, world_size)


def _warn(line: str) -> None:
    log.warn("train.zeroshot_interval: " + line.removeprefix("eval: warning: "))


# ------------------------------------------------------------------------------------------- scoring
@contextlib.contextmanager
def scoring_network(trainer):
    """The trained network with the weights `tlf eval` would load (see the module doc), the engine in eval mode;
    afterwards the engine is back in the mode it was in and every RNG's state is the one it had."""
    engine = trainer.engine
    was_training = engine.module.training
    rng = ckpt.rng_state()
    engine.eval()
    try:
        yield _network(trainer)
    finally:
        engine.train(was_training)
        ckpt.set_rng_state(rng)


def _network(trainer):
    """The trained network when its parameters are whole fp32 tensors, else an fp32 copy on its device."""
    from pipeline.model.io import model_from_state, state_for_export

    net, engine = trainer.model, trainer.engine
    zero3 = engine.zero_optimization_stage() == 3
    if not zero3 and all(p.dtype == torch.float32 for p in net.parameters()):
        return net
    with contextlib.ExitStack() as stack:
        if zero3:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(list(net.parameters()), modifier_rank=None))
        state = state_for_export(net)
    return model_from_state(trainer.cfg, state, Path("the trained weights"), "config", trainer.device)


def _share(scorer, plan: Plan, name: str, loops: int) -> np.ndarray:
    """(2, n) outcomes of task `name` at budget `loops`: this rank's examples' columns, zeros elsewhere."""
    from evaluation.scorer import example_outcomes
    from evaluation.tasks import TASKS, TaskData

    td = plan.inp.tasks[name]
    reqs, spans = plan.inp.requests[name]
    mine = plan.mine(len(td.examples))
    sub_reqs, sub_spans = [], []
    for i in mine:
        s, e = spans[i]
        sub_spans.append((len(sub_reqs), len(sub_reqs) + e - s))
        sub_reqs += reqs[s:e]
    scored = scorer.score(sub_reqs, loops) if sub_reqs else []
    sub = TaskData(td.name, [td.examples[i] for i in mine], td.split, td.source, td.note)
    out = np.zeros((2, len(td.examples)), dtype=np.float64)
    out[:, mine] = example_outcomes(sub, TASKS[name].kind, scored, sub_spans)
    return out


def evaluate(plan: Plan, model, device) -> dict[str, float]:
    """One evaluation: this rank's share of every task at every budget, one all-reduce of the outcomes (every
    rank takes part, whatever its share), and `tlf eval`'s metrics of them."""
    from evaluation.scorer import Scorer

    scorer = Scorer(model, plan.cfg.eval.batch_size, device)
    parts = [_share(scorer, plan, n, m).reshape(-1) for m in plan.effective() for n in plan.inp.tasks]
    local = torch.from_numpy(np.concatenate(parts)).to(device)  # float64: each example's value on one rank only
    return metrics_of(plan, np.asarray(sum_over_ranks(local), dtype=np.float64))


def metrics_of(plan: Plan, outcomes: np.ndarray) -> dict[str, float]:
    """The `eval/M{M}/...` metrics `tlf eval` logs for these tasks, from every example's outcomes (in `evaluate`'s
    order: budgets, then tasks, each (2, n))."""
    from evaluation import results
    from evaluation.scorer import outcome_metrics
    from evaluation.tasks import TASKS

    at, pos = {}, 0
    for m in plan.effective():
        at[m] = {}
        for name, td in plan.inp.tasks.items():
            n, sp = len(td.examples), TASKS[name]
            at[m][name] = outcome_metrics(td, sp.kind, sp.metrics, outcomes[pos : pos + 2 * n].reshape(2, n))
            pos += 2 * n
    metric = plan.cfg.eval.table_metric
    budgets = [
        {"loops": r, "tasks": at[m], "avg_acc": results.average_accuracy(at[m], metric)[0]} for r, m in plan.budgets
    ]
    return results.flatten({"budgets": budgets})


# ---------------------------------------------------------------------------------------------- cost
def evaluations_in(start: int, end: int, interval: int) -> int:
    """How many of the steps start+1..end are multiples of interval."""
    return end // interval - start // interval


def estimate_seconds(plan: Plan, model, device) -> tuple[float, int, float]:
    """(seconds per evaluation on this rank, tokens read per budget, tokens/s): evaluation/estimate.py's measured
    sample of the scorer's work at the largest budget, each budget's tokens scaled by M / that budget, this rank's
    share of the examples."""
    from evaluation.estimate import request_tokens, tokens_per_second

    eff = plan.effective()
    tokens = sum(request_tokens(reqs, plan.cfg.model.block_size) for reqs, _ in plan.inp.requests.values())
    rate = tokens_per_second(model, plan.inp, eff[-1], device, plan.cfg.eval.batch_size)
    return sum(tokens * m / eff[-1] for m in eff) / rate / plan.world_size, tokens, rate


def start_line(plan: Plan, interval: int, evaluations: int, seconds: float, tokens: int, rate: float) -> str:
    ev, eff = plan.cfg.eval, plan.effective()
    return (
        f"zero-shot tasks every {interval} steps, {evaluations} times in this run: "
        f"{', '.join(plan.inp.tasks)}, {plan.examples():,} examples (eval.limit={ev.limit}) at budgets "
        f"{[m for m, _ in plan.budgets]}, split over {plan.world_size} rank(s): about {_secs(seconds)} per "
        f"evaluation, {_secs(seconds * evaluations)} in all ({tokens:,} tokens per budget at {rate:,.0f} tokens/s "
        f"measured at M={eff[-1]}); its share of the run is measured at the first evaluation"
    )


def measured_line(step: int, seconds: float, estimate: float, evaluations: int, step_s: float, steps: int) -> str:
    """The first evaluation's time, and the share of the run that `evaluations` such take beside `steps` steps of
    step_s seconds (the run's own time per step so far: validation and checkpoints included)."""
    total = seconds * evaluations
    share = 100 * total / max(total + steps * step_s, 1e-9)
    return (
        f"zero-shot tasks at step {step}: {_secs(seconds)} (estimated {_secs(estimate)}); {evaluations} times that is "
        f"about {_secs(total)}, {share:.1f}% of this run at its {step_s:.3g} s per step so far"
    )


def summary(plan: Plan, metrics: dict[str, float]) -> str:
    """The console's line of an evaluation: per budget, the average and each task's Table-1 accuracy
    (eval.table_metric), 'M=3 avg_acc 0.5000 (copa 0.500, piqa 0.375)'."""
    metric, out = plan.cfg.eval.table_metric, []
    for m, _ in plan.budgets:
        pre = f"eval/M{m}"
        accs = [(n, metrics.get(f"{pre}/{n}/{metric}", metrics.get(f"{pre}/{n}/acc"))) for n in plan.inp.tasks]
        tasks = ", ".join(f"{n} {a:.3f}" for n, a in accs if a is not None)
        out.append(f"M={m} avg_acc {metrics.get(f'{pre}/avg_acc', float('nan')):.4f} ({tasks})")
    return "; ".join(out)


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else fmt_duration(s)


# ------------------------------------------------------------------------------------------ callback
class ZeroShot(Callback):
    """train.zeroshot_interval > 0: the eval section's zero-shot tasks every that many steps (the module doc)."""

    plan: Plan | None = None

    def pre_train(self) -> None:
        t = self.trainer
        self.interval, self.plan = t.cfg.train.zeroshot_interval, None
        if self.interval <= 0:
            return
        self.evaluations = evaluations_in(t.step, t.max_steps, self.interval)
        if not self.evaluations:
            log.info(f"train.zeroshot_interval={self.interval}: no step of {t.step + 1}..{t.max_steps} is a multiple")
            return
        plan = load_plan(t.cfg, t.rank, t.ws)
        if not plan.inp.tasks:
            log.info(
                f"train.zeroshot_interval={self.interval}: no zero-shot task to run (eval.tasks={t.cfg.eval.tasks})"
            )
            return
        self.plan, self.first = plan, True
        with scoring_network(t) as net:
            self.estimate, tokens, rate = estimate_seconds(plan, net, t.device)
        log.info(start_line(plan, self.interval, self.evaluations, self.estimate, tokens, rate))
        self.t_start, self.start_step = time.perf_counter(), t.step

    def post_step(self, step: int, metrics: dict) -> None:
        if self.plan is None or step % self.interval:
            return
        t, t0 = self.trainer, time.perf_counter()
        with scoring_network(t) as net:
            out = evaluate(self.plan, net, t.device)
        seconds = time.perf_counter() - t0
        metrics.update(out)
        log.info(f"step {step}: zero-shot " + summary(self.plan, out) + f" ({_secs(seconds)})")
        if self.first:
            self.first, steps = False, step - self.start_step
            step_s = (t0 - self.t_start) / max(steps, 1)
            log.info(
                measured_line(step, seconds, self.estimate, self.evaluations, step_s, t.max_steps - self.start_step)
            )
