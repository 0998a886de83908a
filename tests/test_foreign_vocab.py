"""A model whose vocabulary is not GPT-2's (the fold task's: a few dozen ids) given GPT-2 text: `tlf generate
--prompt` and `tlf eval`'s perplexity on text shards are one-line errors before any token is scored, not an
IndexError from the embedding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from data_prep.shards import write_shard
from helpers import perturbed_tiny
from pipeline.cli import main as cli
from pipeline.model.io import save_model

SMALL = ["model.vocab_size=96", "model.block_size=32", "model.d_model=32", "model.n_heads=2", "model.d_ff=64"]


@pytest.fixture(scope="module")
def fold_like(tmp_path_factory) -> Path:
    """An export of a tiny t-loopformer with 96 token ids."""
    d = tmp_path_factory.mktemp("fold_like")
    model, cfg = perturbed_tiny(overrides=tuple(SMALL))
    save_model(d / "export", model, cfg)
    return d / "export"


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """Validation shards of GPT-2 ids (up to 50,256)."""
    d = tmp_path_factory.mktemp("text")
    write_shard(d / "t_val_000000.bin", np.random.default_rng(0).integers(0, 50257, 400))
    return d


def one_line(r, code: int) -> str:
    """The last line of a command that failed with `code` and no traceback."""
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    return [ln for ln in r.output.splitlines() if ln.strip()][-1]


def test_generate_text_prompt_on_a_small_vocabulary(fold_like):
    r = CliRunner().invoke(cli, ["generate", str(fold_like), "--prompt", "hello world", "-n", "2"])
    line = one_line(r, 2)
    assert "--prompt" in line and "model.vocab_size=96" in line and "not a text model" in line, r.output


def test_eval_perplexity_of_text_on_a_small_vocabulary(fold_like, text, tmp_path):
    argv = ["eval", str(fold_like), f"eval.ppl_dirs=[{text}]", "--tasks", "none", "--no-latency", "--no-mlflow"]
    r = CliRunner().invoke(cli, [*argv, "--out", str(tmp_path / "out")])
    line = one_line(r, 1)
    assert str(text) in line and ">= model.vocab_size (96)" in line, r.output
    assert not (tmp_path / "out").exists()
