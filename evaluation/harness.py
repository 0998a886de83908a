"""lm-evaluation-harness model `tlf`: a LoopedLM checkpoint at loop budget M.

    python -m evaluation.harness --model tlf --model_args checkpoint=PATH,loops=4 --tasks piqa,copa
    # or, in Python:  import evaluation.harness; lm_eval.simple_evaluate(model="tlf", model_args="checkpoint=...,loops=4", ...)

`python -m evaluation.harness` is lm-eval's own CLI (`lm_eval ...`, same flags) with the `tlf` model
registered first: the harness discovers models only in its own package or in modules imported before it runs.

The harness's own tasks read their data from the Hugging Face hub (or the datasets cache). The hub is probed
first (a 3 s connect, `evaluation.tasks.hub_problem`); when it cannot be reached the run goes on in offline mode
(HF_HUB_OFFLINE, HF_DATASETS_OFFLINE: cached data and local task files still work, nothing is retried), and a
task whose data is then out of reach ends the run with one line naming the ways without the hub (`--include_path`
to task YAMLs whose data files are local, or `tlf eval --source offline` and its offline copies), exit 1.

loglikelihood uses our scorer (`evaluation.scorer.Scorer`, as `tlf eval` does: the harness's pair encoding;
the choices of a question share one run of their context by tree packing; batched, padded);
loglikelihood_rolling scores the harness's disjoint rolling windows (context 1, max length = block_size);
generate_until decodes with `pipeline.inference.generate` (recursion-wise KV cache), greedy unless the task
asks for sampling, and cuts the text at the first `until` string.
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from data_prep.tokenizer import EOT, decode, encode
from evaluation.scorer import Scorer, encode_pair
from pipeline.device import resolve_device


@register_model("tlf")
class TLFLM(LM):
    def __init__(
        self,
        checkpoint: str | None = None,
        loops: int | None = None,
        batch_size: int | str = 16,
        device: str | None = None,
        model=None,
        max_gen_toks: int = 256,
        **kwargs,
    ):
        super().__init__()
        if model is None:
            if not checkpoint:
                raise ValueError("tlf: give model_args checkpoint=PATH (an export, checkpoint or run dir)")
            from pipeline.model.io import load_model

            model, _cfg = load_model(checkpoint, "cpu")
        if str(device or "").startswith("cuda") and not torch.cuda.is_available():  # lm_eval's CLI default is cuda
            import warnings

            warnings.warn(f"tlf: device {device!r} requested but CUDA is not available; using cpu", stacklevel=2)
            device = "cpu"
        dev = resolve_device(device, "device", indexed=True)
        self.model = model.to(dev).eval()
        L = self.model.cfg.loops
        self.loops = int(loops) if loops not in (None, "") else L
        if not 1 <= self.loops <= L:
            raise ValueError(f"tlf: loops={self.loops} must lie in 1..{L} (the checkpoint's model.loops)")
        bs = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.scorer = Scorer(self.model, bs, dev)
        self.device_name = dev
        self.max_length = self.model.cfg.block_size
        self.max_gen_toks = int(max_gen_toks)

    # ------------------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(*req.args) for req in requests]
        scored = self.scorer.score(pairs, self.loops)
        out = []
        for req, s in zip(requests, scored):
            out.append((s.logprob, s.greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, (s.logprob, s.greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        pairs, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for w in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=encode(string), prefix_token=EOT, max_seq_len=self.max_length, context_len=1
                ),
            ):
                pairs.append(w)
                owner.append(r)
        scored = self.scorer.score(pairs, self.loops) if pairs else []
        totals = [0.0] * len(requests)
        for r, s in zip(owner, scored):
            totals[r] += s.logprob
        for req, t in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
        return totals

    # ------------------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from pipeline.inference import generate

        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kw = dict(req.args[1])
            key = (
                tuple(self._until(kw)),
                int(kw.get("max_gen_toks", self.max_gen_toks)),
                bool(kw.get("do_sample", False)),
                float(kw.get("temperature", 0.0) or 0.0),
            )
            groups.setdefault(key, []).append(i)
        bs = self.scorer.batch_size
        for (until, max_new, do_sample, temp), idxs in groups.items():
            max_new = max(1, min(max_new, self.max_length - 1))
            for b0 in range(0, len(idxs), bs):
                chunk = idxs[b0 : b0 + bs]
                keep = self.max_length - max_new + 1  # prompt + new tokens - 1 must fit the context
                prompts = [(encode(requests[i].args[0]) or [EOT])[-keep:] for i in chunk]
                gen = generate(
                    self.model,
                    prompts,
                    max_new_tokens=max_new,
                    temperature=temp if do_sample else 0.0,
                    loops=self.loops,
                    stop_token=EOT,
                    vocab_limit=EOT + 1,
                )
                for i, toks in zip(chunk, gen.tokens):
                    toks = [t for t in toks if t != EOT]
                    text = decode(toks)
                    for u in until:
                        if u and u in text:
                            text = text.split(u)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    @staticmethod
    def _until(kw: dict) -> list[str]:
        u = kw.get("until") or []
        return [u] if isinstance(u, str) else list(u)


OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_line(error: BaseException, why: str) -> str:
    """The one line for task data out of reach with the hub unreachable."""
    from data_prep.hf import short_error

    return (
        f"harness: task data unreachable ({short_error(error)}): the Hugging Face hub cannot be reached ({why}), "
        "and lm-evaluation-harness's tasks load their data from it or from the datasets cache. Without the hub: "
        "--include_path DIR with task YAMLs whose dataset_path/data_files are local files, or `tlf eval "
        "CHECKPOINT --source offline` (tlf's offline copies of its ten tasks)"
    )


def main() -> int:
    import os

    from evaluation.tasks import hub_problem
    from lm_eval.__main__ import cli_evaluate

    why = hub_problem()
    if why:  # fail at once instead of retrying for the hub: cached data and local files still load
        for var in OFFLINE_VARS:  # (set empty or "0" counts as off: huggingface_hub would retry for a minute)
            if os.environ.get(var, "").strip().lower() not in ("1", "true", "yes", "on"):
                os.environ[var] = "1"
    try:
        return cli_evaluate() or 0
    except (ConnectionError, FileNotFoundError) as e:  # (datasets: ConnectionError, DatasetNotFoundError)
        if not why:
            raise
        print(offline_line(e, why), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
