"""DanceGRPO's SDE step: the marginal-preserving reverse SDE with a constant diffusion ``eta``.

With ``Delta = sigma_next - sigma < 0`` and the implied score ``-(x + (1 - sigma) v) / sigma``
(equivalently ``-(x - (1 - sigma) x0_hat) / sigma^2`` with ``x0_hat = x - sigma v``), the
Euler–Maruyama transition of ``dx = [v - eta^2 / 2 * score] dsigma + eta dW`` is

    mean = x + [v + eta^2 / (2 sigma) * (x + (1 - sigma) v)] * Delta
    x'   = mean + eta * sqrt(-Delta) * z,    z ~ N(0, I).

This is Flow-GRPO's step (:func:`flowrl.samplers.flow_sde_mean`) with the constant diffusion
``s = eta`` instead of ``a * sqrt(sigma / (1 - sigma))``; Flow-Factory calls it "Dance-SDE".
It needs no special case at sigma = 1 (the score there is ``-x``).

References:
    Xue et al., "DanceGRPO: Unleashing GRPO on Visual Generation", 2025 (XueZeyue/DanceGRPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flow_sde import flow_sde_mean
from .sde_finish import GaussianSDE


def dance_sde_moments(  # noqa: D417 - x, v, sigma and sigma_next: see MomentsFn
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, eta: Tensor
) -> tuple[Tensor, Tensor]:
    """Dance-SDE mean (:func:`~flowrl.samplers.flow_sde_mean` with ``s = eta``), std ``eta * sqrt(sigma - sigma_next)``.

    Args:
        eta: constant diffusion coefficient; 0 reproduces the Euler ODE step (DanceGRPO's scripts
            use 0.3).
    """
    return flow_sde_mean(x, v, sigma, sigma_next, eta), eta * torch.sqrt(sigma - sigma_next)


dance_sde_step = GaussianSDE(dance_sde_moments)
"""One Dance-SDE step, or the log-prob of a stored step (:data:`~flowrl.samplers.types.SDEStepFn`).

The level is ``eta``; ``reduce="mean"`` is DanceGRPO's.
"""
