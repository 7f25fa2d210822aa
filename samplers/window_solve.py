"""Clean samples from a mixed SDE/ODE solve: Flow-SDE steps inside a window, Euler outside."""

from __future__ import annotations

import torch
from torch import Tensor

from .flow_sde import flow_sde_step
from .types import VelocityFn


def sde_window_solve(
    velocity_fn: VelocityFn,
    x_init: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    generator: torch.Generator | None = None,
    *,
    noises: Tensor | None = None,
) -> Tensor:
    """Integrate from sigmas[0] to sigmas[-1] and keep only the final latent (no log-probs).

    Every step is :func:`flowrl.samplers.flow_sde_step`; where ``noise_levels`` is 0 that step is
    exactly the Euler ODE step. The noise stream is consumed exactly as in
    :func:`flowrl.samplers.rollout` (one draw per step), so for fp32 inputs the result equals
    ``rollout(...).latents[:, -1]`` without storing the T + 1 latents. Forward-process trainers
    (DiffusionNFT, AWM) that only need clean samples use this.

    Args:
        velocity_fn: ``(x (B, ...), sigma (B,)) -> v (B, ...)``.
        x_init: (B, ...) initial noise at sigmas[0].
        sigmas: (T + 1,) decreasing grid.
        noise_levels: (T,) Flow-SDE noise level per step, e.g. from
            :func:`flowrl.samplers.window_noise_levels`.
        generator: RNG for the step noises when ``noises`` is None.
        noises: optional (B, T, ...) standard normal noises for exact replay.

    Returns:
        (B, ...) final latent, in x_init's floating dtype (fp32 for non-fp64 inputs).

    Raises:
        ValueError: if noise_levels does not have one entry per step.
    """
    num_steps = sigmas.shape[0] - 1
    if noise_levels.shape != (num_steps,):
        raise ValueError(
            f"noise_levels must have shape ({num_steps},) for {num_steps} steps; got {tuple(noise_levels.shape)}"
        )
    x = x_init if x_init.dtype == torch.float64 else x_init.float()
    batch = x.shape[0]
    grid = sigmas.to(device=x.device, dtype=x.dtype)  # one transfer, not one host-to-device copy per step
    levels = noise_levels.tolist()  # host floats, read once
    for i in range(num_steps):
        sigma, sigma_next = grid[i].expand(batch), grid[i + 1].expand(batch)
        noise = None if noises is None else noises[:, i]
        v = velocity_fn(x, sigma)
        x = flow_sde_step(x, v, sigma, sigma_next, levels[i], noise=noise, generator=generator).sample.to(x.dtype)
    return x
