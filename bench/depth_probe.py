"""Depth-task learnability probe: can the task's model learn the task at all, given far more steps than a CPU
study affords, and which optimiser settings and task sizes make it learnable?

A plain training loop (AdamW, constant LR after a short warmup, no DeepSpeed) on the real `LoopedLM` of a
`depth/*` preset, on fresh depth-hops documents (data_prep/depthtask.py make_document, the generator
`tlf prep-data --source depth-hops` writes), one process per probe, for `--minutes` of wall time each, all
probes at once (settings `"task": "fold"`: the fold task of data_prep/foldtask.py instead, 1024 held-out documents;
`"depth": "oracle"` trains every token at its need and adds the budget "oracle"; `"depth"` names another forced
map of `forced_depth` ("segment", "oracle+1", "oracle+2") in the same way, and `"jitter": (lo, hi)` moves each
training document's map by a draw from lo..hi, `"scramble": p` replaces each training token's depth by a uniform
draw from 1..L with probability p; `"exits": name` runs every token through every loop and scores each answer at
the exits `EXITS[name]` gives its level, "need" being level k at exit k). Every `--eval-every` steps: answer
accuracy by level at every loop budget M on 512 held-out documents; for a routed model on the fold task also the executed depth against need and
`at_need`, the accuracy with its router bypassed and every token at the oracle's depth. With the override
`model.exited_keys=frozen` (exited tokens stay readable by later loops) the needs, the oracle and the target
`need` are that model's (data_prep/foldtask.py `need(L, visible=True)`). This measures the task and the
architecture, not the trainer: `bench/depth_need.py` is the study through the project's trainer.

    python bench/depth_probe.py --device cuda --minutes 7.4 --eval-every 1000          # grid 1, on one GPU
    python bench/depth_probe.py --device cuda --minutes 4.2 --eval-every 500 --grid 2  # grid 2
    python bench/depth_probe.py --device cpu --grid 3 --steps 3000 --minutes 60 --jobs 2  # grid 3, on 2 CPU cores
    python bench/depth_probe.py --device cpu --grid 6 --minutes 10 --jobs 2 --eval-every 200  # the fold task, 2 cores
    python bench/depth_probe.py --device cpu --minutes 1 --probes base-loop            # smoke

Writes `<out>/depth_probe.json` (out: bench/results/depth_probe): per probe its settings, steps run, and the
accuracy curve [{step, acc: {M: [overall, level 1..L]}}]; `<out>/<probe>.pt`: the trained weights, preset and
overrides.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from interleave import write_json  # noqa: E402  (after the sys.path lines above)
from pipeline.demo import EXPECTED_RECIPE  # noqa: E402  (after the sys.path lines above)

D128 = ["model.d_model=128", "model.n_heads=4", "model.d_ff=512"]
# name -> (preset, model overrides, probe settings); task: chains R, levels L, queries Q.
# Grid 1: what makes the task learnable (optimiser, width, task size, which variants); grid 2: the router on
# the sizes grid 1 found learnable.
GRID1 = {
    "base-loop": ("depth/base-loop", [], {}),
    "base-loop lr1e-3": ("depth/base-loop", [], {"lr": 1e-3}),
    "base-loop d128": ("depth/base-loop", D128, {"lr": 1e-3}),
    "base-loop wd0.1 b2.95": ("depth/base-loop", [], {"wd": 0.1, "beta2": 0.95}),
    "base-loop R4": ("depth/base-loop", [], {"R": 4}),
    "base-loop L3": ("depth/base-loop", [], {"L": 3, "Q": 3}),
    "base-loop 2 layers": ("depth/base-loop", ["model.n_layers=2"], {}),
    "base (4 layers)": ("depth/base", [], {}),
    "loopformer": ("depth/loopformer", [], {}),
    "tmlt": ("depth/tmlt", [], {}),
    "base-loop batch64": ("depth/base-loop", [], {"batch": 64}),
    "base-loop lr1e-2": ("depth/base-loop", [], {"lr": 1e-2}),
    "base-loop L2": ("depth/base-loop", [], {"L": 2}),
    "base-loop d128 L2": (
        "depth/base-loop",
        D128,
        {"L": 2, "lr": 1e-3},
    ),
    "loopformer d128": ("depth/loopformer", D128, {"lr": 1e-3}),
}
GRID2 = {
    "L2 loopformer": ("depth/loopformer", [], {"L": 2}),
    "L2 loopformer s1": ("depth/loopformer", [], {"L": 2, "seed": 1}),
    "L2 t-loopformer budget need": ("depth/t-loopformer", ["model.router_recipe=budget"], {"L": 2, "target": "need"}),
    "L2 t-loopformer budget need s1": (
        "depth/t-loopformer",
        ["model.router_recipe=budget"],
        {"L": 2, "target": "need", "seed": 1},
    ),
    "L2 t-loopformer paper": ("depth/t-loopformer", ["model.router_recipe=paper"], {"L": 2}),
    "L3 loopformer d128": ("depth/loopformer", D128, {"L": 3, "Q": 3, "lr": 1e-3}),
    "L3 t-loopformer d128 budget need": (
        "depth/t-loopformer",
        [*D128, "model.router_recipe=budget"],
        {"L": 3, "Q": 3, "lr": 1e-3, "target": "need"},
    ),
    "L3 t-loopformer d128 paper": (
        "depth/t-loopformer",
        [*D128, "model.router_recipe=paper"],
        {"L": 3, "Q": 3, "lr": 1e-3},
    ),
}
# Grid 3: at L = 2 (learnt by base-loop in 2-4k steps), which part of the LoopFormer recipe stops learning:
# time conditioning alone, the shortcut pass + alignment alone, conditioning with zero-weight auxiliary losses,
# the router on top of that; and the same with the modulated layers' gates initialised at 1.
NO_AUX = ["objective.lambda_short=0", "objective.lambda_align=0"]
GRID3 = {
    "L2 base-loop": ("depth/base-loop", [], {"L": 2}),
    "L2 tmlt": ("depth/tmlt", [], {"L": 2}),
    "L2 base-loop-ee-align": ("depth/base-loop-ee-align", [], {"L": 2}),
    "L2 loopformer no aux": ("depth/loopformer", NO_AUX, {"L": 2}),
    "L2 t-loopformer budget need no aux": (
        "depth/t-loopformer",
        [*NO_AUX, "model.router_recipe=budget"],
        {"L": 2, "target": "need"},
    ),
    # modulated layers starting as plain pre-norm layers (gates 1) instead of the identity (adaLN-zero)
    "L2 tmlt gate1": ("depth/tmlt", ["model.gate_init=1"], {"L": 2}),
    "L2 one layer": ("depth/base", [], {"L": 2, "layers": 1}),
    "L2 loopformer gate1 scored": (
        "depth/loopformer",
        ["model.gate_init=1", "objective.align_positions=scored"],
        {"L": 2},
    ),
    "L2 loopformer gate1": ("depth/loopformer", ["model.gate_init=1"], {"L": 2}),
    "L2 t-loopformer budget need gate1": (
        "depth/t-loopformer",
        ["model.gate_init=1", "model.router_recipe=budget"],
        {"L": 2, "target": "need"},
    ),
}
# Grid 4: many chains. At R = 6 one layer of width 64 answers two-hop queries in one loop (it binds the few
# entries' positions and contents in superposition), so d* was not a lower bound; with R = 16 or 32 chains the
# map a query would have to hold grows past the width. Does the looped model still learn, does one layer fail?
G1 = ["model.gate_init=1"]
R32 = {"R": 32, "Q": 16}
GRID4 = {
    "L2R32 base-loop": ("depth/base-loop", [], {"L": 2, **R32}),
    "L2R32 one layer": ("depth/base", [], {"L": 2, "layers": 1, **R32}),
    "L2R32 two layers": ("depth/base", [], {"L": 2, "layers": 2, **R32}),
    "L2R32 base-loop batch64": ("depth/base-loop", [], {"L": 2, "batch": 64, **R32}),
    "L2R16 base-loop": ("depth/base-loop", [], {"L": 2, "R": 16, "Q": 8}),
    "L2R16 one layer": ("depth/base", [], {"L": 2, "layers": 1, "R": 16, "Q": 8}),
    "L2R32 loopformer gate1 scored": ("depth/loopformer", [*G1, "objective.align_positions=scored"], {"L": 2, **R32}),
    "L2R32 t-loopformer budget need gate1 scored": (
        "depth/t-loopformer",
        [*G1, "objective.align_positions=scored", "model.router_recipe=budget"],
        {"L": 2, "target": "need", **R32},
    ),
    "L3R32 base-loop": ("depth/base-loop", [], {"L": 3, **R32}),
    "L3R32 loopformer gate1 scored": ("depth/loopformer", [*G1, "objective.align_positions=scored"], {"L": 3, **R32}),
    "L3R32 t-loopformer budget need gate1 scored": (
        "depth/t-loopformer",
        [*G1, "objective.align_positions=scored", "model.router_recipe=budget"],
        {"L": 3, "target": "need", **R32},
    ),
    "L4R32 base-loop": ("depth/base-loop", [], {"L": 4, **R32}),
    "L3R32 base-loop d128": ("depth/base-loop", D128, {"L": 3, "lr": 1e-3, **R32}),
    "L2R8 base-loop": ("depth/base-loop", [], {"L": 2, "R": 8, "Q": 4}),
    "L2R8 one layer": ("depth/base", [], {"L": 2, "layers": 1, "R": 8, "Q": 4}),
    "L2R12 base-loop": ("depth/base-loop", [], {"L": 2, "R": 12, "Q": 6}),
    "L2R12 one layer": ("depth/base", [], {"L": 2, "layers": 1, "R": 12, "Q": 6}),
    "L2R12 loopformer gate1 scored": (
        "depth/loopformer",
        [*G1, "objective.align_positions=scored"],
        {"L": 2, "R": 12, "Q": 6},
    ),
    "L2R12 t-loopformer budget need gate1 scored": (
        "depth/t-loopformer",
        [*G1, "objective.align_positions=scored", "model.router_recipe=budget"],
        {"L": 2, "target": "need", "R": 12, "Q": 6},
    ),
}
# Grid 5: labels nearest-first, so an entry may read its parent's entry and chains can be followed by pointer
# doubling (each loop, every entry replaces its pointer by its pointer's pointer): a level-k query then needs
# 1 + ceil(log2 k) loops of one layer, the same operation in every loop.
NEAR8 = {"order": "near", "R": 8, "Q": 4, "levels": 4}
NEAR16 = {"order": "near", "R": 16, "Q": 8, "levels": 4}
NEAR32 = {"order": "near", "R": 32, "Q": 16, "levels": 4}
GRID5 = {
    "near L3 lv4 R8 base-loop": ("depth/base-loop", [], {"L": 3, **NEAR8}),
    "near lv4 R8 one layer": ("depth/base", [], {"L": 3, "layers": 1, **NEAR8}),
    "near lv4 R8 two layers": ("depth/base", [], {"L": 3, "layers": 2, **NEAR8}),
    "near L3 lv4 R8 base-loop d128": ("depth/base-loop", D128, {"L": 3, "lr": 1e-3, **NEAR8}),
    # many chains, where one layer did not learn two hops under the far order (grid 4)
    "near L3 lv4 R16 base-loop": ("depth/base-loop", [], {"L": 3, **NEAR16}),
    "near lv4 R16 one layer": ("depth/base", [], {"L": 3, "layers": 1, **NEAR16}),
    "near lv4 R16 two layers": ("depth/base", [], {"L": 3, "layers": 2, **NEAR16}),
    "near L3 lv4 R32 base-loop": ("depth/base-loop", [], {"L": 3, **NEAR32}),
    "near lv4 R32 one layer": ("depth/base", [], {"L": 3, "layers": 1, **NEAR32}),
    "near L3 lv4 R32 base-loop d128": ("depth/base-loop", D128, {"L": 3, "lr": 1e-3, **NEAR32}),
    "near L3 lv4 R32 loopformer gate1 scored": (
        "depth/loopformer",
        [*G1, "objective.align_positions=scored"],
        {"L": 3, **NEAR32},
    ),
}
# Grid 6: the fold task (data_prep/foldtask.py: a left fold of a non-associative operation on m symbols, one step per
# loop). One layer would need the m^(k+1)-entry table of a k-fold; the looped model g's m^2 entries, reused.
# "depth": "oracle" runs every token the loops it needs (no router: what a perfect router would give);
# "curriculum": scores levels 1..c, raising c when each is >= 0.9.
F16 = {"task": "fold", "symbols": 16, "levels": 4, "L": 4, "lr": 1e-3}
CUR = {"curriculum": True}
GRID6 = {
    "fold m16 one layer": ("depth/base", [], {**F16, "layers": 1}),
    "fold m16 two layers": ("depth/base", [], {**F16, "layers": 2}),
    "fold m16 one layer curriculum": ("depth/base", [], {**F16, "layers": 1, **CUR}),
    "fold m16 base-loop": ("depth/base-loop", [], F16),
    "fold m16 base-loop curriculum": ("depth/base-loop", [], {**F16, **CUR}),
    "fold m16 oracle": ("depth/base-loop", [], {**F16, "depth": "oracle"}),
    "fold m16 oracle curriculum": ("depth/base-loop", [], {**F16, "depth": "oracle", **CUR}),
    "fold m16 loopformer gate1 scored curriculum": (
        "depth/loopformer",
        [*G1, "objective.align_positions=scored"],
        {**F16, **CUR},
    ),
    "fold m16 t-loopformer budget need gate1 scored curriculum": (
        "depth/t-loopformer",
        [*G1, "objective.align_positions=scored", "model.router_recipe=budget"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m8 one layer": ("depth/base", [], {**F16, "symbols": 8, "layers": 1}),
    "fold m8 base-loop": ("depth/base-loop", [], {**F16, "symbols": 8}),
}
# Grid 7: the budget router with exploration (objective.router_explore): a share of the tokens runs a depth drawn
# from the prior, so a token that exits early still tells its router whether deeper loops help.
TLF = [*G1, "objective.align_positions=scored", "model.router_recipe=budget"]
FIXES = [  # exploration, the log-space factor, the factor on attention values, no entropy term
    "objective.router_explore=0.25",
    "objective.router_ste_log=true",
    "objective.router_ste_keys=true",
    "objective.router_entropy_weight=0",
]
NEXT8 = [  # FIXES, half the windows of 8 positions explored one loop past the router's own depth
    *TLF,
    *FIXES,
    "objective.router_explore=0.5",
    "objective.router_explore_span=8",
    "objective.router_explore_draw=next",
]
GRID7 = {
    "fold m16 t-loopformer explore 0.25 curriculum": (
        "depth/t-loopformer",
        [*TLF, "objective.router_explore=0.25"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 0.25 no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, "objective.router_explore=0.25", "objective.router_entropy_weight=0"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 0.25 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, "objective.router_explore=0.25", "objective.router_ste_log=true", "objective.router_entropy_weight=0"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 1 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, "objective.router_explore=1", "objective.router_ste_log=true", "objective.router_entropy_weight=0"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 0.25 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 1 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES, "objective.router_explore=1"],
        {**F16, **CUR, "target": "need"},
    ),
    # m = 32: the two-fold table has 32,768 entries (m = 16: 4,096, which one layer learns): does level 2 then
    # isolate depth (one layer fails, the oracle composes)?
    "fold m32 one layer curriculum": ("depth/base", [], {**F16, "symbols": 32, "layers": 1, **CUR}),
    "fold m32 oracle curriculum": ("depth/base-loop", [], {**F16, "symbols": 32, "depth": "oracle", **CUR}),
    # what a router's exploration could give at best: every token of a segment at its query's need (one draw per
    # segment, right), or every token one loop past its need
    "fold m16 segment depth curriculum": ("depth/base-loop", [], {**F16, "depth": "segment", **CUR}),
    "fold m16 oracle+1 curriculum": ("depth/base-loop", [], {**F16, "depth": "oracle+1", **CUR}),
    "fold m16 oracle+2 curriculum": ("depth/base-loop", [], {**F16, "depth": "oracle+2", **CUR}),
    # the oracle's map, each training document's moved by a draw from lo..hi (clipped to 1..L; evaluated at the
    # map itself): mixed depths, above or below the need
    "fold m16 oracle jitter 1 curriculum": ("depth/base-loop", [], {**F16, "depth": "oracle", "jitter": (0, 1), **CUR}),
    "fold m16 oracle jitter -1 curriculum": (
        "depth/base-loop",
        [],
        {**F16, "depth": "oracle", "jitter": (-1, 0), **CUR},
    ),
    # exploration in windows of 8 positions (objective.router_explore_span): in this 21-position layout every
    # segment's cells and query fall inside one window, so an explored window runs them at one depth
    "fold m16 t-loopformer explore 0.5 span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES, "objective.router_explore=0.5", "objective.router_explore_span=8"],
        {**F16, **CUR, "target": "need"},
    ),
    "fold m16 t-loopformer explore 1 span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES, "objective.router_explore=1", "objective.router_explore_span=8"],
        {**F16, **CUR, "target": "need"},
    ),
    # exploration one loop past the router's own depth (objective.router_explore_draw=next): never shallower
    "fold m16 t-loopformer explore 0.5 next span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        NEXT8,
        {**F16, **CUR, "target": "need"},
    ),
    # the same with the budget's target at the middle of 1..L (2.5) instead of the mean need (1.73): the prior is
    # then uniform, so its pull no longer sends the tokens whose answers do not count yet to one loop
    "fold m16 t-loopformer target 2.5 explore 0.5 next span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*NEXT8, "model.router_target_depth=2.5"],
        {**F16, **CUR},
    ),
    # the network first trained at the oracle depths (router bypassed) until it composes level 2, then the router
    # trained as usual: given a network that composes, does the router learn to send the level-2 query deep?
    "fold m16 t-loopformer warm at need explore 0.5 next span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        NEXT8,
        {**F16, **CUR, "target": "need", "warm": 3},
    ),
    "fold m16 t-loopformer warm at need explore 0.25 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES],
        {**F16, **CUR, "target": "need", "warm": 3},
    ),
    "fold m32 t-loopformer explore 0.25 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, *FIXES],
        {**F16, **CUR, "symbols": 32, "target": "need"},
    ),
    "fold m32 t-loopformer explore 0.25 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        [*TLF, "objective.router_explore=0.25", "objective.router_ste_log=true", "objective.router_entropy_weight=0"],
        {**F16, **CUR, "symbols": 32, "target": "need"},
    ),
}
# Grid 8: exited tokens stay readable by later loops through their frozen state (model.exited_keys=frozen): a
# cell then holds its prefix whether or not it keeps looping, so a query's extra loop pays without its cell's
# (level 2 uncoupled; level k >= 3 still needs cell x_(k-1) at k - 1 loops). Targets and oracle: those needs.
VIS = {**F16, **CUR}
FROZEN = ["model.exited_keys=frozen"]
LOGSTE = [*TLF, *FROZEN, "objective.router_ste_log=true", "objective.router_entropy_weight=0"]  # no key factor
VISNEXT8 = [*LOGSTE, *NEXT8[-3:]]  # half the windows of 8 explored one loop past the router's depth
GRID8 = {
    "fold m16 visible oracle curriculum": ("depth/base-loop", FROZEN, {**VIS, "depth": "oracle"}),
    "fold m16 t-loopformer visible explore 0.5 next span 8 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        VISNEXT8,
        {**VIS, "target": "need"},
    ),
    "fold m16 t-loopformer visible explore 0.25 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        [*LOGSTE, "objective.router_explore=0.25"],
        {**VIS, "target": "need"},
    ),
    # the budget's target at the middle of 1..L (a uniform prior): under dropped keys it kept the level-2 query deep
    # and left its cell at one loop (grid 7); with frozen keys the cell needs no more
    "fold m16 t-loopformer visible target 2.5 explore 0.5 next span 8 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        [*VISNEXT8, "model.router_target_depth=2.5"],
        VIS,
    ),
    # handed a network that composes level 2 at the visible needs (settings "warm"), does the router keep the
    # level-2 query deep now that its extra loop pays without its cell's?
    "fold m16 t-loopformer visible warm at need explore 0.5 next span 8 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        VISNEXT8,
        {**VIS, "target": "need", "warm": 3},
    ),
}
# Grid 9: the router on an unconditioned network (model.conditioning=none). Under the LoopFormer conditioning a
# token's depth sets its whole trajectory (depth m runs steps of 1/m at times 0, 1/m, ...), so going from depth 2
# to 3 changes loops 1 and 2 as well, which the straight-through factor on loop 3's update does not see; without
# conditioning loop i is the same computation at every depth and one more loop is only one more loop.
# No variant has a router without conditioning, so settings "unconditioned" makes this network outside the
# variant table (probe-only): t-loopformer's, its modulators left unused.
UNC = {**F16, **CUR, "target": "need", "unconditioned": True}
GRID9 = {
    "fold m16 t-loopformer unconditioned warm at need explore 0.5 next span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        NEXT8,
        {**UNC, "warm": 3},
    ),
    "fold m16 t-loopformer unconditioned explore 0.5 next span 8 log-ste keys no entropy curriculum": (
        "depth/t-loopformer",
        NEXT8,
        UNC,
    ),
    # the most favourable case for the router: frozen exited keys (a cell need not keep looping for its reader),
    # no conditioning (a loop past the need repeats the step), and a warm phase at the oracle's depths moved by
    # 0 or +1 per document, so the network it is handed answers at its need and one loop past it
    "fold m16 t-loopformer unconditioned visible warm jitter 1 explore 0.5 next span 8 log-ste no entropy curriculum": (
        "depth/t-loopformer",
        VISNEXT8,
        {**UNC, "warm": 3, "jitter": (0, 1)},
    ),
}


# Grid 10: the router trained on the expected loss over exits (model.router_recipe=expected; Ouro's objective with
# the budget prior): every token runs every loop in training, so the network learns every exit, and the router's
# gradient is exact. Frozen exited keys, so that a context token that exits early at inference still shows its
# state; no conditioning, so that exit d in training is depth d at inference (the recipe's exit schedule, prefix,
# is moot then). The sixth session's probes had no shortcut pass: its weights are 0 here.
def expected(beta: float = 0.1, shortcut: bool = False) -> list:
    """The expected recipe's overrides on t-loopformer (frozen keys, prefix exits, prior weight beta); shortcut
    False zeroes the shortcut pass's and the alignment's weights (grid 10 as first run, without them)."""
    off = [] if shortcut else ["objective.lambda_short=0", "objective.lambda_align=0"]
    return [*TLF, *FROZEN, *EXPECTED_RECIPE, f"objective.router_prior_weight={beta}", *off]


EXPNAME = "fold m16 t-loopformer expected exit loss unconditioned visible curriculum"
GRID10 = {
    EXPNAME + (f" seed {k}" if k else ""): ("depth/t-loopformer", expected(), {**UNC, "seed": k}) for k in range(4)
}
# Grid 11: the same recipe at m = 32 symbols, where the one-loop table is out of reach of a CPU budget (one layer at
# 0.42 on level 2 after 35,000 steps, grid 6): does composition at exit 2 then win the race in every seed?
EXPNAME32 = EXPNAME.replace("m16", "m32")
GRID11 = {
    EXPNAME32 + (f" seed {k}" if k else ""): ("depth/t-loopformer", expected(), {**UNC, "symbols": 32, "seed": k})
    for k in range(4)
}
# Grid 12: the recipe as the pipeline runs it: t-loopformer's own network (LoopFormer conditioning, depth d the
# pass's first d steps) and objective (the shortcut pass and alignment at their weights).
PIPENAME = "fold m16 t-loopformer expected recipe visible curriculum"
GRID12 = {
    PIPENAME.replace("m16", f"m{m}") + f" seed {k}": (
        "depth/t-loopformer",
        expected(shortcut=True),
        {**VIS, "target": "need", "symbols": m, "seed": k},
    )
    for m in (16, 32)
    for k in range(4)
}
# ... and the value comparison: loopformer on the same task, settings and seeds, whose elastic curve (accuracy at
# each budget M = 1..L) the routed model's accuracy at its executed loop work is set against
GRID12.update(
    {
        f"fold m{m} loopformer curriculum seed {k}": (
            "depth/loopformer",
            [*G1, "objective.align_positions=scored"],
            {**F16, **CUR, "symbols": m, "seed": k},
        )
        for m in (16, 32)
        for k in range(4)
    }
)
# Grid 13: typed cells (prep-data fold_typed) at levels 1..2, m = 32, where no model learnt the one-loop table in
# a CPU budget: does the plain looped model (trained at M = 2 only), or the oracle's depths, compose two steps?
T32 = {**F16, **CUR, "symbols": 32, "levels": 2, "L": 2, "typed": True}
GRID13 = {
    "fold m32 L2 typed base-loop curriculum": ("depth/base-loop", [], T32),
    "fold m32 L2 typed oracle curriculum": ("depth/base-loop", [], {**T32, "depth": "oracle"}),
    "fold m32 L2 typed one layer curriculum": ("depth/base", [], {**T32, "layers": 1}),
    # ... and with the random rule (prep-data fold_rule=random), whose two-step fold has no short description
    "fold m32 L2 typed random oracle curriculum": ("depth/base-loop", [], {**T32, "rule": "random", "depth": "oracle"}),
    "fold m32 L2 typed random one layer curriculum": ("depth/base", [], {**T32, "rule": "random", "layers": 1}),
}
# Grid 14: at that valid size (random rule), which exits the network is trained at decides whether it composes.
# Every token runs both loops (the expected recipe's training pass) and the answer of level k is scored at the exits
# settings "exits" names (`EXITS`), each answer weighing 1 in all: "need" is the expected recipe with a perfect
# router, "all" its uniform exits (loopformer's every budget, from the full pass), "short" adds the exit below the
# need, "reach" the exits past it; base-loop scores every answer at the last exit only.
T32R = {**T32, "rule": "random"}
GRID14 = {
    f"fold m32 L2 typed random exits {e} curriculum" + (f" seed {k}" if k else ""): (
        "depth/base-loop",
        [],
        {**T32R, "exits": e, "seed": k},
    )
    for k in range(3)
    for e in ("need", "all", "short", "reach")
}
GRID14["fold m32 L2 typed random base-loop curriculum"] = ("depth/base-loop", [], T32R)
# ... and the oracle's depths with frozen exited keys, whose every scored output is the exits "need" probe's: in
# loop 2 a query attends to every token's state after loop 1, where the oracle of grid 13 (dropped keys) shows it
# only the tokens still looping
GRID14["fold m32 L2 typed random visible oracle curriculum"] = ("depth/base-loop", FROZEN, {**T32R, "depth": "oracle"})
# ... which part of the oracle's map matters (seed 0, where the oracle composes by step 7,000): the query's whole
# segment at its need (two more tokens in loop 2, none trained past its need), or every token but the queries at L
GRID14.update(
    {
        f"fold m32 L2 typed random {m} depth curriculum": ("depth/base-loop", [], {**T32R, "depth": m})
        for m in ("segment", "queries")
    }
)
# ... the oracle of grid 13 (dropped keys) at two more seeds
GRID14.update(
    {
        f"fold m32 L2 typed random oracle curriculum seed {k}": (
            "depth/base-loop",
            [],
            {**T32R, "depth": "oracle", "seed": k},
        )
        for k in (1, 2)
    }
)
# ... and with weight decay 0.1 (AdamW's, on every parameter), which speeds up delayed generalisation elsewhere
GRID14.update(
    {
        f"fold m32 L2 typed random oracle wd0.1 curriculum seed {k}": (
            "depth/base-loop",
            [],
            {**T32R, "depth": "oracle", "wd": 0.1, "seed": k},
        )
        for k in range(3)
    }
)
# ... and the oracle's map with each training token's depth replaced by a uniform draw w.p. p (evaluated at the map):
# depth maps a router's exploration could give before it knows the need; p = 1 is a random map
GRID14.update(
    {
        f"fold m32 L2 typed random oracle scramble {p} curriculum": (
            "depth/base-loop",
            [],
            {**T32R, "depth": "oracle", "scramble": p},
        )
        for p in (0.25, 0.5, 1.0)
    }
)
# ... and the budget recipe, whose training pass is the router's own depths with dropped keys (at best grid 13's
# oracle): the fifth session's exploration (half the windows of 8 one loop past the router's depth), target the need
GRID14["fold m32 L2 typed random t-loopformer explore 0.5 next span 8 log-ste keys no entropy curriculum"] = (
    "depth/t-loopformer",
    NEXT8,
    {**T32R, "target": "need"},
)
# Grid 15: the segments in the order L..1 (settings "descending"), so that the level-2 query sees no level-1
# segment before it: grid 14's segment map (0.99) and queries map (0.15) differ only in whether the level-1
# segment is visible to the level-2 query in loop 2. Does the visible pass (every token both loops) then compose?
T32RD = {**T32R, "descending": True}
GRID15 = {
    "fold m32 L2 typed random descending base-loop curriculum": ("depth/base-loop", [], T32RD),
    **{
        f"fold m32 L2 typed random descending exits {e} curriculum": ("depth/base-loop", [], {**T32RD, "exits": e})
        for e in ("need", "all")
    },
    "fold m32 L2 typed random descending oracle curriculum": ("depth/base-loop", [], {**T32RD, "depth": "oracle"}),
}
# ... and at seeds 1 and 2, for longer (composition came at 7,000 to 30,000 steps in grid 14's three oracle seeds)
GRID15.update(
    {
        f"fold m32 L2 typed random descending {kind} curriculum seed {k}": (
            "depth/base-loop",
            [],
            {**T32RD, **({"depth": "oracle"} if kind == "oracle" else {"exits": kind.split()[1]}), "seed": k},
        )
        for k in (1, 2)
        for kind in ("exits need", "oracle", "exits all")
    }
)
# Grid 16: why composition fails: after loop 1 the level-2 segment's cell x_1 holds its prefix y_1 (read through
# the head: 1.00) in every model that composed (the oracle at three seeds, the segment map) and near chance in every
# one that did not (the visible pass, exits all/short/reach, the queries map; bench/README grid-16 section): the
# step g is learnt at the level-1 query's position and not carried to the level-2 cells' positions (learned absolute
# positions). Training every row at positions shifted by a draw from 0..P (settings "offsets") teaches the step at
# every position: does the visible pass then compose?
GRID16 = {
    f"fold m32 L2 typed random offsets {P} exits {e} curriculum": (
        "depth/base-loop",
        [],
        {**T32R, "exits": e, "offsets": P},
    )
    for P in (16,)
    for e in ("need", "all")
}
# ... and prep-data's fold_layout=slots (settings "slots": S): a row is S slots of L + 3 tokens, each one segment of
# a level drawn per slot (W_k x_0 .. x_k A, padded), so the level-2 segment's x_1 sits where a level-1 query does,
# with the same tokens (in law) before it: the step learnt for the level-1 answers is the one x_1 needs
GRID16.update(
    {
        f"fold m32 L2 typed random slots {S} exits {e} curriculum": (
            "depth/base-loop",
            [],
            {**T32R, "exits": e, "slots": S},
        )
        for S in (1, 2)
        for e in ("need", "all")
    }
)
# ... every answer at exit 2 only (base-loop: the map a router that starts deep would train first)
SLOTS2 = {**T32R, "slots": 2}
GRID16["fold m32 L2 typed random slots 2 base-loop curriculum"] = ("depth/base-loop", [], SLOTS2)
# ... at two more seeds, and with the answers also scored one exit short of or past their need
GRID16.update(
    {
        f"fold m32 L2 typed random slots 2 exits need curriculum seed {k}": (
            "depth/base-loop",
            [],
            {**T32R, "exits": "need", "slots": 2, "seed": k},
        )
        for k in (1, 2)
    }
)
GRID16.update(
    {
        f"fold m32 L2 typed random slots 2 exits {e} curriculum": (
            "depth/base-loop",
            [],
            {**T32R, "exits": e, "slots": 2},
        )
        for e in ("short", "reach")
    }
)
# ... and the routed recipes on it: the expected recipe (frozen keys, where the need is a function of h0: a cell
# at slot position q needs max(q - 1, 1), a query at q needs q - 1) with the network of the exits probes (no
# conditioning) and with t-loopformer's own, and loopformer (every budget) beside them
GRID16.update(
    {
        "fold m32 L2 typed random slots 2 t-loopformer expected unconditioned curriculum": (
            "depth/t-loopformer",
            expected(),
            {**SLOTS2, "target": "need", "unconditioned": True},
        ),
        "fold m32 L2 typed random slots 2 t-loopformer expected curriculum": (
            "depth/t-loopformer",
            expected(),
            {**SLOTS2, "target": "need"},
        ),
        "fold m32 L2 typed random slots 2 loopformer curriculum": (
            "depth/loopformer",
            [*G1, "objective.align_positions=scored"],
            SLOTS2,
        ),
    }
)
GRID16.update(
    {
        f"fold m32 L2 typed random slots 2 t-loopformer expected{u} curriculum seed {k}": (
            "depth/t-loopformer",
            expected(),
            {**SLOTS2, "target": "need", "unconditioned": bool(u), "seed": k},
        )
        for u in (" unconditioned", "")
        for k in (1, 2)
    }
)
# ... and the pipeline's variant for it, base-loop-router (no conditioning, no shortcut pass), at three seeds
GRID16.update(
    {
        f"fold m32 L2 typed random slots 2 base-loop-router expected curriculum seed {k}": (
            "depth/base-loop-router",
            expected(),
            {**SLOTS2, "target": "need", "seed": k},
        )
        for k in range(3)
    }
)
# ... and the network's exits weighted (1 - a) pi + a / L (objective.router_exit_uniform=a, the router's gradient
# unchanged), so that exit 2 is trained at a level-2 query the router keeps at depth 1; and the `need` pass at the
# same seeds, the network's side alone
GRID16.update(
    {
        f"fold m32 L2 typed random slots 2 t-loopformer expected unconditioned exit uniform {a} curriculum seed {k}": (
            "depth/t-loopformer",
            [*expected(), f"objective.router_exit_uniform={a}"],
            {**SLOTS2, "target": "need", "unconditioned": True, "seed": k},
        )
        for a in (0.1,)
        for k in (1, 2)
    }
)
# Grid 17: the router's own target for the hard tokens (objective.router_hard_weight=w): each scored token's first
# exit where its loss is at most r x the batch's mean there (objective.router_hard_ratio=r; the last exit if none).
# At the curriculum's level-2 entry the level-1 answers are right at exit 1 and the level-2 answers at chance at
# both exits: the expected loss's gradient is blind between the two exits, the target sends the level-2 answers to
# exit 2 at once. The pipeline's variant for the task (base-loop-router) at three seeds (r = 1: the batch mean
# itself, first run), and the unconditioned t-loopformer at the two seeds that stuck.
GRID17 = {
    f"fold m32 L2 typed random slots 2 base-loop-router expected hard {w} ratio {r} curriculum seed {k}": (
        "depth/base-loop-router",
        [*expected(), f"objective.router_hard_weight={w}", f"objective.router_hard_ratio={r}"],
        {**SLOTS2, "target": "need", "seed": k},
    )
    for w, r in ((1.0, 1.0), (1.0, 1.5))
    for k in range(3)
}
GRID17.update(
    {
        f"fold m32 L2 typed random slots 2 t-loopformer expected unconditioned hard {w} ratio {r} curriculum seed {k}": (
            "depth/t-loopformer",
            [*expected(), f"objective.router_hard_weight={w}", f"objective.router_hard_ratio={r}"],
            {**SLOTS2, "target": "need", "unconditioned": True, "seed": k},
        )
        for w, r in ((1.0, 1.5),)
        for k in (1, 2)
    }
)
# ... and gated by the router's forecast (model.router_forecast, objective.router_hard_gate=tau): at r = 1.5 the
# level-1 answers not yet learnt were sent deeper while level 1 was being learnt, loop 2 learnt the step too, and
# composition slowed or stopped; the gate lets the target act only on a kind of token the forecast calls hard
# with probability > tau (the level-2 answers: always hard at exit 1; the level-1 answers: less and less often)
GRID17.update(
    {
        f"fold m32 L2 typed random slots 2 base-loop-router expected hard {w} ratio {r} gate {g} curriculum seed {k}": (
            "depth/base-loop-router",
            [
                *expected(),
                f"objective.router_hard_weight={w}",
                f"objective.router_hard_ratio={r}",
                "model.router_forecast=true",
                f"objective.router_hard_gate={g}",
            ],
            {**SLOTS2, "target": "need", "seed": k},
        )
        for w, r, g in ((1.0, 1.5, 0.9),)
        for k in range(5)
    }
)
# ... and with the router reading sg(h0) (model.router_detach; first run as a probe setting doing the same): with
# the router at the need's depths (seed 1: pi_2 = 0.995 on the level-2 answers from the level-2 entry on) the network
# still did not compose in 9,500 steps, where the `need` pass, the same network at the same exits, composed within
# 1,000-5,000 steps in five runs; what is left between them is the router's own losses reaching the embeddings
# through h0. And the `need` pass at two more seeds: how reliably does the network compose at those exits?
GRID17.update(
    {
        f"{name} detached router": (preset, [*ov, "model.router_detach=true"], st)
        for name, (preset, ov, st) in list(GRID17.items())
        if "gate" in name
    }
)
# ... and the `need` pass on the routed probes' network (the same preset, overrides and so the same initial weights
# and data as the detached seeds 0 and 3, which did not compose; the router is built and never used): does the
# network compose at the need's exact exits from that start?
GRID17.update(
    {
        f"{name} router unused exits need": (preset, ov, {**st, "exits": "need"})
        for name, (preset, ov, st) in list(GRID17.items())
        if name.endswith("detached router")
    }
)
# ... and with a sharper router (objective.router_prior_weight=0.01, not 0.1): detached, the level-2 answers kept
# pi_1 = 0.04-0.06 at exit 1, which the `need` pass trains at 0, and in seed 2 exit 1 began to learn a third of
# them as a table and the router followed it back to depth 1
GRID17.update(
    {
        f"{name} prior 0.01": (preset, [*ov, "objective.router_prior_weight=0.01"], st)
        for name, (preset, ov, st) in list(GRID17.items())
        if name.endswith("detached router")
    }
)
GRID17.update(
    {
        f"fold m32 L2 typed random slots 2 exits need curriculum seed {k}": (
            "depth/base-loop",
            [],
            {**T32R, "exits": "need", "slots": 2, "seed": k},
        )
        for k in (3, 4)
    }
)
# Grid 18: the network's exit weights at the router's depth (objective.router_exit_weights=depth): 1 at the exit of
# the depth the router gives the token, 0 elsewhere, the router's gradient the expected loss's. Detached and
# gated, two seeds of five did not compose where the `need` pass from the same start did; what was left between
# them is the exit-1 weight pi_1 = 0.02-0.06 on the level-2 answers (and the steps before the router moved them),
# where exit 1 can begin the two-step table and the router follow it back. At the router's depth that weight is 0.
GRID18 = {
    f"{name} exits at depth": (preset, [*ov, "objective.router_exit_weights=depth"], st)
    for name, (preset, ov, st) in GRID17.items()
    if "gate 0.9" in name and name.endswith("detached router")
}
# ... and with the router's gradient norm clipped apart from the network's (settings "clip_apart"): one norm over
# every parameter, as the probes and the trainer clip, lets the router's own losses scale the network's step
GRID18.update(
    {f"{name} clip apart": (preset, ov, {**st, "clip_apart": True}) for name, (preset, ov, st) in list(GRID18.items())}
)
# Grid 19: ... with the hard labels' losses bounded at chance (objective.router_hard_bound): under exits at depth
# an exit never trained on an answer scored it far above chance (5.56 nats against 3.47), which raised the batch
# mean the labels compare with until answers near chance no longer counted as hard (seed 3, clip apart); seeds 0..4
GRID19 = {
    f"{name} bounded": (preset, [*ov, "objective.router_hard_bound=true"], st)
    for name, (preset, ov, st) in GRID18.items()
}
# Grid 20: why the first slot's step did not come. In grid 19's two seeds that composed, level 2 was right in a
# window's second slot (0.98) and at chance in its first: the learnt positions differ between the slots (positions
# 0..4 and 5..9), so the same step is learnt twice. With positions that restart at every slot (settings
# "slot_positions") one step serves both; and the same recipe without clip apart, as `tlf train` clips (one norm)
GRID20 = {
    f"{name} slot positions": (preset, ov, {**st, "slot_positions": True})
    for name, (preset, ov, st) in GRID19.items()
    if name.endswith("clip apart bounded")
}
# ... and the `need` pass (no router; grid 17's exits need) with them: does composition itself change?
GRID20["fold m32 L2 typed random slots 2 exits need curriculum seed 0 slot positions"] = (
    "depth/base-loop",
    [],
    {**T32R, "exits": "need", "slots": 2, "seed": 0, "slot_positions": True},
)
# ... and the routed probes' network at the need's depths from step 0 with the router bypassed (settings "warm" past
# the last level: never handed over): the need pass's exits with the routed forward's frozen exited keys, from the
# routed probes' initial weights. Do frozen keys compose as the need pass (every token visible) does?
GRID20.update(
    {
        f"{name} oracle frozen": (preset, ov, {**st, "warm": 3})
        for name, (preset, ov, st) in GRID19.items()
        if name.endswith("clip apart bounded")
    }
)
# Grid 21: grid 19's recipe with the router's initial logit spread near 0 (model.router_init_std=0.01, not 2): at
# the default init 29 % of the level-1 answers start at depth 2 (seed 3), so the first steps train them at exit 2,
# which the need pass never does; near 0 every token starts at the prior's median, depth 1
GRID21 = {
    f"{name} init 0.01": (preset, [*ov, "model.router_init_std=0.01"], st) for name, (preset, ov, st) in GRID19.items()
}
# ... and the causal test of what grid 21 found (its routed probe, seed 3, at the need's depths except for the 250
# steps after level 2 entered, in which 75 % of the level-2 training answers ran at depth 1, did not compose where
# the need pass from the same start did): the need pass with the new level's answers trained at exit 1 for the
# first `window` steps after the level enters (settings "window")
GRID21.update(
    {
        f"fold m32 L2 typed random slots 2 base-loop-router expected hard 1.0 ratio 1.5 gate 0.9 curriculum seed {k} "
        f"detached router router unused exits need window {n}": (
            preset,
            ov,
            {**st, "window": n},
        )
        for k in (2, 3)
        for n in (1, 10, 50, 100, 250)
        for preset, ov, st in [
            GRID17[
                f"fold m32 L2 typed random slots 2 base-loop-router expected hard 1.0 ratio 1.5 gate 0.9 curriculum "
                f"seed {k} detached router router unused exits need"
            ]
        ]
    }
)
# ... and its control: the same steps with the new level's answers withheld (weight 0 at every exit) instead of
# trained at exit 1 (settings "withhold"): is it the exit-1 table that blocks composition, or any change of those
# steps? (measured: the withheld steps compose on the need pass's schedule; one step at exit 1 delayed it ~250 steps,
# ten stopped it)
GRID21.update(
    {
        name.replace(" window ", " withhold "): (preset, ov, {**st, "withhold": True})
        for name, (preset, ov, st) in list(GRID21.items())
        if " window " in name
    }
)
# Grid 22: grid 19's recipe with the window closed (objective.router_exit_weights=depth_label): an answer whose hard
# label lies deeper than the depth the router gives it is not trained at any exit until the router sends it there,
# so the new level's answers are never learnt at exit 1 in the steps the router needs to move them (grid 21's
# causal test: 250 such steps stopped the need pass composing). Clip apart as grid 19's, and one norm as `tlf train`
GRID22 = {
    f"{name} label": (preset, [o.replace("=depth", "=depth_label") for o in ov], st)
    for name, (preset, ov, st) in GRID19.items()
    if name.endswith("bounded")
}
# ... measured: by the labels alone the not-yet-learnt part of level 1 waits too and is never learnt (level 1 held at
# 0.72 / 0.69, 27-32 % of its answers withheld); the forecast's gate at 0.9 opens only as the router moves anyway.
# A withholding gate g between the two: a kind being learnt has at most 1/ratio = 2/3 of its answers hard, a new
# kind that needs another loop all of them (objective.router_withhold_gate)
GRID22.update(
    {
        f"{name} withhold {g}": (preset, [*ov, f"objective.router_withhold_gate={g}"], st)
        for name, (preset, ov, st) in list(GRID22.items())
        for g in (0.7,)
    }
)
# ... measured: the gate at 0.7 still let a quarter of the level-2 answers of the first 500 steps be learnt at exit 1,
# and grid 21's window says 10 such steps stop composition. Waiting by the labels alone, but only once the rest of
# the batch is learnt (objective.router_withhold_learnt = e nats: the mean loss of the tokens not hard there)
GRID22.update(
    {
        f"{name} learnt {e}": (preset, [*ov, f"objective.router_withhold_learnt={e}"], st)
        for name, (preset, ov, st) in list(GRID22.items())
        if name.endswith("label")
        for e in (0.1,)
    }
)
# ... and the bound on what any withholding can give: the network's loss withheld from exactly the answers the
# router runs shallower than their level, from the first step (settings "oracle_wait"; the router as before)
GRID22.update(
    {
        f"{name} oracle wait": (preset, ov, {**st, "oracle_wait": True})
        for name, (preset, ov, st) in list(GRID22.items())
        if name.endswith("label")
    }
)
# Grid 23: a label that knows a new kind at once (objective.router_withhold_kind = g): the labels' withholding, only
# where the token's kind (its (token, position) pair; here one bucket per kind) has a running hard rate above g at
# the routed exit, presumed 1 for a kind never scored: level 2's queries sit at positions no level-1 answer is
# predicted from, so they wait from their first step, while a level-1 kind being learnt stays below g
GRID23 = {
    f"{name} kind {g}": (preset, [*ov, f"objective.router_withhold_kind={g}"], st)
    for name, (preset, ov, st) in GRID22.items()
    if name.endswith("label")
    for g in (0.9,)
}
# ... measured at g = 0.9: the labels still let 13-15 % of the first 500 steps' level-2 answers be learnt at exit 1
# (those below 1.5 x the batch mean there by chance, not labelled hard), as many as grid 22's gate let through. The
# kind alone decides (objective.router_withhold_kind_only: every answer of a kind whose rate exceeds g waits,
# whatever its label; first run as a probe setting, bit for bit the same for 2,000 steps)
GRID23.update(
    {
        f"{name} kind {g} only": (
            preset,
            [*ov, f"objective.router_withhold_kind={g}", "objective.router_withhold_kind_only=true"],
            st,
        )
        for name, (preset, ov, st) in GRID22.items()
        if name.endswith("label")
        for g in (0.8,)
    }
)
# ... and the labels against each exit's own answers (objective.router_hard_reference=routed: the mean of the tokens
# the router runs at that depth, not the batch's), for the router's target and the kinds' table alike
GRID23.update(
    {
        f"{name} routed mean": (preset, [*ov, "objective.router_hard_reference=routed"], st)
        for name, (preset, ov, st) in list(GRID23.items())
        if name.endswith("only")
    }
)
# ... measured: both seeds composed (level 2 at 0.957 / 0.927 at 9,000 steps, at one loop 0.009 / 0.001), the first
# recipe without the task's levels to do so in these seeds; seeds 0 and 1 too (0.976 / 0.77 at 6,000)
# ... and slower rates (a kind's few answers a batch, labelled easy by chance a few batches running, took its rate
# below g and 2 % of the new answers were learnt at exit 1 in the first 500 steps)
GRID23.update(
    {
        f"{name} decay {a}": (preset, [*ov, f"objective.router_kind_decay={a}"], st)
        for name, (preset, ov, st) in list(GRID23.items())
        if name.endswith("routed mean")
        for a in (0.99,)
    }
)
# ... measured (kind-only): seed 2 kept level 2 at depth 2 for 2,000 steps without composing, then its kinds' rates drifted
# below g and a one-loop table grew; in seed 3 level 1's kinds being learnt rose to 0.99 and the answers the router
# moved deep lifted exit 1's batch mean until a level-2 answer at chance no longer counted hard (bench/README)
GRIDS = {
    "1": GRID1,
    "2": GRID2,
    "3": GRID3,
    "4": GRID4,
    "5": GRID5,
    "6": GRID6,
    "7": GRID7,
    "8": GRID8,
    "9": GRID9,
    "10": GRID10,
    "11": GRID11,
    "12": GRID12,
    "13": GRID13,
    "14": GRID14,
    "15": GRID15,
    "16": GRID16,
    "17": GRID17,
    "18": GRID18,
    "19": GRID19,
    "20": GRID20,
    "21": GRID21,
    "22": GRID22,
    "23": GRID23,
}
GRID = {name: probe for grid in GRIDS.values() for name, probe in grid.items()}
DEFAULTS = {"lr": 3e-3, "wd": 0.0, "beta2": 0.99, "batch": 256, "R": 6, "L": 4, "Q": 4, "warmup": 100, "seed": 0}


# settings "exits": name -> (level k, loops L) -> the exits (1..L) its answer is scored at
EXITS = {
    "need": lambda k, L: [min(k, L)],
    "all": lambda k, L: list(range(1, L + 1)),
    "short": lambda k, L: list(range(1, min(k, L) + 1)),
    "reach": lambda k, L: list(range(min(k, L), L + 1)),
}


def exit_weights(name: str, Lt: int, L: int) -> torch.Tensor:
    """(Lt + 1, L) the weight of each level's answer (row 0: not an answer) at each exit under settings "exits"
    `name`: 1 / (its exits) at each of them, so every answer weighs 1."""
    w = torch.zeros(Lt + 1, L)
    for k in range(1, Lt + 1):
        ex = EXITS[name](k, L)
        w[k, [e - 1 for e in ex]] = 1.0 / len(ex)
    return w


def documents(seed: int, start: int, n: int, R: int, L: int, Q: int, order: str = "far") -> np.ndarray:
    from data_prep.depthtask import make_document

    return np.stack([make_document(seed, start + i, R, L, Q, order) for i in range(n)])


def probe(args) -> dict:
    """One probe; a failure comes back as {"name", "error"} so the others' results survive."""
    try:
        return _probe(*args)
    except Exception as e:  # noqa: BLE001  (a probe's failure is data; the grid goes on)
        return {"name": args[0], "error": f"{type(e).__name__}: {e}"}


