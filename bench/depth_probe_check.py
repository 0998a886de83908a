"""What does a depth-probe model read? Accuracy by level at every budget M on fresh depth-hops documents, then
with the parent array (or one distance group of it) taken from another document: a model that answers from
the array falls to chance where it read the replaced entries.

    python bench/depth_probe_check.py bench/results/depth_probe/<probe>.pt

(`bench/depth_probe.py` saves `<probe>.pt` beside its JSON.) Prints one line per measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep.depthtask import layout, levels_at, make_document  # noqa: E402  (after the sys.path line)
from pipeline.config import load_config  # noqa: E402
from pipeline.model.looped import LoopedLM  # noqa: E402


def main(path: str, docs_n: int = 1024) -> None:
    ck = torch.load(path, weights_only=False)
    cfg = load_config(ck["preset"], ck["overrides"])
    model = LoopedLM(cfg.model)
    model.load_state_dict(ck["state"])
    model.eval()
    s = ck["settings"]
    R, L, Q = s["R"], s["L"], s["Q"]
    task, n = layout(R, L), R * (L + 1)
    docs = np.stack([make_document(777, i, R, L, Q) for i in range(docs_n)])  # a seed no probe trains on

    def acc(d: np.ndarray, M: int) -> list[float]:
        x, y = d[:, :-1], d[:, 1:]
        lev = levels_at(x, task)
        with torch.no_grad():
            pred = model(torch.from_numpy(x), loops=M).logits.argmax(-1).numpy()
        return [round(float((pred == y)[lev == k].mean()), 3) for k in range(1, L + 1)]

    Ms = range(1, cfg.model.loops + 1)
    print("accuracy by level 1..L at M =", {M: acc(docs, M) for M in Ms})
    swapped = docs.copy()
    swapped[:, 1 : 1 + n] = np.roll(docs[:, 1 : 1 + n], 1, axis=0)  # the previous document's parent array
    print("parent array from another document:", {M: acc(swapped, M) for M in Ms})
    for j in range(L, -1, -1):  # the entries of the nodes at distance j (labels numbered farthest first)
        start = 1 + (L - j) * R
        d = docs.copy()
        d[:, start : start + R] = np.roll(docs[:, start : start + R], 1, axis=0)
        print(f"distance-{j} entries from another document:", {M: acc(d, M) for M in Ms})


if __name__ == "__main__":
    main(sys.argv[1])
