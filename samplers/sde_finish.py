"""The body every Gaussian SDE step shares: inputs in the compute dtype, then draw (or take) x' and score it.

A step differs from the others only in its moments, the mean and std of the Gaussian it draws x'
from; :class:`GaussianSDE` turns a :data:`MomentsFn` into the :data:`~flowrl.samplers.types.SDEStepFn`
that rollouts and objectives call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .broadcast import batch_view, compute_dtype, expand_like, standard_normal
from .gaussian import Reduction, gaussian_log_prob
from .types import SDEStep

MomentsFn = Callable[..., tuple[Tensor, Tensor]]
"""``moments(x, v, sigma, sigma_next, level, **options) -> (mean, std)`` of one SDE step.

Args:
    x: (B, ...) latent at sigma, in the compute dtype (fp32, or fp64 if x or v is fp64).
    v: (B, ...) velocity at (x, sigma), in the compute dtype.
    sigma: (B, 1, ..., 1) or 0-d current sigma, in (0, 1].
    sigma_next: (B, 1, ..., 1) or 0-d next sigma, in [0, sigma).
    level: (B, 1, ..., 1) or 0-d noise knob of the step; 0 gives the Euler ODE step.

Returns:
    mean (B, ...) and std (B, 1, ..., 1) or 0-d of the Gaussian x' is drawn from.
"""


@dataclass(frozen=True)
class GaussianSDE:
    """A Gaussian SDE step given by its moments; calling it is the :data:`~flowrl.samplers.types.SDEStepFn`.

    Attributes:
        moments: the step's :data:`MomentsFn`.
    """

    moments: MomentsFn

    def __call__(
        self,
        x: Tensor,
        v: Tensor,
        sigma: Tensor | float,
        sigma_next: Tensor | float,
        level: Tensor | float,
        *,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        prev_sample: Tensor | None = None,
        reduce: Reduction = "mean",
        **options: Any,
    ) -> SDEStep:
        """One step, or the log-prob of a stored step; see :data:`~flowrl.samplers.types.SDEStepFn`.

        ``options`` go to the moments (e.g. SAGE's ``sigma_max`` and ``score_correction``).
        """
        dtype = compute_dtype(x, v)
        x32, v32 = x.to(dtype), v.to(dtype)
        sig, sig_next = expand_like(sigma, x32), expand_like(sigma_next, x32)
        mean, std = self.moments(x32, v32, sig, sig_next, expand_like(level, x32), **options)
        return finish_step(x, mean, std, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce)


def per_sample_std(std: Tensor, x: Tensor) -> Tensor:
    """Give a scalar or (B, 1, ..., 1) std the shape (B, 1, ..., 1) of ``x``'s batch."""
    if std.ndim == 0:
        return batch_view(std.expand(x.shape[0]), x.ndim)
    return std


def finish_step(
    x: Tensor,
    mean: Tensor,
    std: Tensor,
    *,
    noise: Tensor | None,
    generator: torch.Generator | None,
    prev_sample: Tensor | None,
    reduce: Reduction,
) -> SDEStep:
    """Sample ``x' = mean + std * z`` (or score a stored ``prev_sample``) and build the SDEStep.

    Args:
        x: (B, ...) the current latent (for shape and device only).
        mean: (B, ...) transition mean in the compute dtype.
        std: scalar or (B, 1, ..., 1) transition std in the compute dtype.
        noise: optional standard normal (B, ...) used instead of drawing one.
        generator: RNG used when neither ``noise`` nor ``prev_sample`` is given.
        prev_sample: stored x' to score; no noise is drawn when given.
        reduce: "mean" or "sum" over non-batch dims for the log-prob.

    Returns:
        SDEStep(sample, mean, std (B, 1, ..., 1), log_prob (B,)).
    """
    dtype = mean.dtype
    std = per_sample_std(std, x)
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x, generator)
        prev_sample = mean + std * noise.to(dtype)
    prev_sample = prev_sample.to(dtype)
    return SDEStep(prev_sample, mean, std, gaussian_log_prob(prev_sample, mean, std, reduce))
