"""SAGE-GRPO's manifold-aware SDE step: Flow-GRPO's diffusion integrated exactly over the step.

Derivation. The reverse-time SDE that keeps the flow ODE's marginals, for any diffusion g(u), is

    dx = [v(x, u) - g(u)^2 / 2 * score(x, u)] du + g(u) dW,    u running from sigma down to sigma',

with the score implied by the velocity, ``score = -(x - (1 - u) x0_hat) / u^2 = -(x + (1 - u) v) / u``
(since ``x0_hat = x - u v``). Flow-GRPO's diffusion is ``g(u)^2 = eta^2 u / (1 - u)``. Over one step
freeze v and the score at the start (u = sigma) but integrate the diffusion exactly: the noise
variance is

    s^2 = int_{sigma'}^{sigma} g(u)^2 du = eta^2 int_{sigma'}^{sigma} u / (1 - u) du
        = eta^2 [ log((1 - sigma') / (1 - sigma)) - (sigma - sigma') ]

(use u / (1 - u) = 1 / (1 - u) - 1), and the score term contributes
``-1/2 * score * int_{sigma}^{sigma'} g^2 du = +1/2 s^2 score``, so

    mean = x + (sigma' - sigma) v + s^2 / 2 * score
         = x + (sigma' - sigma) v - s^2 / (2 sigma) * (x + (1 - sigma) v)
    x'   = mean + s z,    z ~ N(0, I).

Flow-GRPO's Euler–Maruyama step uses ``g(sigma)^2 (sigma - sigma')`` instead, the integrand at the
noisy end; since u / (1 - u) increases, ``s^2`` is always smaller, and much smaller as sigma -> 1
where the integrand blows up. The log diverges at sigma = 1, so the *variance* formula evaluates
both ends clamped to ``sigma_max`` (the reference uses 1 - 3e-3): s^2 is the exact integral over
``[min(sigma', sigma_max), min(sigma, sigma_max)]``. The drift and the score use the unclamped
sigma (the score ``-(x + (1 - sigma) v) / sigma`` is finite at sigma = 1).

References:
    Zheng et al., "Manifold-Aware Exploration for RL in Video Generation"
    (SAGE-GRPO), arXiv 2603.21872, 2026 (Tencent-Hunyuan/SAGE-GRPO, ``sde_type="sage_grpo"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sde_finish import GaussianSDE

DEFAULT_SIGMA_MAX = 1.0 - 3e-3


def sage_sde_variance(
    sigma: Tensor, sigma_next: Tensor, eta: Tensor | float, sigma_max: float = DEFAULT_SIGMA_MAX
) -> Tensor:
    """Per-step noise variance ``eta^2 [log((1 - s') / (1 - s)) - (s - s')]`` on clamped sigmas.

    Args:
        sigma: current sigma (any shape), in (0, 1].
        sigma_next: next sigma (same shape), in [0, sigma).
        eta: diffusion scale (broadcastable).
        sigma_max: both ends are clamped to at most this value, in (0, 1).

    Returns:
        Tensor broadcast of the inputs, >= 0; equals ``int_{s'}^{s} eta^2 u / (1 - u) du``.

    Raises:
        ValueError: if sigma_max is not in (0, 1).
    """
    if not 0.0 < sigma_max < 1.0:
        raise ValueError(f"sigma_max must be in (0, 1) so that log(1 - sigma) is finite; got {sigma_max}")
    hi = torch.clamp(sigma, max=sigma_max)
    lo = torch.clamp(sigma_next, max=sigma_max)
    integral = torch.log1p(-lo) - torch.log1p(-hi) - (hi - lo)
    return eta**2 * torch.clamp_min(integral, 0.0)


def sage_sde_moments(  # noqa: D417 - x, v, sigma and sigma_next: see MomentsFn
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    eta: Tensor,
    *,
    sigma_max: float = DEFAULT_SIGMA_MAX,
    score_correction: bool = True,
) -> tuple[Tensor, Tensor]:
    """SAGE-GRPO mean and std ``s`` (the square root of :func:`sage_sde_variance`).

    Args:
        eta: diffusion scale; 0 reproduces the Euler ODE step (SAGE uses 0.5).
        sigma_max: clamp for the variance integral, in (0, 1).
        score_correction: add ``s^2 / 2 * score`` to the mean (the marginal-preserving SDE).
            False gives the reference code's ``sde_solver=False`` mode (plain Euler mean plus
            noise), which does not preserve the marginals.
    """
    var = sage_sde_variance(sigma, sigma_next, eta, sigma_max)
    mean = x + (sigma_next - sigma) * v
    if score_correction:
        mean = mean - var / (2 * sigma) * (x + (1 - sigma) * v)
    return mean, torch.sqrt(var)


sage_sde_step = GaussianSDE(sage_sde_moments)
"""One SAGE-GRPO SDE step, or the log-prob of a stored step (:data:`~flowrl.samplers.types.SDEStepFn`).

The level is ``eta``; the options ``sigma_max`` and ``score_correction`` go to :func:`sage_sde_moments`;
``reduce="mean"`` is SAGE-GRPO's.
"""
