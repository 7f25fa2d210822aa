"""The rollout loop: integrate a velocity field from noise to data, storing every transition."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .sde_steps import get_sde_step
from .types import Trajectory, VelocityFn


def sde_noise_levels(num_steps: int, noise_level: float, sde_steps: Sequence[int] | None = None) -> Tensor:
    """Per-step noise levels: ``noise_level`` on SDE steps, 0 (ODE) elsewhere.

    Args:
        num_steps: T.
        noise_level: the ``a`` knob on stochastic steps.
        sde_steps: indices of stochastic steps; default all steps but the last, so the final
            sample is not perturbed by noise at sigma -> 0.

    Returns:
        Tensor (T,) float64.
    """
    if sde_steps is None:
        sde_steps = range(num_steps - 1) if num_steps > 1 else range(num_steps)
    levels = torch.zeros(num_steps, dtype=torch.float64)
    for i in sde_steps:
        if not 0 <= i < num_steps:
            raise ValueError(f"sde step {i} is outside 0..{num_steps - 1}")
        levels[i] = noise_level
    return levels


def rollout(
    velocity_fn: VelocityFn,
    x_init: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    *,
    sde: str = "flow",
    generator: torch.Generator | None = None,
    noises: Tensor | None = None,
) -> Trajectory:
    """Sample trajectories with an SDE step (noise level 0 gives exact Euler ODE steps).

    Args:
        velocity_fn: model velocity, called once per step on the whole batch.
        x_init: (B, ...) initial noise at sigmas[0].
        sigmas: (T + 1,) decreasing grid.
        noise_levels: (T,) noise level per step (see :func:`sde_noise_levels`).
        sde: which step of :data:`flowrl.samplers.SDE_STEPS` ("flow" = Flow-GRPO's Flow-SDE) the
            levels are for.
        generator: RNG for the step noises when ``noises`` is None.
        noises: optional (B, T, ...) standard normal noises, for exact replay.

    Returns:
        Trajectory with latents (B, T + 1, ...) and log_probs (B, T).
    """
    num_steps = sigmas.shape[0] - 1
    if noise_levels.shape != (num_steps,):
        raise ValueError(f"noise_levels must have shape ({num_steps},); got {tuple(noise_levels.shape)}")
    step_fn = get_sde_step(sde)
    x = x_init.float()
    batch = x.shape[0]
    grid = sigmas.to(device=x.device, dtype=x.dtype)  # one transfer, not one host-to-device copy per step
    levels = noise_levels.tolist()  # host floats, read once
    latents = x.new_empty((batch, num_steps + 1, *x.shape[1:]))  # filled in place: no list, no stacking copy
    log_probs = x.new_empty((batch, num_steps))
    latents[:, 0] = x
    for i in range(num_steps):
        sigma, sigma_next = grid[i].expand(batch), grid[i + 1].expand(batch)
        v = velocity_fn(x, sigma)
        noise = None if noises is None else noises[:, i]
        step = step_fn(x, v, sigma, sigma_next, levels[i], noise=noise, generator=generator)
        x = step.sample.float()
        latents[:, i + 1] = x
        log_probs[:, i] = step.log_prob
    return Trajectory(latents, log_probs, sigmas, noise_levels, sde)
