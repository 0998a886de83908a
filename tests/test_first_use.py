"""A newcomer's first run, end to end through the `tlf` command (a subprocess, as a user runs it, the shared run's
commands in one, helpers.tlf_all; click's CliRunner for the commands that only read configs): prep-data on their own small corpus, train, rerun, eval with MLflow,
export to transformers, generate and eval from that export. Each test is one thing such a run got wrong: what it
said, what it left behind, what it could not read. The runs are made once (`first`) and shared."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import main

REPO = Path(__file__).resolve().parent.parent
TRAIN = [
    "tiny/t-loopformer",
    "schedule.max_steps=6",  # some of which draw a shortcut pass of one loop (seed 1337)
    "logging.tracking_uri=sqlite:///mlflow.db",  # (relative to the run's directory, `first`)
    "train.eval_interval=0",
    "checkpoint.interval=0",
    "train.device=cpu",
]
EVAL = ["--tasks", "copa", "--limit", "2", "--source", "offline", "--no-latency"]


def tlf(*args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert not check or p.returncode == 0, p.stdout + p.stderr
    return p


def corpus(path: Path, docs: int = 8, words: int = 700) -> None:
    """A small corpus of its own: `docs` JSONL documents of English words."""
    vocab = "the a of model loop token depth router runs each layer time step data text train val small corpus".split()
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocab, words))}) + "\n" for _ in range(docs)))


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> dict:
    """prep-data twice, train, eval (default output dir, an MLflow store), export --format hf: their outputs."""
    from helpers import tlf_all  # (the commands in order in one child: torch and DeepSpeed imported once)

    w = tmp_path_factory.mktemp("first")
    corpus(w / "corpus.jsonl")
    prep = ["prep-data", "-i", "corpus.jsonl", "--out", "data", "--no-progress", "-j", "0"]
    out = tlf_all(
        {
            "prep": prep,
            "prep_again": prep,
            "train": ["train", *TRAIN, "data.dir=data", "checkpoint.dir=ck"],
            "eval": ["eval", "ck", *EVAL, "logging.tracking_uri=sqlite:///mlflow.db"],
            "export": ["export", "ck", "--format", "hf", "--out", "hf"],
        },
        w,
    )
    out["w"] = w
    out["results"] = json.loads(next((w / "out" / "eval").glob("*/*/results.json")).read_text())
    return out


def mlflow_run(w: Path):
    from pipeline import tracking

    return tracking.client(f"sqlite:///{w / 'mlflow.db'}"), tracking.read_run_file(w / "ck")["run_id"]


def test_shortcut_pass_of_one_loop_logs_its_depth_share(first):
    """A shortcut pass of one loop has a depth histogram of one entry: logged as depth_share_1, not as a scalar."""
    from pipeline import tracking

    rows = tracking.read_metrics(first["w"] / "ck" / "metrics.jsonl")
    one = [r for r in rows if r.get("router/short/loops") == 1.0]
    assert one, "no step drew a one-loop shortcut pass"
    assert all(r["router/short/depth_share_1"] == 1.0 for r in one)
    assert not any(k.endswith("depth_hist") for r in rows for k in r)


@torch.no_grad()
def test_hf_export_past_block_size_is_a_value_error(first):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(first["w"] / "hf", trust_remote_code=True).eval()
    with pytest.raises(ValueError, match="input length 65 exceeds the model's block_size 64"):
        hf(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size 64"):  # generate() walking past it
        hf.generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=8, do_sample=False)


def test_generate_and_eval_read_the_hf_export(first):
    w = first["w"]
    g = tlf("generate", "hf", "-p", "the model", "-n", "3", "--seed", "0", cwd=w)
    assert g.stdout.startswith("the model")
    tlf("eval", "hf", *EVAL, "--no-mlflow", "--out", "eval_hf", cwd=w)
    res = json.loads((w / "eval_hf" / "results.json").read_text())
    want = first["results"]["budgets"][0]
    assert res["budgets"][0]["perplexity"] == want["perplexity"]  # the same network on the same val split
    assert res["budgets"][0]["tasks"]["copa"]["acc"] == want["tasks"]["copa"]["acc"]


def test_a_diverged_hf_export_is_refused_as_a_checkpoint_is(first, tmp_path):
    """Weights holding NaN are a one-line error through the HF export too (the one loader's check)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.config import ConfigError
    from pipeline.hf.load import load_any

    d = tmp_path / "hf"
    shutil.copytree(first["w"] / "hf", d)
    state = load_file(str(d / "model.safetensors"))
    state["model.wte.weight"][0, 0] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.safetensors: 1 of \d+ weight tensors hold NaN or inf"):
        load_any(d)


def test_export_model_card_holds_the_checkpoints_evaluation(first):
    """tlf eval wrote under out/eval/...; tlf export finds it by the export it read (results.json's `export`), or,
    for a copy of the run, by the training run and step (run.json)."""
    w = first["w"]
    table = (w / first["results"]["files"]["table"]).read_text()
    card = (w / "hf" / "README.md").read_text()
    assert "`tlf eval` of this checkpoint (out/eval/" in card and table in card
    shutil.copytree(w / "ck", w / "ck_copy")
    tlf("export", "ck_copy", "--format", "hf", "--out", "hf_copy", cwd=w)
    assert table in (w / "hf_copy" / "README.md").read_text()


def test_eval_names_the_mlflow_run_it_logged_to(first):
    client, train_run = mlflow_run(first["w"])
    line = next(ln for ln in first["eval"].stdout.splitlines() if "logged to MLflow run" in ln)
    assert first["results"]["mlflow_run_id"] == train_run and first["results"]["train_run_id"] == train_run
    assert f"run {train_run} (the checkpoint's training run), experiment tlf, at sqlite:///mlflow.db" in line
    assert "eval/M4/copa/acc" in client.get_run(train_run).data.metrics


def test_rerun_of_a_finished_run_says_so(first):
    """Said at once (no model, no DeepSpeed: nothing in the run dir changes). When the run's end left MLflow
    steps unsent (its run not FINISHED), the rerun still starts once, which sends them and ends the run."""
    w = first["w"]
    before = sorted(p.name for p in (w / "ck").iterdir())
    p = tlf("train", *TRAIN, "data.dir=data", "checkpoint.dir=ck", cwd=w)
    assert (
        "run already complete: checkpoint ck/global_step6 is at step 6 of schedule.max_steps=6; nothing to train"
    ) in p.stdout
    assert "raise schedule.max_steps" in p.stdout and "checkpoint.resume=none" in p.stdout
    assert "starting once more" not in p.stdout and "MLflow run" not in p.stdout  # its run is FINISHED
    assert sorted(p.name for p in (w / "ck").iterdir()) == before
    client, run_id = mlflow_run(w)
    client.update_run(run_id, status="RUNNING")  # as a run whose end found the server down
    p = tlf("train", *TRAIN, "data.dir=data", "checkpoint.dir=ck", cwd=w)
    assert "run already complete" in p.stdout and "starting once more only to send MLflow" in p.stdout
    assert client.get_run(run_id).info.status == "FINISHED"


def test_rerun_of_a_complete_prep_data_says_so(first):
    assert "wrote data/manifest.json" in first["prep"].stdout
    again = first["prep_again"].stdout
    assert "wrote" not in again and "already complete: found data/manifest.json; nothing written" in again
    assert "val: 1 shards" in again  # what it found


def test_a_tiny_val_split_gets_a_warning(first):
    assert (
        "warning: the val split rests on " in first["prep"].stderr
        and " tokens of 1 document, fewer than 10,000" in first["prep"].stderr
        and "val chosen by tokens" in first["prep"].stderr
    )
    assert "warning" not in first["prep_again"].stderr  # said once, when written


def test_table1_flops_are_the_executed_ones(first):
    b = first["results"]["budgets"][0]
    assert "| Model | FLOPs (executed) |" in first["eval"].stdout
    assert f"| T-LoopFormer (2 ⊗ 4) | {2 * b['depth']['mean']:.2f}x |" in first["eval"].stdout


def test_eval_says_the_work_before_it_starts(first):
    lines = first["eval"].stdout.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("eval: 2 examples (1 tasks)"))
    assert i < next(i for i, ln in enumerate(lines) if "M=4 copa" in ln)
    assert "x 1 budgets [4] on cpu: about 0:00:" in lines[i] and "tokens/s, measured at M=4" in lines[i]
    assert "--limit N (eval.limit" in lines[i] and "--tasks" in lines[i] and "--loops" in lines[i]


