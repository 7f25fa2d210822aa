"""Diagonal Gaussian log-density shared by the SDE samplers."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["mean", "sum"]


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor, reduce: Reduction = "mean") -> Tensor:
    """Log-density of ``sample`` under N(mean, std^2), reduced over all non-batch dims.

    Flow-GRPO averages (``reduce="mean"``) rather than sums, so ratios are per element.
    Where ``std == 0`` (a deterministic step) the log-prob is defined as 0.

    Args:
        sample: (B, ...) the realised next state.
        mean: (B, ...) transition mean.
        std: transition std, broadcastable to sample (e.g. (B, 1, ..., 1)).
        reduce: "mean" or "sum" over non-batch dimensions.

    Returns:
        Tensor (B,) in the dtype of the inputs (callers pass fp32 or fp64).
    """
    positive = std > 0  # on std's own shape: log and squares of a per-sample std cost B ops, not B x C x H x W
    safe = torch.where(positive, std, torch.ones_like(std))
    elem = -((sample - mean) ** 2) / (2 * safe**2) - torch.log(safe) - 0.5 * math.log(2 * math.pi)
    elem = torch.where(positive, elem, torch.zeros_like(elem))
    dims = tuple(range(1, sample.ndim))
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum'; got {reduce!r}")
    if not dims:  # (B,) samples of one element each: torch would reduce an empty dim tuple over the batch too
        return elem
    return elem.mean(dim=dims) if reduce == "mean" else elem.sum(dim=dims)
