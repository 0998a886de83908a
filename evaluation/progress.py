"""`tlf eval`'s progress bar: one tqdm bar on stderr over the whole evaluation (every budget's task examples and
perplexity windows), with the current budget and task and an ETA; off when stderr is not a terminal or with
eval.progress=false (--no-progress), and then nothing is drawn at all."""

from __future__ import annotations

import sys
from contextlib import nullcontext

from tqdm import tqdm


class Progress:
    def __init__(self, total: float, enabled: bool = True, file=None):
        self.bar = tqdm(
            total=total,
            file=file or sys.stderr,
            disable=None if enabled else True,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}",
        )

    def stage(self, text: str) -> None:
        self.bar.set_description_str(text)

    def part(self, weight: float, parts: int):
        """An update function for one unit of work worth `weight` (its examples or windows) done in `parts` steps:
        f(n) advances the bar by weight * n / parts."""
        return lambda n: self.bar.update(weight * n / max(parts, 1))

    def say(self, log):
        """`log` with the bar cleared while the line is printed (no half-overwritten lines on a terminal)."""

        def f(msg):
            with tqdm.external_write_mode(file=sys.stdout) if not self.bar.disable else nullcontext():
                log(msg)

        return f

    def close(self) -> None:
        self.bar.close()
