"""The sigma grid a diffusers flow-matching pipeline would use, from its scheduler config.

FLUX.1-dev and Qwen-Image ship ``FlowMatchEulerDiscreteScheduler`` configs with a
resolution-dependent (dynamic) shift; Qwen-Image also stretches the grid to a terminal sigma.
:func:`pipeline_sigmas` reproduces the grid their pipelines build (``linspace(1, 1/T, T)``,
shifted, then a final 0), in float64, so flowrl's samplers can integrate on the same grid.

References:
    Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

from ..samplers.schedules import dynamic_shift_mu, shift_sigmas
from .adapter import ModelAdapter


def scheduler_mu(config: Mapping[str, Any], image_seq_len: int) -> float:
    """The dynamic-shift exponent mu for ``image_seq_len`` packed image tokens, as the pipelines compute it."""
    return dynamic_shift_mu(
        image_seq_len,
        base_seq_len=config.get("base_image_seq_len", 256),
        max_seq_len=config.get("max_image_seq_len", 4096),
        base_shift=config.get("base_shift", 0.5),
        max_shift=config.get("max_shift", 1.15),
    )


def pipeline_sigmas(config: Mapping[str, Any], num_steps: int, image_seq_len: int) -> Tensor:
    """Sigmas (num_steps + 1,) float64 from 1-ish down to 0, as the pipeline's scheduler sets them.

    Args:
        config: the scheduler config (``pipe.scheduler.config``).
        num_steps: T.
        image_seq_len: packed image tokens, (h/2) * (w/2) for an h x w latent.

    Raises:
        ValueError: for scheduler options flowrl does not reproduce (Karras/exponential/beta sigmas,
            inverted sigmas) or a non-positive step count.
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer; got {num_steps!r}")
    for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
        if config.get(key):
            raise ValueError(
                f"scheduler option {key}=True is not supported by flowrl; use a scheduler config without it"
            )
    sigmas = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)
    if config.get("use_dynamic_shifting"):
        mu = scheduler_mu(config, image_seq_len)
        if config.get("time_shift_type", "exponential") == "exponential":
            sigmas = shift_sigmas(sigmas, math.exp(mu))
        else:  # "linear": mu / (mu + (1/s - 1))
            sigmas = mu / (mu + (1.0 / sigmas - 1.0))
    else:
        sigmas = shift_sigmas(sigmas, float(config.get("shift", 1.0)))
    terminal = config.get("shift_terminal")
    if terminal and num_steps > 1:  # one step: nothing to stretch (diffusers would divide 0 by 0)
        one_minus = 1.0 - sigmas
        sigmas = 1.0 - one_minus / (one_minus[-1] / (1.0 - terminal))
    return torch.cat([sigmas, sigmas.new_zeros(1)])


def run_sigmas(
    model: ModelAdapter,
    kind: str,
    num_steps: int,
    *,
    shift: float,
    resolution: tuple[int, int],
    latent: tuple[int, ...],
) -> Tensor:
    """A run's sigma grid: a named schedule, or ``"model"`` = the adapter's own pipeline grid.

    Args:
        model: the adapter (or the policy stack, which delegates ``sigmas``).
        kind: ``sampler.schedule``: "linear", "shift", "dynamic_shift" or "model".
        num_steps: T.
        shift: ``sampler.shift`` (for "shift").
        resolution: (height, width) of the outputs.
        latent: latent shape without batch; ``prod(latent[1:]) / 4`` tokens for "dynamic_shift".

    Returns:
        (T + 1,) float64 sigmas.

    Raises:
        ValueError: "model" for an adapter without a grid of its own (its ``sigmas`` returns None).
    """
    from ..samplers.schedules import make_sigmas

    if kind == "model":
        own = model.sigmas(num_steps, *resolution)
        if own is None:
            raise ValueError(
                f"sampler.schedule='model' needs an adapter with its pipeline's sigma grid; {model.model_id} has none; "
                "use 'linear', 'shift' or 'dynamic_shift'"
            )
        return own
    return make_sigmas(kind, num_steps, shift=shift, image_seq_len=math.prod(latent[1:]) // 4)