def _hops(s: dict):
    """The depth-hops task of settings s: (doc tokens T, vocabulary needed, mean need, val documents,
    levels (docs (B, T) -> (B, T) the level each position predicts), draw(n) -> n training documents)."""
    from data_prep.depthtask import doc_length, layout, levels_at, mean_need

    R, Lt, Q, order = s["R"], s.get("levels", s["L"]), s["Q"], s.get("order", "far")
    task = layout(R, Lt, order)
    pool = documents(s["seed"], 0, 20_000, R, Lt, Q, order)  # fresh documents are drawn below; this one is the first
    state = {"step": 0, "next": 20_000, "rng": np.random.default_rng(s["seed"])}

    def draw(n):
        if state["step"] % 50 == 0 and state["step"] > 0:  # refresh part of the pool: mostly fresh documents
            pool[state["rng"].integers(0, len(pool), 512)] = documents(s["seed"], state["next"], 512, R, Lt, Q, order)
            state["next"] += 512
        state["step"] += 1
        return pool[state["rng"].integers(0, len(pool), n)]

    val = documents(10_000 + s["seed"], 0, 512, R, Lt, Q, order)
    return doc_length(R, Lt, Q), task["vocab_needed"], mean_need(R, Lt, Q), val, lambda d: levels_at(d, task), draw


