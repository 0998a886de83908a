"""What does a fold-task probe model do? (data_prep/foldtask.py, bench/depth_probe.py grid 6.) On fresh documents:

- every looped model (a routed one's router bypassed): level 1 and 2 accuracy at the oracle depths, then with
  the level-2 query stopped after one loop, and with its left neighbour x_1 stopped after one loop (so the query
  cannot read x_1's first-loop state in loop 2): composition needs both;
- routed models: the router's continue probabilities p(2..L) at each level's query (mean over documents and
  their spread), and the executed depth of the context cells by their need, against the same network freshly
  initialised (the probe's seed).

    python bench/fold_probe_check.py bench/results/depth_probe_grid6/fold_m16_oracle_curriculum.pt

Prints one line per measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_prep import foldtask  # noqa: E402  (after the sys.path lines above)
from depth_probe import forced_depth_logits  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.model.looped import LoopedLM  # noqa: E402


def main(path: str, n: int = 2048) -> None:
    ck = torch.load(path, weights_only=False)
    cfg, s = load_config(ck["preset"], ck["overrides"]), ck["settings"]
    model = LoopedLM(cfg.model)
    model.load_state_dict(ck["state"])
    model.eval()
    L, Lm = s["levels"], cfg.model.loops
    docs = foldtask.documents(foldtask.rule(s["symbols"], 0, s.get("rule", "cyclic")), np.random.default_rng(777), n, L)
    x, y = torch.from_numpy(docs[:, :-1]), torch.from_numpy(docs[:, 1:])
    lev, need = foldtask.levels(L)[:-1], np.minimum(foldtask.need(L)[:-1], Lm)
    if Lm > 1:  # a routed model too: does its network compose when given the depths, whatever its router picks?
        q2 = int(np.flatnonzero(lev == 2)[0])  # the level-2 query; x_1 is the token before it

        @torch.no_grad()
        def acc(depth: np.ndarray) -> list[float]:
            pred = forced_depth_logits(model, x, torch.from_numpy(depth), Lm).argmax(-1)
            return [round(float((pred[:, lev == k] == y[:, lev == k]).float().mean()), 3) for k in (1, 2)]

        print("level 1, 2 at the oracle depths:", acc(need))
        a = need.copy()
        a[q2] = 1
        print("the level-2 query stopped after loop 1:", acc(a))
        b = need.copy()
        b[q2 - 1] = 1
        print("its left neighbour x_1 stopped after loop 1:", acc(b))
    if model.router is not None:
        torch.manual_seed(s["seed"])
        fresh = LoopedLM(cfg.model).eval()
        queries = np.flatnonzero(lev)
        with torch.no_grad():
            for name, m in (("trained", model), ("at init", fresh)):
                r = m.route(m.embed(x))
                c = r.cont  # (B, T, L): p(1) == 1
                mean = [[round(float(v), 3) for v in c[:, t, 1:].mean(0)] for t in queries]
                spread = [round(float(c[:, t, 1].std()), 3) for t in queries]
                print(f"{name}: p(2..{Lm}) at the level 1..{L} queries {mean}; std of p(2) over documents {spread}")
                d = r.depth(Lm, m.cfg.router_threshold).numpy()  # (B, T) executed depth
                cells = (lev == 0) & (need >= 2)  # context cells a later query must read in loop need
                by = {int(k): round(float(d[:, cells & (need == k)].mean()), 2) for k in np.unique(need[cells])}
                print(f"{name}: executed depth of the context cells by their need {by}")
                q = [round(float(d[:, t].mean()), 2) for t in queries]
                print(f"{name}: executed depth of the level 1..{L} queries {q}; of all tokens {d.mean():.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
