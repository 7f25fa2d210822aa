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

from .broadcast import compute_dtype, expand_like
from .gaussian import Reduction
from .sde_finish import finish_step
from .types import SDEStep


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


def flow_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    noise_level: Tensor | float,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduction = "mean",
) -> SDEStep:
    """One Flow-SDE step, or the log-prob of a stored step.

    Args:
        x: latent (B, ...) at sigma (rank 3, 4 or 5).
        v: velocity (B, ...) at (x, sigma).
        sigma: scalar or (B,), in (0, 1].
        sigma_next: scalar or (B,), in [0, sigma).
        noise_level: the ``a`` knob, scalar or (B,); 0 reproduces the Euler ODE step.
        noise: optional standard normal (B, ...) to use instead of drawing one.
        generator: RNG for drawing the noise when ``noise`` is None.
        prev_sample: if given, no noise is drawn: the step scores this stored x' instead
            (training-time recomputation of the rollout's log-prob).
        reduce: "mean" (Flow-GRPO) or "sum" over latent elements for the log-prob.

    Returns:
        SDEStep with sample, mean, std and log_prob.
    """
    dtype = compute_dtype(x, v)
    x32, v32 = x.to(dtype), v.to(dtype)
    sig, sig_next = expand_like(sigma, x32), expand_like(sigma_next, x32)
    a = expand_like(noise_level, x32)
    s = flow_sde_diffusion(sig, sig_next, a)
    mean = flow_sde_mean(x32, v32, sig, sig_next, s)
    std = s * torch.sqrt(sig - sig_next)
    return finish_step(x, mean, std, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce)
