"""A newcomer's own run with the README as the only guide, through the `tlf` command: 480 documents of their own prose
in `.jsonl.zst` with a `content` field, prep-data without `--val-every`, training with validation and an MLflow
store, two evaluations (a full one, then a quick one at one budget), compare, the transformers export, generate's
defaults, the lm-evaluation-harness adapter with the hub unreachable, and what the README's commands leave in the
checkout. Each test is one thing such a run got wrong; the runs are made once (`run`) and shared."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from helpers import tlf_all

REPO = Path(__file__).resolve().parent.parent
DOCS, WORDS = 480, 200  # about 270 GPT-2 tokens a document: 126k tokens
TRAIN = [
    "tiny/t-loopformer",
    "data.dir=data/mine",
    "schedule.max_steps=6",
    "train.eval_interval=3",
    "checkpoint.interval=0",
    "train.device=cpu",
    "logging.tracking_uri=sqlite:///mlflow.db",
]
# the full evaluation, then a quick one at one budget (race has no offline copy here: skipped, its note names a path)
EVAL_FULL = ["--loops", "1,2,4", "--tasks", "copa,race", "--limit", "4", "--source", "offline", "--no-latency"]
EVAL_QUICK = ["--loops", "1", "--tasks", "copa,race", "--limit", "2", "--source", "offline"]


def tlf(*args, cwd: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert not check or p.returncode == 0, p.stdout + p.stderr
    return p


def corpus(d: Path, docs: int = DOCS) -> None:
    """`docs` documents of real English (the demo corpus cut into pieces of WORDS words) in two .jsonl.zst files
    whose text field is `content`."""
    from data_prep.assets import ensure_assets

    words = " ".join(json.loads(ln)["text"] for ln in open(ensure_assets()["demo"])).split()
    texts = [" ".join(words[i : i + WORDS]) for i in range(0, docs * 1000, 1000)][:docs]
    d.mkdir(parents=True)
    half = len(texts) // 2
    for k, part in enumerate((texts[:half], texts[half:])):
        lines = "".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(part))
        (d / f"part{k}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))


def prep(w: Path, out: str, *extra) -> subprocess.CompletedProcess:
    return tlf("prep-data", "--input", "corpus/**/*.jsonl.zst", "--text-field", "content", "--out", out, *extra, cwd=w)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The newcomer's commands in order (one child, `tlf_all`), and two more that read the checkpoint: an evaluation
    on few perplexity tokens and generate with the whole vocabulary."""
    w = tmp_path_factory.mktemp("newcomer")
    corpus(w / "corpus")
    out = {"w": w, "prep": prep(w, "data/mine", "--no-progress")}
    few = ["--loops", "4", "--tasks", "none", "--ppl-tokens", "500", "--no-latency", "--no-mlflow"]
    commands = {
        "train": ["train", *TRAIN, "checkpoint.dir=ck"],
        "eval_full": ["eval", "ck", *EVAL_FULL, "logging.tracking_uri=sqlite:///mlflow.db"],
        "eval_quick": ["eval", "ck", *EVAL_QUICK, "logging.tracking_uri=sqlite:///mlflow.db"],
        "compare": ["compare", "--tracking-uri", "sqlite:///mlflow.db", "--out", "cmp"],
        "export": ["export", "ck", "--format", "hf", "--out", "exports/mine-hf"],
        "eval_few": ["eval", "ck", *few],
        "generate": ["generate", "ck", "--prompt", "The history of", "-n", "4", "--seed", "0", "--top-k", "off"],
    }
    return {**out, **tlf_all(commands, w)}  # (helpers.tlf_all: in one child)


def manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


# ------------------------------------------------------------------------------------------ the validation split
def test_the_val_split_is_chosen_by_tokens_without_val_every(run):
    m = manifest(run["w"] / "data" / "mine")
    val, train = m["splits"]["val"], m["splits"]["train"]
    assert val["tokens"] >= 10_000 and val["docs"] >= 20  # not one document of 1,000
    assert 0.05 < val["tokens"] / m["total_tokens"] < 0.15  # 10% while val is under 10,000 tokens
    assert m["val_rule"].startswith("by tokens") and "10,000" in m["val_rule"]
    assert "warning" not in run["prep"].stderr  # large enough: nothing to warn of
    assert f"val: 1 shards, {val['tokens']:,} tokens, {val['docs']} documents" in run["prep"].stdout
    assert train["docs"] + val["docs"] == DOCS


