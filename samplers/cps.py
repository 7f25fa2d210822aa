"""Coefficients-Preserving Sampling (CPS), Flow-GRPO's ``cps`` step type.

CPS is a DDIM-style step for the straight path ``x = (1 - sigma) x0 + sigma x1``: it predicts
both endpoints from (x, v),

    x0_hat = x - sigma v,        x1_hat = x + (1 - sigma) v,

and re-noises to ``sigma_next`` so that the coefficients of x0 and of the total noise stay
``(1 - sigma_next, sigma_next)``: with ``s = sigma_next * sin(a pi / 2)``,

    mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) x1_hat
    x'   = mean + s z,    z ~ N(0, I)

(the fresh noise ``s z`` and the reused ``x1_hat`` add up to noise of std ``sigma_next``). The
std is ``s``, not ``s * sqrt(-Delta)``. At ``a = 0`` the step is deterministic and equals the
Euler step, because ``x0_hat`` and ``x1_hat`` lie on the line ``x + (u - sigma) v`` at u = 0 and
u = 1, and ``(1 - sigma_next) x0_hat + sigma_next x1_hat`` is that line at u = sigma_next.
At ``sigma_next = 0`` the step is the deterministic ``x0_hat`` (= the Euler step to 0).

Log-prob: :func:`cps_step` returns the true Gaussian log-density of N(mean, s^2) (averaged
over elements, 0 where s = 0). The reference implementation instead drops every constant and
the variance, ``log p = -mean((x' - mean)^2)``; that quantity is :func:`cps_log_prob_reference`.
The two differ by ``1/(2 s^2)`` scaling and an additive constant per step, so PPO ratios
differ unless the same form is used for old and new log-probs.

References:
    "Coefficients-Preserving Sampling for Reinforcement Learning with Flow Matching", 2025;
    Flow-GRPO repository (yifan123/flow_grpo), ``sde_type="cps"``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .broadcast import compute_dtype
from .sde_finish import GaussianSDE


def cps_std(sigma_next: Tensor, noise_level: Tensor) -> Tensor:
    """CPS noise std ``s = sigma_next * sin(a pi / 2)`` (broadcastable, same dtype as inputs)."""
    return sigma_next * torch.sin(noise_level * (math.pi / 2))


def cps_mean(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, s: Tensor) -> Tensor:
    """CPS mean ``(1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) x1_hat``.

    Args:
        x: (B, ...) latent in the compute dtype.
        v: (B, ...) velocity in the compute dtype.
        sigma: current noise level, broadcastable to x.
        sigma_next: next noise level, broadcastable to x.
        s: the CPS noise std (:func:`cps_std`), broadcastable to x.

    Returns:
        Tensor (B, ...).
    """
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    keep = torch.sqrt(torch.clamp_min(sigma_next**2 - s**2, 0.0))
    return (1 - sigma_next) * x0_hat + keep * x1_hat


def cps_moments(  # noqa: D417 - x, v, sigma and sigma_next: see MomentsFn
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: Tensor
) -> tuple[Tensor, Tensor]:
    """CPS mean (:func:`cps_mean`) and std ``s`` (:func:`cps_std`), not ``s * sqrt(-Delta)``.

    Args:
        noise_level: the ``a`` knob in [0, 1]; 0 is the deterministic step (equal to Euler), 1
            replaces all the noise (Flow-GRPO recommends 0.8).
    """
    std = cps_std(sigma_next, noise_level)
    return cps_mean(x, v, sigma, sigma_next, std), std


cps_step = GaussianSDE(cps_moments)
"""One CPS step, or the log-prob of a stored step (:data:`~flowrl.samplers.types.SDEStepFn`).

The level is the ``a`` knob; the log_prob is the true Gaussian one (see :func:`cps_log_prob_reference`).
"""


def cps_log_prob_reference(sample: Tensor, mean: Tensor) -> Tensor:
    """The reference implementation's CPS "log-prob": ``-mean((x' - mean)^2)`` per sample.

    No constants and no variance; provided for parity with Flow-GRPO's ``cps`` trainers.

    Args:
        sample: (B, ...) the realised x'.
        mean: (B, ...) the CPS mean.

    Returns:
        Tensor (B,) in fp32 (fp64 if either input is fp64).
    """
    dtype = compute_dtype(sample, mean)
    diff = sample.to(dtype) - mean.to(dtype)
    return -(diff**2).mean(dim=tuple(range(1, diff.ndim)))
