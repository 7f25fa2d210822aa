"""Shape and dtype helpers shared by the samplers and the objectives."""

from __future__ import annotations

import torch
from torch import Tensor


def expand_like(value: Tensor | float, x: Tensor) -> Tensor:
    """Broadcast a per-sample value against a latent of any rank.

    Args:
        value: a Python float, a 0-d tensor or a tensor of shape (B,).
        x: latent of shape (B, ...) (rank 3, 4 or 5: tokens, images or video).

    Returns:
        A tensor of shape (B, 1, ..., 1) (or 0-d for scalars) on x's device, in x's dtype.

    Raises:
        ValueError: if a 1-d value does not have B entries.
    """
    value = torch.as_tensor(value, device=x.device, dtype=x.dtype)
    if value.ndim == 0:
        return value
    if value.ndim != 1 or value.shape[0] != x.shape[0]:
        raise ValueError(
            f"per-sample sigma/noise must have shape ({x.shape[0]},) to match the latent batch; "
            f"got {tuple(value.shape)}"
        )
    return batch_view(value, x.ndim)


def batch_view(value: Tensor, ndim: int) -> Tensor:
    """View a per-sample (B,) tensor as (B, 1, ..., 1) of rank ``ndim``, keeping its dtype and device."""
    return value.reshape(-1, *([1] * (ndim - 1)))


def standard_normal(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """float32 N(0, I) noise shaped like ``x`` (B, ...), on x's device.

    Drawn on the generator's device (the trainer's generator lives on the CPU) and then moved,
    so a seed gives the same noise on a CPU and on a GPU run. A CPU draw for a CUDA latent goes
    through pinned memory with a non-blocking copy: a pageable copy would synchronise the stream
    at every sampler step (torch waits for the copy), stalling the host until the GPU has run
    everything queued before it. The values are the same either way.
    """
    device = generator.device if generator is not None else x.device
    noise = torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32)
    if noise.device.type == "cpu" and x.device.type == "cuda":
        return noise.pin_memory().to(x.device, non_blocking=True)
    return noise.to(x.device)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype SDE means and log-probs are computed in: fp32, or fp64 if any input is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