def test_val_documents_are_spread_through_the_input(run):
    """Every document of val decoded from the shards is one of the corpus's, and they come from both files."""
    from data_prep.shards import ShardSet
    from data_prep.tokenizer import EOT, decode

    val = ShardSet(run["w"] / "data" / "mine", "val")
    toks = val.read(0, val.num_tokens).tolist()
    cuts = [i for i, t in enumerate(toks) if t == EOT] + [len(toks)]
    texts = [decode(toks[a + 1 : b]) for a, b in zip(cuts, cuts[1:])]
    lines = {}
    for k in (0, 1):
        raw = zstandard.ZstdDecompressor().decompress((run["w"] / "corpus" / f"part{k}.jsonl.zst").read_bytes())
        lines.update({json.loads(ln)["content"]: k for ln in raw.decode().splitlines()})
    assert all(t in lines for t in texts) and {lines[t] for t in texts} == {0, 1}


def test_the_token_rule_is_the_same_for_any_worker_count_and_across_resumes(run, tmp_path, monkeypatch):
    from data_prep import prep as prep_mod
    from data_prep.config import load_prep_config

    w = run["w"]
    ref = {p.name: p.read_bytes() for p in (w / "data" / "mine").glob("*.bin")}
    opts = dict(inputs=[str(w / "corpus" / "*.jsonl.zst")], text_field="content", progress=False, shard_tokens=3000)
    prep_mod.prepare(load_prep_config(values={**opts, "out": str(tmp_path / "two"), "workers": 2}), log=print)
    small = {p.name: p.read_bytes() for p in (tmp_path / "two").glob("*.bin")}
    assert sum("_val_" in n for n in small) >= 3  # val spans shards

    calls = {"n": 0}
    orig = prep_mod._Run._checkpoint

    class Stop(Exception):
        pass

    def checkpoint(self, *a, **k):  # interrupted right after the 2nd, then the 7th shard
        orig(self, *a, **k)
        calls["n"] += 1
        if calls["n"] in (2, 7):
            raise Stop

    monkeypatch.setattr(prep_mod._Run, "_checkpoint", checkpoint)
    cfg = load_prep_config(values={**opts, "out": str(tmp_path / "resumed"), "workers": 0, "batch_bytes": 20000})
    for _ in range(2):
        with pytest.raises(Stop):
            prep_mod.prepare(cfg, log=print)
    monkeypatch.setattr(prep_mod._Run, "_checkpoint", orig)
    prep_mod.prepare(cfg, log=print)
    assert {p.name: p.read_bytes() for p in (tmp_path / "resumed").glob("*.bin")} == small
    joined = lambda d, s: b"".join(d[n][1024:] for n in sorted(d) if f"_{s}_" in n)  # tokens without headers
    assert all(joined(small, s) == joined(ref, s) for s in ("train", "val"))  # shard size aside, the same split


def test_a_small_corpus_is_warned_of_by_every_reader_of_its_split(tmp_path):
    corpus(tmp_path / "corpus", docs=60)
    p = prep(tmp_path, "data/small", "--no-progress", "-j", "0")
    val = manifest(tmp_path / "data" / "small")["splits"]["val"]
    assert val["tokens"] < 10_000
    assert f"warning: the val split rests on {val['tokens']:,} tokens of {val['docs']} documents" in p.stderr
    assert "--val-every N" in p.stderr
    t = tlf("train", *TRAIN, "data.dir=data/small", "checkpoint.dir=ck", "logging.mlflow=false", cwd=tmp_path)
    assert f"warning: val/loss: data/small's val split rests on {val['tokens']:,} tokens" in t.stderr


# ------------------------------------------------------------------------------------------ what each figure rests on
def test_training_states_the_tokens_its_validation_loss_rests_on(run):
    from pipeline.tracking import read_run_file

    line = next(ln for ln in run["train"].stdout.splitlines() if "val/loss rests on" in ln)
    tags = read_run_file(run["w"] / "ck")["tags"]
    # tiny: eval_batches 4 x micro-batch 4 windows of 64 tokens
    assert f"rests on {tags['val_tokens']:,} tokens (16 windows of 64" in line and "data/mine's val split" in line
    assert tags["val_split_tokens"] == manifest(run["w"] / "data" / "mine")["splits"]["val"]["tokens"]


