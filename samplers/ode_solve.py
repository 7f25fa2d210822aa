"""Black-box ODE solvers for forward-process objectives (no log-probs): Euler, Heun, DPM-Solver++(2M).

In the flow parameterisation ``x = (1 - sigma) x0 + sigma eps`` the data prediction is
``x0_hat = x - sigma v`` and the log signal-to-noise ratio is ``lambda = log((1 - sigma) / sigma)``.
DPM-Solver++'s first-order update from s to t,
``x_t = (sigma_t / sigma_s) x_s + (1 - sigma_t - sigma_t (1 - sigma_s) / sigma_s) x0_hat``,
equals the Euler step exactly; the 2M variant replaces x0_hat by a linear extrapolation of the
last two data predictions in lambda.

References:
    Lu et al., "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic Models", 2022.
    Karras et al., "Elucidating the Design Space of Diffusion-Based Generative Models" (Heun), 2022.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .euler import euler_step
from .types import VelocityFn

Method = Literal["euler", "heun", "dpmpp_2m"]


class DPMState(NamedTuple):
    """Multistep memory: the previous data prediction (B, ...) and its lambda."""

    x0_pred: Tensor
    lam: float


def log_snr(sigma: float) -> float:
    """``lambda = log((1 - sigma) / sigma)``; -inf at sigma = 1 and +inf at sigma = 0."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log((1.0 - sigma) / sigma)


def heun_step(x: Tensor, velocity_fn: VelocityFn, sigma: float, sigma_next: float, v: Tensor | None = None) -> Tensor:
    """Heun's 2nd-order step (trapezoid on the velocity); Euler when ``sigma_next = 0``.

    Args:
        x: (B, ...) latent at sigma.
        velocity_fn: ``(x, sigma (B,)) -> v``.
        sigma: the step's start.
        sigma_next: the step's end.
        v: the velocity at (x, sigma) if already computed.

    Returns:
        (B, ...) latent at sigma_next.
    """
    batch = x.shape[0]
    v = velocity_fn(x, torch.full((batch,), sigma, dtype=x.dtype)) if v is None else v
    x_euler = euler_step(x, v, sigma, sigma_next)
    if sigma_next <= 0.0:
        return x_euler
    v_next = velocity_fn(x_euler, torch.full((batch,), sigma_next, dtype=x.dtype))
    return x + (sigma_next - sigma) * 0.5 * (v.to(x.dtype) + v_next.to(x.dtype))


def dpmpp_2m_step(
    x: Tensor, x0_pred: Tensor, sigma: float, sigma_next: float, state: DPMState | None
) -> tuple[Tensor, DPMState]:
    """One DPM-Solver++(2M) step in the flow parameterisation (pure: state in, state out).

    First order (the Euler step) when there is no usable previous prediction, at the first step
    after sigma = 1 and at the final step to sigma = 0.

    Args:
        x: (B, ...) latent at sigma.
        x0_pred: (B, ...) data prediction ``x - sigma v`` at (x, sigma).
        sigma: the step's start, in (0, 1].
        sigma_next: the step's end, in [0, sigma).
        state: the previous step's DPMState or None.

    Returns:
        (x at sigma_next, new state).
    """
    lam, lam_next = log_snr(sigma), log_snr(sigma_next)
    data = x0_pred
    if state is not None and math.isfinite(lam_next) and math.isfinite(state.lam) and math.isfinite(lam):
        r = (lam - state.lam) / (lam_next - lam)
        data = (1 + 1 / (2 * r)) * x0_pred - (1 / (2 * r)) * state.x0_pred
    if sigma_next <= 0.0:
        x_next = data
    else:
        coef = 1.0 - sigma_next - sigma_next * (1.0 - sigma) / sigma
        x_next = (sigma_next / sigma) * x + coef * data
    return x_next, DPMState(x0_pred, lam)


def ode_solve(velocity_fn: VelocityFn, x_init: Tensor, sigmas: Tensor, method: Method = "euler") -> Tensor:
    """Integrate the flow ODE from sigmas[0] to sigmas[-1].

    Args:
        velocity_fn: ``(x (B, ...), sigma (B,)) -> v``.
        x_init: (B, ...) initial noise.
        sigmas: (T + 1,) decreasing grid.
        method: "euler" (T evaluations), "heun" (2T - 1 when the grid ends at 0) or
            "dpmpp_2m" (T evaluations).

    Returns:
        (B, ...) final latent.
    """
    if method not in ("euler", "heun", "dpmpp_2m"):
        raise ValueError(f"unknown solver {method!r}; use 'euler', 'heun' or 'dpmpp_2m'")
    x, state = x_init, None
    grid = [float(s) for s in sigmas]
    for sigma, sigma_next in zip(grid[:-1], grid[1:]):
        v = velocity_fn(x, torch.full((x.shape[0],), sigma, dtype=x.dtype)).to(x.dtype)
        if method == "euler":
            x = euler_step(x, v, sigma, sigma_next)
        elif method == "heun":
            x = heun_step(x, velocity_fn, sigma, sigma_next, v=v)
        else:
            x, state = dpmpp_2m_step(x, x - sigma * v, sigma, sigma_next, state)
    return x