def _fold(s: dict, visible: bool = False):
    """The fold task (data_prep/foldtask.py) of settings s, as `_hops` returns it (the mean need when exited tokens
    stay readable if visible); val documents from their own stream, the same rule g."""
    from data_prep import foldtask
    from data_prep.depthtask import levels_at

    L, g, rng = s["levels"], foldtask.rule(s["symbols"], 0, s.get("rule", "cyclic")), np.random.default_rng(s["seed"])
    typed, desc = bool(s.get("typed")), bool(s.get("descending"))  # prep-data's fold_typed; segments L..1
    lev = foldtask.levels(L, desc)
    vocab = foldtask.layout(s["symbols"], L, typed=typed)["vocab_needed"]
    if s.get("slots"):  # prep-data's fold_layout=slots: S slots of one drawn level each per row
        if s.get("depth") or desc:
            raise ValueError("settings 'slots' takes no forced depth map and no segment order")
        S, task = int(s["slots"]), foldtask.layout(s["symbols"], L, typed=typed, kind="slots")

        def draw(n):
            return foldtask.slot_documents(g, rng, n * S, L, typed).reshape(n, -1)

        val = foldtask.slot_documents(g, np.random.default_rng(10_000 + s["seed"]), 1024 * S, L, typed)
        mean = foldtask.slot_need(L, visible)
        return S * (L + 3), vocab, mean, val.reshape(1024, -1), lambda d: levels_at(d, task), draw
    val = foldtask.documents(g, np.random.default_rng(10_000 + s["seed"]), 1024, L, typed=typed, descending=desc)
    mean = float(foldtask.need(L, visible, desc).mean())
    return (
        foldtask.doc_length(L),
        vocab,
        mean,
        val,
        lambda d: np.broadcast_to(lev, (len(d), len(lev))),
        lambda n: foldtask.documents(g, rng, n, L, typed=typed, descending=desc),
    )


