"""Sigma schedules for flow-matching samplers.

Every schedule returns a 1-d float64 tensor of ``num_steps + 1`` sigmas that decreases from
``sigma_max`` (1 = pure noise) to 0 (data). The convention throughout flowrl is
``x = (1 - sigma) * x0 + sigma * eps``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

ScheduleKind = Literal["linear", "shift", "dynamic_shift"]


def linear_sigmas(num_steps: int, sigma_max: float = 1.0) -> Tensor:
    """Uniform grid from ``sigma_max`` to 0.

    Args:
        num_steps: number of sampler steps (>= 1).
        sigma_max: first sigma, in (0, 1].

    Returns:
        Tensor (num_steps + 1,) float64.

    Raises:
        ValueError: on a non-positive step count or a sigma_max outside (0, 1].
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer; got {num_steps!r}")
    if not 0.0 < sigma_max <= 1.0:
        raise ValueError(f"sigma_max must be in (0, 1]; got {sigma_max}")
    return torch.linspace(sigma_max, 0.0, num_steps + 1, dtype=torch.float64)


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3's timestep shift: ``s' = shift * s / (1 + (shift - 1) * s)``.

    ``shift > 1`` spends more steps at high noise. Endpoints 0 and 1 are fixed.

    Args:
        sigmas: Tensor (N,) in [0, 1].
        shift: positive shift factor (SD3 uses 3.0).

    Returns:
        Tensor (N,) in sigmas' dtype.

    References:
        Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024.
    """
    if shift <= 0:
        raise ValueError(f"shift must be positive; got {shift}")
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def dynamic_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent shift exponent, linear in the number of image tokens."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (image_seq_len - base_seq_len)


def dynamic_shift_sigmas(sigmas: Tensor, mu: float) -> Tensor:
    """Exponential time shift used by FLUX: ``s' = e^mu / (e^mu + (1/s - 1))``.

    Equals :func:`shift_sigmas` with ``shift = e^mu``. Sigma 0 maps to 0.

    Args:
        sigmas: Tensor (N,) in [0, 1].
        mu: shift exponent, e.g. from :func:`dynamic_shift_mu`.

    Returns:
        Tensor (N,) in sigmas' dtype.
    """
    return shift_sigmas(sigmas, math.exp(mu))


def make_sigmas(
    kind: ScheduleKind,
    num_steps: int,
    *,
    shift: float = 1.0,
    image_seq_len: int | None = None,
) -> Tensor:
    """Build a schedule by name.

    Args:
        kind: "linear", "shift" (SD3, uses ``shift``) or "dynamic_shift" (FLUX, uses ``image_seq_len``).
        num_steps: number of sampler steps.
        shift: shift factor for "shift".
        image_seq_len: number of image tokens for "dynamic_shift".

    Returns:
        Tensor (num_steps + 1,) float64 from 1 to 0.
    """
    sigmas = linear_sigmas(num_steps)
    if kind == "linear":
        return sigmas
    if kind == "shift":
        return shift_sigmas(sigmas, shift)
    if kind == "dynamic_shift":
        if image_seq_len is None:
            raise ValueError("schedule 'dynamic_shift' needs image_seq_len (the number of image tokens)")
        return dynamic_shift_sigmas(sigmas, dynamic_shift_mu(image_seq_len))
    raise ValueError(f"unknown schedule {kind!r}; use one of 'linear', 'shift', 'dynamic_shift'")
