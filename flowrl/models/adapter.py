"""The model-adapter contract every model family implements (SD3, FLUX, Wan, the embedded model).

A trainer, sampler or reward never touches a diffusers pipeline directly: it calls these
methods, so every algorithm runs on every model.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

Cond = dict[str, Tensor]
"""Prompt conditioning: a dict of batch-first tensors, e.g. SD3's
``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``."""


@runtime_checkable
class ModelAdapter(Protocol):
    """What flowrl needs from a text-to-image (or video) flow model.

    Attributes:
        transformer: the denoiser module LoRA is attached to.
        lora_target_modules: default LoRA target module names for this family.
        dtype: the dtype the model weights run in (log-probs stay fp32 regardless).
        default_resolution: (height, width) used when a config does not say.
    """

    transformer: nn.Module
    lora_target_modules: tuple[str, ...]
    dtype: torch.dtype
    default_resolution: tuple[int, int]

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode prompts to conditioning tensors (no gradient)."""

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Predict ``v = eps - x0`` for latents x (B, ...) at sigma (B,)."""

    def decode(self, latents: Tensor) -> Tensor:
        """Decode latents (B, ...) to images (B, 3, H, W) in [0, 1], float32."""

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Latent shape (without batch) for an output resolution."""


def select_cond(cond: Cond, index: Tensor | slice) -> Cond:
    """Index every tensor of a conditioning dict along the batch dimension."""
    return {key: value[index] for key, value in cond.items()}


def repeat_cond(cond: Cond, repeats: int) -> Cond:
    """Repeat each row ``repeats`` times consecutively: (B, ...) -> (B * repeats, ...)."""
    return {key: value.repeat_interleave(repeats, dim=0) for key, value in cond.items()}


class CountingAdapter:
    """Wraps a model adapter and counts velocity evaluations per sample (NFE).

    Everything but ``velocity`` is forwarded to the wrapped adapter unchanged.
    """

    def __init__(self, model: ModelAdapter):
        self._model = model
        self.nfe = 0

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Count ``B`` evaluations, then call the wrapped model."""
        self.nfe += x.shape[0]
        return self._model.velocity(x, sigma, cond)

    def __getattr__(self, name: str):
        return getattr(self._model, name)
