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

from .broadcast import compute_dtype, expand_like
from .flow_sde import flow_sde_mean
from .gaussian import Reduction
from .sde_finish import finish_step
from .types import SDEStep


def dance_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    eta: Tensor | float,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduction = "mean",
) -> SDEStep:
    """One Dance-SDE step, or the log-prob of a stored step.

    Args:
        x: latent (B, ...) at sigma (rank 3, 4 or 5).
        v: velocity (B, ...) at (x, sigma).
        sigma: scalar or (B,), in (0, 1].
        sigma_next: scalar or (B,), in [0, sigma).
        eta: constant diffusion coefficient, scalar or (B,); 0 reproduces the Euler ODE step
            (DanceGRPO's scripts use 0.3).
        noise: optional standard normal (B, ...) to use instead of drawing one.
        generator: RNG for drawing the noise when ``noise`` is None.
        prev_sample: if given, no noise is drawn: the step scores this stored x' instead.
        reduce: "mean" (DanceGRPO) or "sum" over latent elements for the log-prob.

    Returns:
        SDEStep with sample, mean (B, ...), std ``eta * sqrt(sigma - sigma_next)`` (B, 1, ..., 1)
        and log_prob (B,), in fp32 (fp64 if x or v is fp64).
    """
    dtype = compute_dtype(x, v)
    x32, v32 = x.to(dtype), v.to(dtype)
    sig, sig_next = expand_like(sigma, x32), expand_like(sigma_next, x32)
    s = expand_like(eta, x32)
    mean = flow_sde_mean(x32, v32, sig, sig_next, s)
    std = s * torch.sqrt(sig - sig_next)
    return finish_step(x, mean, std, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce)
