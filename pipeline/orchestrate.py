"""train -> eval -> compare as a plan of `tlf` commands: what `tlf sweep` and `make demo` both run.

A `Stage` is one `tlf` command (optionally behind a training launcher such as `deepspeed --num_gpus 8`);
`variant_stages()` is the plan for a set of variants: each trained model once (naive-loop-ee trains as
base-loop, pipeline/config.py's VARIANT_TABLE), each variant evaluated from its trained checkpoint (with
`--variant` where it borrows another's), then one `tlf compare`. `run()` executes stages in order and stops at
the first failure.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from pipeline.config import trained_variant

WHICH_TLF = "$(which tlf)"  # how a launcher line names the tlf entry point in a printed script


@dataclass
class Stage:
    title: str
    args: list[str]  # the tlf sub-command and its arguments
    launcher: list[str] = field(default_factory=list)  # e.g. ["deepspeed", "--num_gpus", "8"]

    def words(self) -> list[str]:
        """The command as a user types it: `tlf ...`, or `<launcher> $(which tlf) ...`."""
        return [*self.launcher, WHICH_TLF, *self.args] if self.launcher else ["tlf", *self.args]

    def shell(self) -> str:
        return " ".join(w if w == WHICH_TLF else shlex.quote(w) for w in self.words())

    def argv(self) -> list[str]:
        """What runs here: this interpreter's `pipeline.cli`, or the launcher with the installed `tlf`."""
        if not self.launcher:
            return [sys.executable, "-m", "pipeline.cli", *self.args]
        return [*self.launcher, shutil.which("tlf") or "tlf", *self.args]


def variant_stages(
    scale: str,
    variants: list[str],
    out: str,
    train_args: Callable[[str], list[str]],
    eval_args: list[str],
    compare_args: list[str],
    launcher: list[str] = (),
    presets: dict[str, str] | None = None,
) -> list[Stage]:
    """Train each distinct trained model once, evaluate every variant, compare: checkpoints in
    `<out>/checkpoints/<trained variant>`, evaluations in `<out>/eval/<variant>`. `train_args(v)` gives the extra
    `tlf train` arguments of trained variant v; `eval_args` and `compare_args` are appended to every eval and
    to the compare. presets: the preset a trained variant trains from where it is not `<scale>/<variant>` (e.g.
    t-loopformer from `small/t-loopformer-budget`, a recipe of its own)."""
    trained = list(dict.fromkeys(trained_variant(v) for v in variants))
    preset = {t: (presets or {}).get(t, f"{scale}/{t}") for t in trained}
    stages = [
        Stage(
            f"train {preset[t]}",
            ["train", preset[t], f"checkpoint.dir={out}/checkpoints/{t}", *train_args(t)],
            list(launcher),
        )
        for t in trained
    ]
    for v in variants:
        t = trained_variant(v)
        label = f"eval {preset[v] if v in preset else f'{scale}/{v}'}" + (f" (the {t} checkpoint)" if t != v else "")
        stages.append(
            Stage(
                label,
                [
                    "eval",
                    f"{out}/checkpoints/{t}",
                    *(["--variant", v] if t != v else []),
                    "--out",
                    f"{out}/eval/{v}",
                    *eval_args,
                ],
            )
        )
    stages.append(Stage("compare", ["compare", *compare_args]))
    return stages


def run(
    stages: list[Stage], announce: Callable[[Stage], None], fail: Callable[[Stage, int], None]
) -> list[tuple[str, float]]:
    """Runs the stages in order; `announce` before each, `fail(stage, exit code)` on a failure (it should raise
    or exit; the plan stops there either way). Returns (title, seconds) per stage."""
    done = []
    for st in stages:
        announce(st)
        t0 = time.time()
        try:
            code = subprocess.run(st.argv()).returncode
        except FileNotFoundError:  # the launcher is not installed
            code = 127
        if code != 0:
            fail(st, code)
            break
        done.append((st.title, time.time() - t0))
    return done
