"""Greedy generation: `tlf generate` (recursion-wise KV cache) vs the hf export's generate() (no cache: the
whole prefix recomputed each step), same weights, batch 1, CPU time (process_time), interleaved, best of N;
checks the tokens are equal.

    python bench/hf_generate.py --preset tiny/t-loopformer --prompt 32 --new 32
    python bench/hf_generate.py --preset small/t-loopformer --prompt 64 --new 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import load_config
from pipeline.export import export
from pipeline.inference import generate
from pipeline.model.io import save_model
from pipeline.model.looped import LoopedLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny/t-loopformer")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    cfg = load_config(a.preset)
    torch.manual_seed(0)
    m = LoopedLM(cfg.model).eval()
    with torch.no_grad():  # perturbed weights: loops and router depths that matter
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "src", m, cfg)
        export(str(Path(tmp) / "src"), str(Path(tmp) / "hf"), "hf")
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", trust_remote_code=True).eval()
    p = torch.randint(0, 50257, (1, a.prompt), generator=torch.Generator().manual_seed(0))
    times = {"tlf": [], "hf": []}
    for _ in range(a.repeats):
        t = time.process_time()
        g = generate(m, [p[0].tolist()], max_new_tokens=a.new, temperature=0, stop_token=None)
        times["tlf"].append(time.process_time() - t)
        t = time.process_time()
        o = hf.generate(p, max_new_tokens=a.new, do_sample=False, eos_token_id=None)
        times["hf"].append(time.process_time() - t)
    assert o[0, a.prompt :].tolist() == g.tokens[0], "tokens differ"
    t_tlf, t_hf = min(times["tlf"]), min(times["hf"])
    print(
        f"{a.preset} prompt {a.prompt} new {a.new}: tlf generate {t_tlf:.3f} CPU-s, hf generate (recompute) "
        f"{t_hf:.3f} CPU-s, hf/tlf {t_hf / t_tlf:.2f}x; tokens equal"
    )


if __name__ == "__main__":
    main()
