"""Which explored seeds Sol-RL regenerates at full precision: the selection rules, as pure functions.

Stage 1 scores N candidate seeds of one prompt with the cheap explore model; a rule keeps K of
them; stage 2 regenerates exactly those seeds at full precision and trains on them.

Rules (each returns K distinct indices into the N candidates, ascending):

- ``best_worst``: the top ``floor(K/2)`` rewards and the bottom ``K - floor(K/2)`` (Sol-RL's
  default, "top-12 and bottom-12 of 96").
- ``max_variance``: the K rewards whose (population) variance is largest. For sorted rewards the
  best subset is always some top ``m`` plus bottom ``K - m`` (moving an inner value outwards never
  lowers the variance), so the rule tries every ``m`` and keeps the best split (ties: the split
  closest to ``floor(K/2)`` top values).
- ``mean_deviation``: the K largest ``|R - mean(R)|`` (the mean over all N candidates).
- ``random``: K uniformly without replacement, from the given generator (the control).

Among equal rewards the lower index ranks higher (a stable descending sort), so a tie at the top
keeps the lower index and a tie at the bottom keeps the higher one; a rule is a deterministic function of
its inputs.

References:
    Li et al., "FP4 Explore, BF16 Train: Diffusion Reinforcement Learning via Efficient Rollout
    Scaling" (Sol-RL), arXiv 2604.06916, 2026, section 3 (``best_worst``, ``mean_deviation``,
    ``random``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

SelectionRule = Callable[[Tensor, int, "torch.Generator | None"], Tensor]


def _order(rewards: Tensor) -> Tensor:
    """Indices sorting ``rewards`` descending; equal rewards keep the lower index first."""
    return torch.sort(rewards.double(), descending=True, stable=True).indices


def _split(order: Tensor, top: int, k: int) -> Tensor:
    """The first ``top`` and the last ``k - top`` of ``order``, ascending."""
    n = order.numel()
    chosen = torch.cat([order[:top], order[n - (k - top) :]]) if k > top else order[:top]
    return torch.sort(chosen).values


def best_worst(rewards: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """Top ``floor(k/2)`` and bottom ``k - floor(k/2)`` candidates: (k,) int64 indices, ascending."""
    return _split(_order(rewards), k // 2, k)


def max_variance(rewards: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """The ``k`` candidates whose rewards have the largest population variance: (k,) int64, ascending."""
    order = _order(rewards)
    values = rewards.double()[order]
    n, best, best_top = values.numel(), -1.0, k // 2
    for top in sorted(range(k + 1), key=lambda m: (abs(m - k // 2), m)):
        part = torch.cat([values[:top], values[n - (k - top) :]]) if k > top else values[:top]
        var = float(part.var(unbiased=False))
        if var > best + 1e-15 * max(1.0, abs(best)):
            best, best_top = var, top
    return _split(order, best_top, k)


def mean_deviation(rewards: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """The ``k`` largest ``|R - mean(R)|``: (k,) int64 indices, ascending."""
    deviation = (rewards.double() - rewards.double().mean()).abs()
    return torch.sort(_order(deviation)[:k]).values


def random_seeds(rewards: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """``k`` candidates uniformly without replacement (the control): (k,) int64 indices, ascending."""
    return torch.sort(torch.randperm(rewards.numel(), generator=generator)[:k]).values


SELECTION_RULES: dict[str, SelectionRule] = {
    "best_worst": best_worst,
    "max_variance": max_variance,
    "mean_deviation": mean_deviation,
    "random": random_seeds,
}


def select_seeds(rewards: Tensor, k: int, rule: str = "best_worst", generator: torch.Generator | None = None) -> Tensor:
    """Apply a selection rule to one prompt's stage-1 rewards.

    Args:
        rewards: (N,) stage-1 rewards of the N explored seeds, finite.
        k: how many to keep, ``1 <= k <= N``.
        rule: a key of :data:`SELECTION_RULES`.
        generator: RNG for ``random`` (ignored by the other rules).

    Returns:
        (k,) int64 indices into the N candidates, ascending.

    Raises:
        ValueError: an unknown rule, a k outside ``[1, N]``, or rewards that are not a finite 1-D tensor.
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"unknown Sol-RL selection rule {rule!r}; use one of {', '.join(SELECTION_RULES)}")
    if rewards.ndim != 1 or not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"stage-1 rewards must be a finite (N,) tensor; got shape {tuple(rewards.shape)}")
    if not 1 <= k <= rewards.numel():
        raise ValueError(f"cannot keep {k} of {rewards.numel()} explored seeds; choose 1 <= K <= N")
    return SELECTION_RULES[rule](rewards, k, generator)