def test_failed_starts_leave_no_empty_directories(first):
    w = first["w"]
    p = tlf("train", *TRAIN, "data.dir=nodata", "checkpoint.dir=gone/ck", cwd=w, check=False)
    assert p.returncode == 1 and "nodata" in p.stderr and not (w / "gone").exists()
    p = tlf("export", "data", "--out", "gone/a/b", cwd=w, check=False)  # not a model: nothing made for --out
    assert p.returncode != 0 and "no model export" in p.stderr and not (w / "gone").exists()
    # an evaluation interrupted (Ctrl-C) once it has started scoring: its output directories are removed. The
    # SIGINT comes from inside, at an event of the run (copa scored, the perplexity about to start), so it lands
    # mid-run however fast the machine
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = ["eval", "ck", "--tasks", "copa", "--limit", "2", "--source", "offline", "--no-latency", "--no-mlflow"]
    p = subprocess.run(
        [sys.executable, "-c", CTRL_C_CHILD, *argv, "--out", "aborted/eval"],
        cwd=w,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert p.returncode != 0 and "M=4 copa" in p.stdout, p.stdout
    assert not (w / "aborted").exists()


# `tlf eval ARGS`, with Ctrl-C (SIGINT to itself) as the first perplexity set starts: after the tasks are scored.
# SIGINT raises KeyboardInterrupt as at a terminal (a job started in the background inherits it ignored).
CTRL_C_CHILD = """
import os, signal, sys
import evaluation.evaluate as ev
from pipeline.cli import main
signal.signal(signal.SIGINT, signal.default_int_handler)
real = ev.perplexity
def perplexity(*a, **kw):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*a, **kw)
ev.perplexity = perplexity
main(sys.argv[1:], prog_name="tlf")
"""


def test_config_option_accepted_wherever_a_config_is(first):
    w = first["w"]
    p = tlf("train", "--config", *TRAIN, "data.dir=data", "checkpoint.dir=ck", cwd=w, check=False)  # finished run
    assert p.returncode == 0 and "run already complete" in p.stdout, p.stdout + p.stderr
    r = CliRunner().invoke(main, ["config", "show", "--config", "tiny/t-loopformer", "schedule.max_steps=7"])
    assert r.exit_code == 0 and "max_steps: 7" in r.output, r.output
    plan = ["plan", "--config", "tiny/t-loopformer", "--gpus", "1", "--gpu", "cpu", "--sweep", "zero=1"]  # one row
    r = CliRunner().invoke(main, plan)
    assert r.exit_code == 0 and "tiny/t-loopformer on 1 x cpu" in r.output, r.output
    r = CliRunner().invoke(main, ["config", "show", "tiny/base", "--config", "tiny/t-loopformer"])
    assert r.exit_code == 2 and "two configs given" in r.output


@pytest.mark.parametrize(
    "key,hint",
    [
        ("train.max_steps=3", "(did you mean 'schedule.max_steps'?)"),
        ("train.lr=1e-3", "(did you mean 'optim.lr'?)"),
        ("optim.learning_rate=1e-3", "(did you mean 'optim.lr'?)"),
        ("train.steps=3", "(did you mean 'schedule.max_steps'?)"),
        ("optimizer.lr=1e-3", "(did you mean 'optim.lr'?)"),
        ("model.n_layer=3", "(did you mean 'model.n_layers'?)"),
        ("logging.logger_name=x", "unknown config key 'logging.logger_name'\n"),
    ],
)
def test_unknown_keys_suggest_what_other_trainers_call_them(key, hint):
    r = CliRunner().invoke(main, ["config", "show", "tiny/t-loopformer", key])
    assert r.exit_code == 2 and hint in r.output, r.output
    assert "run_name" not in r.output


def test_inherit_takes_a_preset_name(tmp_path):
    (tmp_path / "mine.yaml").write_text("inherit: tiny/t-loopformer\nschedule:\n  max_steps: 9\n")
    r = CliRunner().invoke(main, ["config", "show", str(tmp_path / "mine.yaml")])
    assert r.exit_code == 0 and "d_model: 32" in r.output and "max_steps: 9" in r.output, r.output
    (tmp_path / "typo.yaml").write_text("inherit: tiny/t-lopformer\n")
    r = CliRunner().invoke(main, ["config", "show", str(tmp_path / "typo.yaml")])
    assert r.exit_code == 2 and "'tiny/t-lopformer' not found" in r.output and "no preset has that name" in r.output


def test_eval_refuses_config_with_what_to_use(tmp_path):
    """`tlf train --config FILE` takes a config; `tlf eval` reads its checkpoint's, so its `--config` is an error that
    names --check-preset and overrides, not a silent alias of --check-preset."""
    r = CliRunner().invoke(main, ["eval", str(tmp_path), "--config", "tiny/t-loopformer"])
    assert r.exit_code == 2 and "--check-preset" in r.output and "Traceback" not in r.output, r.output