def prefix_targets(docs: np.ndarray, s: dict) -> np.ndarray:
    """(B, T) for the fold task's documents docs (B, T) of settings s: at each context cell x_j (0 < j < k) of a
    level-k segment the token of its prefix y_j = g(y_(j-1), x_j), the state it must hold after j loops for the
    query to read it; -1 elsewhere (computed here from g, independently of the task's `need`)."""
    from data_prep import foldtask

    L, m = s["levels"], s["symbols"]
    g = foldtask.rule(m, 0, s.get("rule", "cyclic"))
    out, p = np.full(docs.shape, -1, dtype=np.int64), 0
    if s.get("slots"):  # whole slots of L + 3 tokens, one segment each from the slot's start
        levels = foldtask.slot_levels(docs, L)
        for a in range(0, docs.shape[1] - 2, L + 3):
            k = levels[:, a]  # (B,) the slot's level
            y = docs[:, a + 1] - foldtask.SYM
            for j in range(1, min(L, docs.shape[1] - a - 1)):
                y = g[y, (docs[:, a + 1 + j] - foldtask.SYM - (m if s.get("typed") else 0)).clip(0, m - 1)]
                out[:, a + 1 + j] = np.where(j < k, foldtask.SYM + y, -1)
        return out
    for k in foldtask.order(L, bool(s.get("descending"))):
        y = docs[:, p + 1] - foldtask.SYM  # x_0, a state token
        for j in range(1, k):
            y = g[y, docs[:, p + 1 + j] - foldtask.SYM - (m if s.get("typed") else 0)]
            out[:, p + 1 + j] = foldtask.SYM + y
        p += k + 3
    return out