def test_eval_states_its_perplexity_tokens_and_warns_when_they_are_few(run):
    out = run["eval_full"].stdout
    assert re.search(r"ppl \S+: [\d.]+ \([\d,]+ tokens of data/mine val\)", out)
    few = run["eval_few"]  # --loops 4 --tasks none --ppl-tokens 500
    assert "eval: warning: the perplexity on" in few.stdout and "rests on 500 tokens" in few.stdout
    assert "500 tokens, context 64" in few.stdout and "**warning**: it rests on 500 tokens" in few.stdout


def test_eval_estimate_counts_latency(run):
    quick = run["eval_quick"].stdout
    line = next(ln for ln in quick.splitlines() if ln.startswith("eval: ") and " about " in ln)
    assert re.search(r"about \d:\d\d:\d\d \(.*; latency \d:\d\d:\d\d of it\)", line) and "--no-latency" in line
    full = next(ln for ln in run["eval_full"].stdout.splitlines() if ln.startswith("eval: ") and " about " in ln)
    assert "latency" not in full.split("To cut it")[0]  # --no-latency: none to count


def test_the_estimate_adds_the_latency_protocols_time(monkeypatch):
    """The latency sample's time, scaled by M / the largest budget, is part of the estimate."""
    from types import SimpleNamespace

    from evaluation import estimate

    monkeypatch.setattr(estimate, "latency_seconds", lambda model, M, dev: 2800.0)
    monkeypatch.setattr(estimate, "tokens_per_second", lambda *a: 1e9)
    cfg = SimpleNamespace(model=SimpleNamespace(block_size=8), eval=SimpleNamespace(latency=True, batch_size=1))
    inp = SimpleNamespace(tasks={}, requests={}, windows=[3])
    line = estimate.estimate_line(None, cfg, inp, [(1, 1), (2, 2), (4, 4)], "cpu")
    assert "about 1:21:40" in line and "latency 1:21:40 of it" in line  # 2800 s x (1 + 2 + 4) / 4
    cfg.eval.latency = False
    assert "about 0:00:00" in estimate.estimate_line(None, cfg, inp, [(4, 4)], "cpu")


# ------------------------------------------------------------------------------------------ compare
def table(path: Path) -> list[dict]:
    return list(csv.DictReader(open(path)))


def test_compare_keeps_every_budget_and_says_what_each_row_was_evaluated_with(run):
    rows = {r["Model (M)"]: r for r in table(run["w"] / "cmp" / "table1.csv")}
    assert list(rows) == ["t-loopformer (M=1)", "t-loopformer (M=2)", "t-loopformer (M=4)"]
    assert [rows[k]["limit"] for k in rows] == ["2", "4", "4"]  # M=1 from the quick evaluation, the newest
    assert [rows[k]["budgets"] for k in rows] == ["1", "1,2,4", "1,2,4"]
    e = [rows[k]["evaluation"] for k in rows]
    assert e[0] != e[1] == e[2]
    md = (run["w"] / "cmp" / "compare.md").read_text()
    assert f"- {e[0]}: t-loopformer, MLflow run" in md and "limit 2, tasks copa, budgets 1; rows M=1" in md
    assert f"- {e[1]}: t-loopformer" in md and "limit 4, tasks copa, budgets 1,2,4; rows M=2, M=4" in md
    assert re.search(r"- PPL \S+: [\d,]+ tokens of data/mine \(val\)", md)
    assert "limit" in run["compare"].stdout and "evaluation" in run["compare"].stdout


def test_table3_tokens_per_second_is_the_runs_average(run):
    from pipeline.tracking import read_metrics

    last = read_metrics(run["w"] / "ck" / "metrics.jsonl")[-1]
    row = table(run["w"] / "cmp" / "table3.csv")[0]
    assert float(row["tokens/s"]) == pytest.approx(last["train_tokens"] / last["train_time_s"], rel=1e-6)
    assert last["train_tokens"] == 6 * 4 * 64  # every step's tokens (tiny: batch 4 x 64)
    assert float(row["tokens/s"]) != pytest.approx(last["tokens_per_s"], rel=1e-6)
    assert int(float(row["val tokens"])) == 16 * 64
    assert "tokens/s: the run's average" in (run["w"] / "cmp" / "compare.md").read_text()


