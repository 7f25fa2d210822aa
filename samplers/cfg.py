"""Classifier-free guidance as a pure function."""

from __future__ import annotations

from torch import Tensor


def cfg(v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
    """Combine velocities: ``v = v_uncond + scale * (v_cond - v_uncond)``.

    ``scale = 1`` returns ``v_cond`` exactly (no guidance).

    Args:
        v_uncond: (B, ...) velocity under the empty/negative prompt.
        v_cond: (B, ...) velocity under the prompt.
        scale: guidance weight w.

    Returns:
        Tensor (B, ...).

    References:
        Ho & Salimans, "Classifier-Free Diffusion Guidance", 2022.
    """
    if scale == 1.0:
        return v_cond
    return v_uncond + scale * (v_cond - v_uncond)