def forced_depth(name: str, L: int, visible: bool = False, descending: bool = False) -> np.ndarray:
    """(doc_length(L),) the fold task's forced depth map `name` (settings "depth"), no router; visible: the
    needs when exited tokens stay readable (model.exited_keys=frozen); descending: segments in the order L..1."""
    from data_prep import foldtask

    need, lev = foldtask.need(L, visible, descending), foldtask.levels(L, descending)
    return {
        "oracle": need,  # every token the loops it needs
        "oracle+1": need + 1,  # one loop past its need (clipped at the model's L)
        "oracle+2": need + 2,
        "segment": foldtask.segment_depth(L, descending),  # every token of a segment at its query's need
        # every query at its need, every other token at L: a query sees every token in every loop, as with
        # frozen keys, but no answer runs past its need
        "queries": np.where(lev > 0, lev, L),
    }[name]


def forced_depth_logits(model, x: torch.Tensor, depth: torch.Tensor, M: int) -> torch.Tensor:
    """Logits (B, T, V) of `model` on x (B, T) with every token's depth given (depth (T,) or (B, T) in 1..M)
    instead of a router's: the oracle probes and bench/fold_probe_check.py."""
    from pipeline.model.looped import uniform

    h = model.run_loops(model.embed(x), uniform(M), depth.expand_as(x), None)
    return model.head(h)[0]