def test_the_runs_training_time_and_tokens_carry_over_a_resume(run):
    from pipeline.tracking import read_metrics

    w, base = run["w"], [*TRAIN, "checkpoint.dir=ck2", "checkpoint.interval=2", "logging.mlflow=false"]
    tlf("train", *base, "schedule.max_steps=3", cwd=w)  # a checkpoint at step 2, the end at 3
    (w / "ck2" / "global_step3").rename(w / "ck2" / "dropped")  # as if killed after step 3 but before its save
    (w / "ck2" / "latest").write_text("global_step2")
    first = {r["step"]: r for r in read_metrics(w / "ck2" / "metrics.jsonl")}
    again = tlf("train", *base, "schedule.max_steps=6", cwd=w)
    assert "resumed from ck2/global_step2" in again.stdout
    rows = {r["step"]: r for r in read_metrics(w / "ck2" / "metrics.jsonl")}
    assert [rows[s]["train_tokens"] for s in range(1, 7)] == [k * 4 * 64 for k in range(1, 7)]
    assert rows[3]["train_time_s"] > first[2]["train_time_s"] and rows[2] == first[2]  # step 2's time carried over


# ------------------------------------------------------------------------------------------ export, generate
ABSOLUTE = re.compile(r"(?<![\w.~:/>…])/(?:[\w.+@%=,-]+/)+[\w.+@%=,-]*")  # (…/a/b, <tlf cache>/a: not absolute)


def test_the_export_holds_no_absolute_local_path(run):
    d = run["w"] / "exports" / "mine-hf"
    card = (d / "README.md").read_text()
    assert "race skipped" in card and "<tlf cache>/race/high_test.jsonl does not exist" in card
    assert "| validation split | 10," in card  # the tokens it rests on
    for f in ("README.md", "config.json", "generation_config.json", "tokenizer_config.json"):
        text = (d / f).read_text()
        assert not ABSOLUTE.search(text), (f, ABSOLUTE.search(text).group(0))
        assert str(run["w"]) not in text and str(Path.home()) not in text


def test_generate_samples_sanely_by_default_and_the_export_does_the_same(run):
    from pipeline.inference import SAMPLING
    from pipeline.inference.cli import generate

    defaults = {p.name: p.default for p in generate.params}
    assert (defaults["temperature"], defaults["top_k"]) == (SAMPLING["temperature"], SAMPLING["top_k"]) == (1.0, 50)
    gen = json.loads((run["w"] / "exports" / "mine-hf" / "generation_config.json").read_text())
    assert gen["do_sample"] is True and gen["temperature"] == 1.0 and gen["top_k"] == 50
    out = run["generate"]  # --prompt "The history of" --top-k off
    assert out.stdout.startswith("The history of")  # the whole vocabulary: one flag away


# ------------------------------------------------------------------------------------------ the harness offline
def test_the_harness_adapter_offline_is_one_line_naming_the_local_routes(run):
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": ""}
    p = subprocess.run(
        [sys.executable, "-m", "evaluation.harness", "--model", "tlf", "--model_args", "checkpoint=ck,loops=2",
         "--tasks", "copa", "--limit", "1"],
        cwd=run["w"], env={**os.environ, "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True,
    )  # fmt: skip
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("harness: task data unreachable") and "--include_path" in last
    assert "tlf eval CHECKPOINT --source offline" in last and "127.0.0.1:9" in last


# ------------------------------------------------------------------------------------------ the README
def readme_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Your own data, end to end", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_what_the_readme_commands_write_is_git_ignored():
    if not shutil.which("git") or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    written = ["mlflow.db", "mlartifacts/0/x", "checkpoints/small-loopformer/x"]
    for ln in readme_block():
        written += [m.group(1) + "/x" for m in re.finditer(r"--out (\S+)", ln)]
        written += [m.group(1) + "/x" for m in re.finditer(r"data\.dir=(\S+)", ln)]
    assert {"exports/mine-hf/x", "out/compare-mine/x", "data/mine/x"} <= set(written)
    for path in written:
        p = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert p.returncode == 0, f"{path}: written by README's commands, not git-ignored"


def test_the_readme_server_fits_a_laptop_and_long_commands_say_how_long():
    lines = readme_block()
    server = next(ln for ln in lines if "mlflow server " in ln)
    assert "--workers 1" in server and "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in server
    for i, ln in enumerate(lines):
        if ln.startswith("tlf train") or ln.startswith("tlf eval"):
            start = max(k for k in range(i) if re.match(r"# \d\.", lines[k]))  # the step's comment, all its lines
            comment = " ".join(lines[start:i])
            assert re.search(r"about \d+ (min|h)", comment), (ln, comment)
