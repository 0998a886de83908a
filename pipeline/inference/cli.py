"""`tlf generate CHECKPOINT --prompt ...`: streams sampled text from an exported model (GPT-2 BPE)."""

from __future__ import annotations

import codecs
import sys

import click

from data_prep.clitypes import Device, Finite, IntOrZero
from data_prep.tokenizer import EOT
from pipeline.cliopts import check_loops, stored_config
from pipeline.config import ConfigError
from pipeline.device import DEVICE_HELP, resolve_device
from pipeline.inference.decode import Decoder
from pipeline.inference.generate import check_lengths, generate as generate_tokens


def get_tokenizer():
    """GPT-2 BPE via tiktoken, with the offline BPE files placed by data_prep's asset step."""
    from data_prep.tokenizer import get_encoding

    return get_encoding()


def _load_tokenizer():
    try:
        return get_tokenizer()
    except Exception as e:  # noqa: BLE001 - any failure to find the BPE files is a usage problem here
        raise click.ClickException(
            f"GPT-2 tokenizer unavailable ({type(e).__name__}: {e}). Point TIKTOKEN_CACHE_DIR at the BPE files "
            "(docs/design.md §4) or run `tlf prep-data` once to set them up."
        ) from None


class _Stream:
    """Writes tokens as they come; an incremental UTF-8 decoder joins multi-byte characters split over tokens."""

    def __init__(self, enc, show_depth: bool):
        self.enc, self.show_depth = enc, show_depth
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, step, tokens, depths):
        tok = tokens[0]
        if tok is None:
            return
        text = self.utf8.decode(self.enc.decode_single_token_bytes(tok)) if tok < self.enc.n_vocab else ""
        click.echo(text + (f"[{depths[0]}]" if self.show_depth else ""), nl=False)
        sys.stdout.flush()


def _write(model, enc, prompts, ids, show_depth: bool, kw: dict):
    """Generates and writes the text: one prompt streamed as it is produced, a batch prompt by prompt."""
    if len(prompts) == 1:
        click.echo(prompts[0], nl=False)
        out = generate_tokens(model, ids, callback=_Stream(enc, show_depth), **kw)
        click.echo()
        sys.stdout.flush()
        return out
    out = generate_tokens(model, ids, **kw)
    for b, p in enumerate(prompts):
        toks, deps = out.tokens[b], out.depths[b]
        text = "".join(f"{enc.decode([t])}[{d}]" for t, d in zip(toks, deps)) if show_depth else enc.decode(toks)
        click.echo(f"--- [{b}] ---\n{p}{text}")
    return out


@click.command("generate")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--prompt", "-p", "prompts", multiple=True, required=True, help="Prompt text (repeat for a batch).")
@click.option(
    "--max-new-tokens",
    "-n",
    default=64,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens to generate per prompt.",
)
@click.option(
    "--temperature",
    "-t",
    type=Finite(min=0),
    default=1.0,
    show_default=True,
    help="Softmax temperature (0: greedy, the most likely token; 1: the model's own distribution).",
)
@click.option(
    "--top-k",
    type=IntOrZero(1, ("off",)),
    default=50,
    show_default=True,
    help="Keep the k most likely tokens (off, or 0: sample the whole vocabulary).",
)
@click.option(
    "--top-p",
    type=Finite(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus sampling: keep the most likely tokens holding this much mass (1: off).",
)
@click.option(
    "--loops", "-M", type=click.IntRange(min=1), default=None, help="Loop budget M in 1..L (default: the training L)."
)
@click.option(
    "--threshold",
    type=Finite(0, 1, min_open=True, max_open=True),
    default=None,
    help="Router threshold theta (default: the config's model.router_threshold).",
)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None, help="Sampling seed (reproducible output).")
@click.option("--show-depth", is_flag=True, help="Print every generated token with its loop count, as text[m].")
@click.option("--stop/--no-stop", default=True, show_default=True, help="Stop a prompt at <|endoftext|>.")
@click.option("--device", type=Device(), default="auto", show_default=True, help=DEVICE_HELP)
def generate(
    checkpoint, prompts, max_new_tokens, temperature, top_k, top_p, loops, threshold, seed, show_depth, stop, device
):
    """Generate text from CHECKPOINT (an export dir, a checkpoint dir with model/, a run dir, or the directory
    `tlf export --format hf` wrote)."""
    from pipeline.hf.load import load_any

    try:
        dev = resolve_device(device, "--device", indexed=True)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    try:
        export, cfg = stored_config(checkpoint)  # not the weights: a bad --loops is said first
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    check_loops([loops] if loops else [], cfg)
    enc = _load_tokenizer()
    ids = [enc.encode_ordinary(p) or [EOT] for p in prompts]  # an empty prompt starts from <|endoftext|>
    top = max(max(i) for i in ids)
    if top >= cfg.model.vocab_size:  # a model of another vocabulary (the fold task's): it cannot read GPT-2 text
        raise click.UsageError(
            f"--prompt: {checkpoint} reads token ids below model.vocab_size={cfg.model.vocab_size}, and the "
            f"prompt's GPT-2 tokens reach {top}: this is not a text model (a fold-task checkpoint?)"
        )
    model, _ = load_any(export, dev)
    decoder = Decoder(model, loops=loops, threshold=threshold)  # (its budget checked above)
    try:
        check_lengths([len(i) for i in ids], max_new_tokens, model.cfg.block_size)
    except ValueError as e:
        raise click.UsageError(f"--prompt: {e}") from None
    kw = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token=EOT if stop else None,
        vocab_limit=enc.n_vocab,
        decoder=decoder,
    )  # budget: the decoder's
    try:
        out = _write(model, enc, prompts, ids, show_depth, kw)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if show_depth:
        d = [x for row in out.depths for x in row]
        mem = out.cache
        click.echo(
            f"mean depth {sum(d) / max(len(d), 1):.2f} of M={decoder.M}; KV cache "
            f"{mem['entries']} entries per layer vs {mem['dense_entries']} dense "
            f"({mem['ratio_to_dense']:.2f})",
            err=True,
        )