def _oracle_wait(base):
    """settings "oracle_wait" (with objective.router_exit_weights=depth_label): the objective that withholds the
    network's loss from exactly the answers the router runs shallower than their level, from a new level's first
    step (`levels` (B, T), the training batch's, set before each step): what a perfect label would withhold."""

    class OracleWait(base):
        levels = None

        def _wait(self, loops, routed_depth, labels, rows, idx):
            return labels[1] & (self.levels > routed_depth)  # labels[1]: scored

    return OracleWait


def _probe(name, preset, overrides, settings, minutes, steps, eval_every, device, log) -> dict:
    torch.set_num_threads(1)
    from pipeline.config import load_config
    from pipeline.model.looped import LoopedLM, uniform
    from pipeline.train.data import _to_batch
    from pipeline.train.objective import Objective

    s = {**DEFAULTS, **settings}
    L = s["L"]
    visible = FROZEN[0] in overrides  # exited tokens readable by later loops: the needs change
    if s.get("task") == "fold":
        T, vocab_needed, need_mean, val_docs, levels_of, draw = _fold(s, visible)
    else:
        if s.get("target") == "need" and s.get("order", "far") != "far":
            raise ValueError("target 'need' is the far order's mean need (data_prep/depthtask.py mean_need)")
        T, vocab_needed, need_mean, val_docs, levels_of, draw = _hops(s)
    Lt = s.get("levels", L)  # the task's levels (default: one per loop)
    if preset == "depth/base":  # L distinct layers, one pass (settings "layers": another count, e.g. one)
        depth = f"model.n_layers={s.get('layers', L)}"
    else:
        depth = f"model.loops={L}"
    extra = [f"model.router_target_depth={need_mean}"] if s.get("target") == "need" else []
    P = int(s.get("offsets", 0))  # settings "offsets": each training row's positions shifted by a draw from 0..P
    vocab = -(-vocab_needed // 32) * 32  # the task's ids, rounded up (the preset's 64 holds R = 6, L = 4)
    cfg_overrides = [*overrides, *extra, f"model.block_size={T - 1 + P}", f"model.vocab_size={max(64, vocab)}", depth]
    cfg = load_config(preset, cfg_overrides)
    torch.manual_seed(s["seed"])
    model = LoopedLM(cfg.model).to(device)
    if s.get("unconditioned"):  # outside the variant table (grid 9): no modulation tables, so every layer runs
        model.cfg.conditioning = "none"  # its plain path (RMSNorm without affine), the same at every depth
    slot_positions(model, s)
    objective = (_oracle_wait(Objective) if s.get("oracle_wait") else Objective)(model, cfg.objective)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, s["beta2"]), weight_decay=s["wd"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / s["warmup"]))
    Lm = cfg.model.loops
    fold_need = None  # (T-1,) the loops each position needs, capped at the model's (the fold task only)
    if s.get("task") == "fold":
        from data_prep import foldtask

        def slot_need(docs):  # (B, T-1) per row: the need depends on each slot's level
            return foldtask.slot_need_map(docs, Lt, visible)[:, :-1].clip(max=Lm)

        if s.get("slots"):  # the val documents'
            fold_need = slot_need(val_docs)
        else:
            fold_need = foldtask.need(Lt, visible, bool(s.get("descending")))[:-1].clip(max=Lm)
        need_t = torch.from_numpy(fold_need).to(device)  # (T-1,) the same, on the device
    oracle = s.get("depth")  # a forced depth map (`forced_depth`) instead of a router's: "oracle" is the need
    if oracle:
        if fold_need is None or model.router is not None:
            raise ValueError(f"depth {oracle!r} needs task 'fold' and a model without a router")
        need = forced_depth(oracle, Lt, visible, bool(s.get("descending")))[:-1].clip(max=Lm)
        need = torch.from_numpy(need).to(device)  # (T-1,)
    if s.get("warm") and (fold_need is None or model.router is None):
        raise ValueError("settings 'warm' needs task 'fold' and a model with a router")
    exits_set = bool(s.get("exits"))  # the pass at fixed exits; a router, if the preset has one, is not used
    exits = None  # settings "exits": (Lt + 1, Lm) weights of each level's answer at each exit
    if exits_set:
        if oracle or model.cfg.conditioning != "none":
            raise ValueError("settings 'exits' needs a looped model without conditioning or forced depths")
        exits = exit_weights(s["exits"], Lt, Lm).to(device)
    if P and exits is None:
        raise ValueError("settings 'offsets' needs settings 'exits' (the pass it shifts)")
    cap = [1 if s.get("curriculum") else Lt]  # scored levels <= cap; a curriculum raises it at 0.9 accuracy

    def batch(docs, lev, limit):  # the loader's split; only the answers of levels 1..limit scored (-1 elsewhere)
        x, y = _to_batch(docs, cfg.model.vocab_size, name)
        y[torch.from_numpy((lev == 0) | (lev > limit))] = -1
        return x.to(device), y.to(device)

    def logits(x, M, depth=None):  # with settings "exits" a router is bypassed: every token runs the M loops
        return model(x, loops=M, router=not exits_set) if depth is None else forced_depth_logits(model, x, depth, M)

    val_lev = np.ascontiguousarray(levels_of(val_docs)[:, :-1])  # (B, T-1) level of each target
    prefix = None  # the fold task at levels >= 2: (B, T-1) the prefix y_j each context cell x_j holds once folded
    if s.get("task") == "fold" and Lt >= 2:
        prefix = torch.from_numpy(prefix_targets(val_docs, s)[:, :-1]).to(device)
    val = (*batch(val_docs, val_lev, Lt), val_lev)

    @torch.no_grad()
    def evaluate():
        model.eval()
        x, y, lev = val

        def by_level(lg):  # [overall, level 1..Lt] answer accuracy of logits lg (B, T-1, V)
            ok = lg.argmax(-1).cpu().numpy() == y.cpu().numpy()
            return [float(ok[lev > 0].mean())] + [float(ok[lev == k].mean()) for k in range(1, Lt + 1)]

        acc = {}
        for M in [*range(1, Lm + 1), *(["oracle"] if oracle else [])]:
            out = logits(x, Lm, need) if M == "oracle" else logits(x, M)
            lg = out if torch.is_tensor(out) else out.logits
            if M == Lm and model.router is not None:  # executed depth by level: mean, and share at depth >= level
                d = out.depth.cpu().numpy()
                acc["depth_mean"] = [float(d[lev == k].mean()) for k in range(1, Lt + 1)]
                acc["depth_ge_level"] = [float((d[lev == k] >= k).mean()) for k in range(1, Lt + 1)]
                acc["depth_all_tokens"] = float(d.mean())
                if fold_need is not None:  # every position has a need: the context cells too
                    # the network at the oracle depths, its router bypassed: can it compose, whatever the router picks?
                    acc["at_need"] = by_level(logits(x, Lm, need_t))
                    nd = np.broadcast_to(fold_need, d.shape)
                    cells = (lev == 0) & (nd >= 2)  # context cells that must stay for a later query to read them
                    acc["depth_ge_need"] = float((d >= nd).mean())  # every position
                    if cells.any():  # none in the slots layout at L = 2 with frozen keys (every cell needs one)
                        acc["cells_depth_ge_need"] = float((d[cells] >= nd[cells]).mean())
            acc[M] = by_level(lg)
        if prefix is not None:  # per loop i: the context cells whose head reads their prefix (every token all loops)
            cells = prefix >= 0
            acc["prefix"] = [float((p == prefix)[cells].float().mean()) for p in loop_predictions(model, x, Lm)]
        if exits is not None:  # each level at its own exit (no conditioning: exit d is the budget M = d)
            at = [acc[EXITS["need"](k, Lm)[0]][k] for k in range(1, Lt + 1)]
            acc["at_need"] = [float(np.mean(at)), *at]  # a document holds one answer of each level
        model.train()
        return acc

    # one norm over every parameter, as the trainer clips; settings "clip_apart": the router's apart from the network's
    router_params = list(model.router.parameters()) if (s.get("clip_apart") and model.router is not None) else []
    ids = {id(p) for p in router_params}
    clip_groups = [[p for p in model.parameters() if id(p) not in ids], router_params]
    clip_groups = [g for g in clip_groups if g]
    curve, step, t0 = [], 0, time.time()
    raised = [0]  # the step of the curriculum's last raise (settings "window")
    # per level: training answers learnt off their level, withheld (router_exit_weights=depth_label), all (since eval)
    off = np.zeros((Lt, 3), dtype=np.int64)
    model.train()
    while time.time() - t0 < minutes * 60 and (not steps or step < steps):
        d = draw(s["batch"])
        lev = np.ascontiguousarray(levels_of(d)[:, :-1])  # (B, T-1) level of each target
        x, y = batch(d, lev, cap[0])
        warm = bool(s.get("warm")) and cap[0] < s["warm"]  # settings "warm": c: at the oracle depths until cap c
        dm = None  # a forced depth map, or None: the model's own (router) depths and the objective
        if warm and s.get("slots"):  # the need of each training row's own slots (need_t is the val rows')
            dm = torch.from_numpy(slot_need(d)).to(device)
        elif warm:  # a routed model's network trained with its router bypassed (no router loss, no exploration)
            dm = need_t
        elif oracle:
            dm = need
        if dm is not None and s.get("jitter"):  # (lo, hi): each training document's map moved by a draw from lo..hi
            lo, hi = s["jitter"]
            dm = (dm + torch.randint(lo, hi + 1, (len(x), 1), device=device)).clamp(1, Lm)
        if dm is not None and s.get("scramble"):  # p: each training token's depth a uniform draw from 1..L w.p. p
            dm = dm.expand_as(x)
            drawn = torch.rand(x.shape, device=device) < s["scramble"]
            dm = torch.where(drawn, torch.randint(1, Lm + 1, x.shape, device=device), dm)
        if exits is not None:  # every token both loops; each answer scored at its level's exits, by the weights
            if P:  # the states after each loop from h0 at the row's positions, as forward(exits=True) gives them
                from types import SimpleNamespace

                pos = torch.randint(0, P + 1, (len(x), 1), device=device) + torch.arange(x.shape[1], device=device)
                states = []
                model.run_loops(model.wte(x) + model.wpe(pos), uniform(Lm), None, None, collect=states)
                out = SimpleNamespace(exits=[model.norm_f(h) for h in states], short=None)
            else:
                out = model(x, loops=Lm, exits=True, logits=False)  # the expected recipe's exit losses take as pi
            w = exits[torch.from_numpy(lev).to(device).long().clamp(max=Lt)]  # (B, T-1, Lm)
            if s.get("window") and cap[0] > 1 and step - raised[0] < s["window"]:  # the new level's answers at exit 1
                new = torch.from_numpy(lev == cap[0]).to(device)
                at = torch.nn.functional.one_hot(torch.zeros_like(new, dtype=torch.long), Lm).to(w.dtype)
                if s.get("withhold"):  # ... or not learnt at all (the control: the same steps, no exit-1 table)
                    at = torch.zeros_like(at)
                w = torch.where(new[..., None], at, w)
            loss = objective._exit_losses(out, y, w)[0]
        elif dm is None:
            if s.get("oracle_wait"):
                objective.levels = torch.from_numpy(lev).to(device)
            o = objective(x, y)
            loss = o.loss
            if model.router is not None and fold_need is not None:  # the training answers run off their level
                if o.learnt_exit is not None:  # the exit each answer was learnt at (0: withheld)
                    rd = o.learnt_exit.cpu().numpy()
                else:  # pi's weights: the depth the router gives it
                    with torch.no_grad():
                        rd = model.route(model.embed(x)).depth(Lm, model.cfg.router_threshold).cpu().numpy()
                for k in range(1, cap[0] + 1):
                    at = lev == k
                    off[k - 1] += [int(((rd[at] != k) & (rd[at] != 0)).sum()), int((rd[at] == 0).sum()), int(at.sum())]
        else:
            loss = torch.nn.functional.cross_entropy(logits(x, Lm, dm).flatten(0, 1), y.flatten(), ignore_index=-1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in clip_groups:  # each group's gradient norm clipped at 1
            torch.nn.utils.clip_grad_norm_(group, 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % eval_every == 0:
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), "acc": evaluate(), "cap": cap[0]})
            if off.any():  # routed probes: share of the scored level-k training answers run at a depth other than k
                curve[-1]["train_off_level"] = [float(o / max(n, 1)) for o, _, n in off]
                if off[:, 1].any():  # ... and the share withheld from the network's loss
                    curve[-1]["train_withheld"] = [float(w / max(n, 1)) for _, w, n in off]
                off[:] = 0
            if objective.kind_rates is not None:  # (min, mean, max) of the rate at exit 1 of the level-k answers'
                rate = objective.kind_rates.rate[objective.kind_rates.kinds(x)][..., 0].cpu().numpy()  # kinds
                curve[-1]["kind_rate"] = [
                    [float(f(rate[lev == k])) for f in (np.min, np.mean, np.max)] if (lev == k).any() else None
                    for k in range(1, Lt + 1)
                ]
            key = "oracle" if oracle else "at_need" if (warm or exits is not None) else Lm  # the curriculum's
            a = curve[-1]["acc"][key]
            curve[-1]["warm"] = warm
            if cap[0] < Lt and min(a[1 : cap[0] + 1]) >= 0.9:
                cap[0] += 1
                raised[0] = step
            with open(log, "a") as fh:  # progress survives a killed run: one line per point, appended
                fh.write(json.dumps({"name": name, **curve[-1]}) + "\n")
            print(
                f"[{name}] step {step} {key if isinstance(key, str) else f'M={key}'} acc {a[0]:.3f} by level "
                + " ".join(f"{v:.2f}" for v in a[1:]),
                flush=True,
            )
    curve.append({"step": step, "seconds": round(time.time() - t0, 1), "acc": evaluate(), "cap": cap[0]})
    torch.save(
        {"state": model.state_dict(), "overrides": cfg_overrides, "preset": preset, "settings": s},
        Path(log).parent / f"{name.replace(' ', '_')}.pt",
    )
    return {"name": name, "preset": preset, "overrides": overrides, "settings": s, "steps": step, "curve": curve}


