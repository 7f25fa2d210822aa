"""Shared tail of every Gaussian SDE step: draw (or take) x' and score it."""

from __future__ import annotations

import torch
from torch import Tensor

from .broadcast import batch_view, standard_normal
from .gaussian import Reduction, gaussian_log_prob
from .types import SDEStep


def per_sample_std(std: Tensor, x: Tensor) -> Tensor:
    """Give a scalar or (B, 1, ..., 1) std the shape (B, 1, ..., 1) of ``x``'s batch."""
    if std.ndim == 0:
        return batch_view(std.expand(x.shape[0]), x.ndim)
    return std


def finish_step(
    x: Tensor,
    mean: Tensor,
    std: Tensor,
    *,
    noise: Tensor | None,
    generator: torch.Generator | None,
    prev_sample: Tensor | None,
    reduce: Reduction,
) -> SDEStep:
    """Sample ``x' = mean + std * z`` (or score a stored ``prev_sample``) and build the SDEStep.

    Args:
        x: (B, ...) the current latent (for shape and device only).
        mean: (B, ...) transition mean in the compute dtype.
        std: scalar or (B, 1, ..., 1) transition std in the compute dtype.
        noise: optional standard normal (B, ...) used instead of drawing one.
        generator: RNG used when neither ``noise`` nor ``prev_sample`` is given.
        prev_sample: stored x' to score; no noise is drawn when given.
        reduce: "mean" or "sum" over non-batch dims for the log-prob.

    Returns:
        SDEStep(sample, mean, std (B, 1, ..., 1), log_prob (B,)).
    """
    dtype = mean.dtype
    std = per_sample_std(std, x)
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x, generator)
        prev_sample = mean + std * noise.to(dtype)
    prev_sample = prev_sample.to(dtype)
    return SDEStep(prev_sample, mean, std, gaussian_log_prob(prev_sample, mean, std, reduce))
