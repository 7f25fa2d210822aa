"""Per-prompt diversity, drift from the base model's samples, and mean with a confidence interval.

All distances are root-mean-square pixel differences, ``||a - b||_2 / sqrt(D)`` over the D values
of an image (or clip) in [0, 1], so they read the same at every resolution: 0 is identical, 1 is
black against white everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def _flat(images: Tensor, name: str) -> Tensor:
    if images.ndim < 2:
        raise ValueError(f"{name} must be (B, ...) images; got shape {tuple(images.shape)}")
    return images.detach().to(torch.float64).cpu().reshape(len(images), -1)


def prompt_diversity(images: Tensor, group_ids: Tensor | Sequence[int]) -> Tensor:
    """Mean pairwise RMS distance between the samples of each prompt.

    ``div_g = mean_{i != j in g} ||x_i - x_j||_2 / sqrt(D)``.

    Args:
        images: (B, C, H, W) or (B, F, C, H, W) in [0, 1].
        group_ids: (B,) prompt index of each sample; every group needs two or more samples.

    Returns:
        (G,) float64 diversity per group, in the order of ``group_ids.unique()`` (sorted).

    Raises:
        ValueError: shapes disagree or a group has fewer than two samples.
    """
    flat = _flat(images, "images")
    ids = torch.as_tensor(group_ids).cpu()
    if ids.shape != (len(flat),):
        raise ValueError(f"group_ids must be ({len(flat)},) to match images; got {tuple(ids.shape)}")
    scale = math.sqrt(flat.shape[1])
    out = []
    for g in ids.unique().tolist():
        rows = flat[ids == g]
        n = len(rows)
        if n < 2:
            raise ValueError(f"prompt group {g} has {n} sample; diversity needs at least two seeds per prompt")
        dist = torch.cdist(rows, rows) / scale
        out.append(dist.sum() / (n * (n - 1)))
    return torch.stack(out)


def sample_drift(images: Tensor, base_images: Tensor) -> Tensor:
    """RMS distance of each sample from the base model's sample of the same prompt and seed.

    Args:
        images: (B, ...) samples of the trained model, in [0, 1].
        base_images: (B, ...) the base model's samples on the same prompts and seeds.

    Returns:
        (B,) float64 distances.
    """
    a, b = _flat(images, "images"), _flat(base_images, "base_images")
    if a.shape != b.shape:
        raise ValueError(f"images {tuple(images.shape)} and base_images {tuple(base_images.shape)} must match")
    return (a - b).norm(dim=1) / math.sqrt(a.shape[1])


@dataclass(frozen=True)
class MeanCI:
    """A mean and its two-sided confidence interval (Student t)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width (the ``±`` of a table)."""
        return (self.high - self.low) / 2


def mean_ci(values: Tensor | Sequence[float], level: float = 0.95) -> MeanCI:
    """Mean of finite values with a Student-t confidence interval.

    ``mean ± t * s / sqrt(n)`` with the sample standard deviation ``s`` (n - 1) and ``t`` the
    two-sided quantile of ``level`` of Student's t with n - 1 degrees of freedom (a normal quantile
    covers only ~80 % at n = 3 for a nominal 95 %); NaNs (a reward that does not apply) are left out.

    Args:
        values: (N,) numbers.
        level: confidence level in (0, 1).

    Returns:
        :class:`MeanCI`; with one value the interval is that value, with none everything is NaN.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1); got {level}")
    x = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    x = x[torch.isfinite(x)]
    n = len(x)
    if n == 0:
        return MeanCI(math.nan, math.nan, math.nan, 0)
    mean = float(x.mean())
    if n == 1:
        return MeanCI(mean, mean, mean, 1)
    from scipy.stats import t as student_t

    quantile = float(student_t.ppf(0.5 + level / 2, n - 1))
    half = quantile * float(x.std(unbiased=True)) / math.sqrt(n)
    return MeanCI(mean, mean - half, mean + half, n)