class PeriodicPositions(torch.nn.Embedding):
    """Learnt positions that repeat every `num_embeddings` tokens: position p reads row p mod period."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(pos % self.num_embeddings)


def slot_positions(model, s: dict) -> None:
    """Settings "slot_positions" (with "slots"): the model's learnt positions restart at every slot, so a slot's
    tokens sit at positions 0..L+2 wherever the slot lies in the row (initialised from the model's first rows)."""
    if not s.get("slot_positions"):
        return
    if not s.get("slots"):
        raise ValueError("settings 'slot_positions' needs settings 'slots'")
    from data_prep.foldtask import slot_length

    old = model.wpe
    model.wpe = PeriodicPositions(slot_length(s.get("levels", s["L"])), old.embedding_dim).to(old.weight.device)
    with torch.no_grad():
        model.wpe.weight.copy_(old.weight[: model.wpe.num_embeddings])


def loop_predictions(model, x: torch.Tensor, M: int) -> list:
    """The head's argmax (B, T) after each of loops 1..M, every token running every loop."""
    from pipeline.model.looped import uniform

    states = []
    model.run_loops(model.embed(x), uniform(M), None, None, collect=states)
    return [model.head(h)[0].argmax(-1) for h in states]


@torch.no_grad()
def readout(path: str) -> dict:
    """What a saved fold-task probe (`<out>/<probe>.pt`) holds after each loop, every token running every loop,
    read through its head on 1,024 held-out documents: {loop i: [answer accuracy of level 1..L, the prefix
    accuracy of the context cells]} (`prefix_targets`; the evaluation's `prefix` for probes saved before it)."""
    from data_prep import foldtask
    from pipeline.config import load_config
    from pipeline.model.looped import LoopedLM

    ck = torch.load(path, weights_only=False, map_location="cpu")
    s, cfg = ck["settings"], load_config(ck["preset"], ck["overrides"])
    model = LoopedLM(cfg.model)
    slot_positions(model, s)
    model.load_state_dict(ck["state"])
    model.eval()
    if s.get("unconditioned"):
        model.cfg.conditioning = "none"
    _, _, _, docs, levels_of, _ = _fold(s, FROZEN[0] in ck["overrides"])
    x = torch.from_numpy(docs[:, :-1])
    y, lev, pre = docs[:, 1:], levels_of(docs)[:, :-1], prefix_targets(docs, s)[:, :-1]
    slot = None  # settings "slots": (T-1,) the slot each target lies in
    if s.get("slots"):
        slot = (np.arange(x.shape[1]) + 1) // foldtask.slot_length(s["levels"])
    out = {}
    for i, p in enumerate(loop_predictions(model, x, cfg.model.loops), 1):
        p = p.numpy()
        out[i] = [float((p == y)[lev == k].mean()) for k in range(1, s["levels"] + 1)]
        out[i].append(float((p == pre)[pre >= 0].mean()))
        for j in range(int(s.get("slots", 0))):  # each slot's answers apart: levels 1..L (nan where none)
            at = slot[None] == j
            out[f"{i} slot {j}"] = [float((p == y)[(lev == k) & at].mean()) for k in range(1, s["levels"] + 1)]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="1", help="which grid to run (default 1)")
    ap.add_argument("--probes", default="", help="comma-separated probe names from either grid (instead of --grid)")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall time per probe")
    ap.add_argument("--steps", type=int, default=0, help="stop a probe after this many steps (0: time only)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--jobs", type=int, default=0, help="processes at once (default: all probes)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/depth_probe"))
    ap.add_argument("--readout", nargs="+", metavar="PT", help="print `readout` of saved fold probes and stop")
    a = ap.parse_args(argv)
    if a.readout:
        torch.set_num_threads(1)
        res = {}
        for path in a.readout:
            res[path] = r = readout(path)
            cells = "  ".join(f"loop {i}: " + " ".join(f"{v:.2f}" for v in r[i]) for i in r)
            print(f"{Path(path).stem:<72} {cells}  (levels 1..L, then the cells' prefix; by slot: levels 1..L)")
        return res
    names = [n.strip() for n in a.probes.split(",") if n.strip()] or list(GRIDS[a.grid])
    unknown = [n for n in names if n not in GRID]
    if unknown:
        ap.error(f"unknown probe(s) {unknown}; known: {', '.join(GRID)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "depth_probe.jsonl"
    log.unlink(missing_ok=True)
    jobs = [(n, *GRID[n], a.minutes, a.steps, a.eval_every, a.device, str(log)) for n in names]
    ctx = mp.get_context("spawn")
    with ctx.Pool(a.jobs or len(jobs)) as pool:
        results = pool.map(probe, jobs)
    res = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "minutes": a.minutes,
        "probes": results,
    }
    write_json(out / "depth_probe.json", res)
    for r in results:
        if "error" in r:
            print(f"{r['name']:<24} FAILED {r['error']}")
            continue
        last = r["curve"][-1]["acc"]
        print(f"{r['name']:<24} steps {r['steps']:>6}  " + "  ".join(f"M={M}: {v}" for M, v in last.items()))
    return res


if __name__ == "__main__":
    main()
