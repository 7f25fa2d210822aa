"""Types shared by the sampler functions: one stochastic step, a velocity field, a trajectory."""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import Tensor


class SDEStep(NamedTuple):
    """Result of one stochastic step.

    Attributes:
        sample: (B, ...) the next latent x' (compute dtype).
        mean: (B, ...) the transition mean (compute dtype).
        std: (B, 1, ..., 1) the transition std ``s * sqrt(-Delta)``.
        log_prob: (B,) log-density of ``sample`` under N(mean, std^2), reduced over elements.
    """

    sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor


SDEStepFn = Callable[..., SDEStep]
"""One Gaussian SDE step of :data:`flowrl.samplers.SDE_STEPS`, or the log-prob of a stored step::

    step(x, v, sigma, sigma_next, level, *, noise=None, generator=None, prev_sample=None,
         reduce="mean") -> SDEStep

Args:
    x: latent (B, ...) at sigma (rank 3, 4 or 5).
    v: velocity (B, ...) at (x, sigma).
    sigma: scalar or (B,), in (0, 1].
    sigma_next: scalar or (B,), in [0, sigma).
    level: the step's own noise knob, scalar or (B,) (Flow-SDE and CPS ``noise_level``, Dance and
        SAGE ``eta``); 0 reproduces the Euler ODE step.
    noise: optional standard normal (B, ...) to use instead of drawing one.
    generator: RNG for drawing the noise when ``noise`` is None.
    prev_sample: if given, no noise is drawn: the step scores this stored x' instead
        (training-time recomputation of the rollout's log-prob).
    reduce: "mean" (as the reference implementations) or "sum" over latent elements for the log-prob.

Returns:
    SDEStep with sample and mean (B, ...), std (B, 1, ..., 1) and log_prob (B,), in fp32
    (fp64 if x or v is fp64).
"""

VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""``velocity_fn(x (B, ...), sigma (B,)) -> v (B, ...)``; conditioning is closed over."""


class Trajectory(NamedTuple):
    """A batch of sampled trajectories.

    Attributes:
        latents: (B, T + 1, ...) fp32 states; ``latents[:, 0]`` is the initial noise and
            ``latents[:, -1]`` the final sample at sigma = sigmas[-1].
        log_probs: (B, T) fp32 log-density of each transition (0 at deterministic steps).
        sigmas: (T + 1,) float64 sigma grid.
        noise_levels: (T,) float64 noise level used at each step (0 = ODE step).
        sde: name of the SDE step in :data:`flowrl.samplers.SDE_STEPS` that drew the samples.
    """

    latents: Tensor
    log_probs: Tensor
    sigmas: Tensor
    noise_levels: Tensor
    sde: str = "flow"
