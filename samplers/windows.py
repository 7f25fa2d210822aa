"""SDE windows: noise on a few consecutive steps only, ODE (noise 0) everywhere else.

A window is ``[start, start + size)`` over step indices 0..T-1. Three ways to pick ``start``:

* fixed: a constant start (pass it straight to :func:`window_noise_levels`);
* random (Flow-GRPO-Fast): :func:`random_window_start`, uniform per batch in a range;
* progressive (MixGRPO): :func:`progressive_window_start`, slides with the training iteration.

All three are pure functions of their arguments; the result of :func:`window_noise_levels` is
the (T,) per-step noise-level tensor :func:`flowrl.samplers.rollout` accepts.

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025 (Flow-GRPO-Fast).
    Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", 2025.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_window(num_steps: int, size: int) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer; got {num_steps!r}")
    if not isinstance(size, int) or not 1 <= size <= num_steps:
        raise ValueError(f"window size must be an integer in 1..num_steps={num_steps}; got {size!r}")


def window_noise_levels(num_steps: int, noise_level: float, start: int, size: int) -> Tensor:
    """Per-step noise levels: ``noise_level`` on steps ``start .. start + size - 1``, 0 elsewhere.

    Args:
        num_steps: T, the number of sampler steps.
        noise_level: the SDE noise knob inside the window.
        start: first stochastic step index, 0 <= start <= T - size.
        size: number of stochastic steps, 1 <= size <= T.

    Returns:
        Tensor (T,) float64.

    Raises:
        ValueError: on a window that does not fit in 0..T-1.
    """
    _check_window(num_steps, size)
    if not isinstance(start, int) or not 0 <= start <= num_steps - size:
        raise ValueError(f"window start must be an integer in 0..{num_steps - size} (num_steps - size); got {start!r}")
    levels = torch.zeros(num_steps, dtype=torch.float64)
    levels[start : start + size] = noise_level
    return levels


def random_window_start(num_steps: int, size: int, lo: int, hi: int, generator: torch.Generator | None = None) -> int:
    """Flow-GRPO-Fast's window start: uniform over ``lo .. hi - size`` (window inside ``[lo, hi)``).

    Args:
        num_steps: T.
        size: window size, 1 <= size <= hi - lo.
        lo: first step the window may cover, >= 0.
        hi: one past the last step the window may cover, <= T.
        generator: RNG (torch's default when None).

    Returns:
        The start index (a Python int).

    Raises:
        ValueError: on a range that does not hold a window of this size.
    """
    _check_window(num_steps, size)
    if not 0 <= lo <= hi <= num_steps or hi - lo < size:
        raise ValueError(
            f"window range [lo, hi) = [{lo}, {hi}) must lie in [0, {num_steps}] and hold size={size} steps"
        )
    return int(torch.randint(lo, hi - size + 1, (1,), generator=generator).item())


def progressive_window_start(iteration: int, num_steps: int, size: int, shift_every: int, stride: int = 1) -> int:
    """MixGRPO's sliding window: move by ``stride`` every ``shift_every`` iterations, then wrap.

    The starts visited are 0, stride, 2 stride, ... up to the last valid start ``T - size``;
    the one after that is 0 again.

    Args:
        iteration: training iteration (>= 0).
        num_steps: T.
        size: window size, 1 <= size <= T.
        shift_every: iterations spent at each position (MixGRPO uses 25), >= 1.
        stride: steps moved per shift (MixGRPO's ``prog_overlap_step``, 1), >= 1.

    Returns:
        The start index for this iteration.

    Raises:
        ValueError: on a negative iteration or a non-positive shift_every / stride.
    """
    _check_window(num_steps, size)
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0; got {iteration}")
    if shift_every < 1 or stride < 1:
        raise ValueError(f"shift_every and stride must be >= 1; got shift_every={shift_every}, stride={stride}")
    positions = (num_steps - size) // stride + 1
    return (iteration // shift_every) % positions * stride
