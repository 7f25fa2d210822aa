"""Deterministic Euler step of the probability-flow ODE."""

from __future__ import annotations

from torch import Tensor

from .broadcast import expand_like


def euler_step(x: Tensor, v: Tensor, sigma: Tensor | float, sigma_next: Tensor | float) -> Tensor:
    """One Euler step ``x' = x + (sigma_next - sigma) * v``.

    Args:
        x: latent (B, ...) at ``sigma``.
        v: velocity (B, ...) predicted at (x, sigma), ``v = eps - x0``.
        sigma: current sigma, scalar or (B,).
        sigma_next: next sigma (< sigma when denoising), scalar or (B,).

    Returns:
        Latent (B, ...) at ``sigma_next``, in x's dtype.
    """
    dt = expand_like(sigma_next, x) - expand_like(sigma, x)
    return x + dt * v.to(x.dtype)
