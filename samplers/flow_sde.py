"""Flow-GRPO's SDE step: the reverse-time SDE with the same marginals as the flow ODE.

With ``Delta = sigma_next - sigma < 0``, diffusion ``s = a * sqrt(sigma / (1 - sigma))`` and the
implied score ``-(x + (1 - sigma) v) / sigma``, the Euler–Maruyama transition is

    mean = x + [v + s^2 / (2 sigma) * (x + (1 - sigma) v)] * Delta
    x'   = mean + s * sqrt(-Delta) * z,    z ~ N(0, I).

At ``sigma = 1`` the ratio ``sigma / (1 - sigma)`` is infinite; as in the reference
implementation the sigma in the denominator is replaced by the next sigma of the grid.
Means and log-probs are computed in fp32 (fp64 when the inputs are fp64).

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025, eq. (8)–(9).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sde_finish import GaussianSDE


def flow_sde_diffusion(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor | float) -> Tensor:
    """Diffusion coefficient ``s = a * sqrt(sigma / (1 - sigma~))``.

    ``sigma~`` is sigma, or sigma_next where sigma >= 1: at pure noise the reference replaces
    only the denominator's sigma by the next grid value.

    Args:
        sigma: (B, 1, ...) or scalar tensor, current sigma.
        sigma_next: same shape, next sigma.
        noise_level: the ``a`` knob (0 gives the ODE).

    Returns:
        Tensor broadcastable to the latent.
    """
    safe = torch.where(sigma >= 1, sigma_next, sigma)
    return noise_level * torch.sqrt(sigma / (1 - safe))


def flow_sde_mean(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, s: Tensor) -> Tensor:
    """Transition mean ``x + [v + s^2/(2 sigma) (x + (1 - sigma) v)] (sigma_next - sigma)``."""
    dt = sigma_next - sigma
    return x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt


def flow_sde_moments(  # noqa: D417 - x, v, sigma and sigma_next: see MomentsFn
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: Tensor
) -> tuple[Tensor, Tensor]:
    """Flow-SDE mean (:func:`flow_sde_mean`) and std ``s * sqrt(sigma - sigma_next)``.

    Args:
        noise_level: the ``a`` knob; 0 reproduces the Euler ODE step.
    """
    s = flow_sde_diffusion(sigma, sigma_next, noise_level)
    return flow_sde_mean(x, v, sigma, sigma_next, s), s * torch.sqrt(sigma - sigma_next)


flow_sde_step = GaussianSDE(flow_sde_moments)
"""One Flow-SDE step, or the log-prob of a stored step (:data:`~flowrl.samplers.types.SDEStepFn`).

The level is the ``a`` knob; ``reduce="mean"`` is Flow-GRPO's.
"""
