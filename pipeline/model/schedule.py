"""Step schedules (trajectories) and the per-token time table.

A pass with budget M has a schedule delta = (delta_1..delta_M), sum 1. A token of depth m uses the first m
steps renormalised: delta_{m,i} = delta_i / sum_{j<=m} delta_j and t_{m,i} = sum_{j<i} delta_{m,j} (its own
trajectory, `model.exit_schedule=own`); or, with `model.exit_schedule=prefix`, the first m steps as they are,
delta_{m,i} = delta_i and t_{m,i} = sum_{j<i} delta_j, so that a depth-m token is the pass's trajectory stopped
after loop m (an early exit).
The conditioning depends only on (m, i) with 1 <= i <= m <= M: K = M(M+1)/2 distinct values, stored in
the order (1,1), (2,1), (2,2), (3,1), ... so that (m, i) sits at index m(m-1)/2 + i - 1.
"""

from __future__ import annotations

import numpy as np
import torch


def uniform(M: int) -> torch.Tensor:
    """The full/elastic trajectory: M steps of 1/M. (M,) float64."""
    return torch.full((M,), 1.0 / M, dtype=torch.float64)


def sample_shortcut(L: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Shortcut trajectory: S ~ U{1..L-1}, then positive integers k_1..k_S summing to L drawn uniformly
    (S-1 distinct cut points among 1..L-1). Returns k (S,) int64; delta = k / L."""
    assert L >= 2, "a shortcut needs L >= 2"
    S = int(torch.randint(1, L, (1,), generator=generator).numpy()[0])  # a CPU draw: no device sync
    cuts = torch.randperm(L - 1, generator=generator)[: S - 1] + 1
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), cuts.sort().values, torch.tensor([L])])
    return bounds.diff()


def step_shortcut(L: int, seed: int, step: int) -> torch.Tensor:
    """The shortcut schedule of optimizer step `step` (1-based) of a run seeded `seed` (train.seed): `sample_shortcut`
    from a CPU generator seeded with the first 32-bit word of numpy's `SeedSequence([seed, step])` (torch's CPU
    generator keeps 32 bits of a seed). A function of (seed, step, L) alone: every micro-batch of the step on every
    rank, at any world size, grad-accum or ZeRO stage, gets the same schedule; torch's global RNG is not read."""
    key = int(np.random.SeedSequence([seed, step]).generate_state(1)[0])
    return sample_shortcut(L, torch.Generator().manual_seed(key))


def table_index(depth: torch.Tensor | int, i: int) -> torch.Tensor | int:
    """Index of (m, i) in the time table for a depth tensor (or one int depth); rows with m < i are clamped
    (never used)."""
    m = depth.clamp(min=i) if isinstance(depth, torch.Tensor) else max(depth, i)
    return m * (m - 1) // 2 + (i - 1)


def time_table(delta: torch.Tensor, prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, dt), each (K,) float64 for K = M(M+1)/2, in the (m, i) order above; prefix: every depth's rows are the
    pass's own first m steps (not renormalised)."""
    M = delta.numel()
    ts, dts = [], []
    for m in range(1, M + 1):
        d = delta[:m] if prefix else delta[:m] / delta[:m].sum()
        ts.append(torch.cat([d.new_zeros(1), d.cumsum(0)[:-1]]))
        dts.append(d)
    return torch.cat(ts), torch.cat(dts)
