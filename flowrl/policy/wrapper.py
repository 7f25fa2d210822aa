"""A model adapter wrapping another one: every :class:`~flowrl.models.adapter.ModelAdapter` member, delegated.

The policy stack ``CountingAdapter(MemoryAdapter(GuidedAdapter(adapter)))`` is built from
subclasses of :class:`AdapterWrapper`; each overrides only what it changes (guidance, memory
placement, evaluation counting). Members are spelled out rather than forwarded implicitly, so the
interface the library uses is the one written in ``ModelAdapter``, and anything outside it (e.g.
FLUX's ``set_guidance_scale``) is reached through :attr:`AdapterWrapper.wrapped`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..models.adapter import Cond, ModelAdapter


class AdapterWrapper:
    """Implements :class:`ModelAdapter` by delegating every member to ``model``.

    Args:
        model: the adapter (or wrapper) underneath.
    """

    def __init__(self, model: ModelAdapter):
        self._model = model

    @property
    def wrapped(self) -> ModelAdapter:
        """The adapter (or wrapper) underneath."""
        return self._model

    # -- attributes --------------------------------------------------------------------------

    @property
    def transformer(self) -> nn.Module:
        """The denoiser module LoRA is attached to."""
        return self._model.transformer

    @property
    def lora_target_modules(self) -> tuple[str, ...]:
        """Default LoRA target module names for this family."""
        return self._model.lora_target_modules

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model weights run in."""
        return self._model.dtype

    @property
    def device(self) -> torch.device:
        """Where the denoiser runs."""
        return self._model.device

    @property
    def default_resolution(self) -> tuple[int, int]:
        """(height, width) used when a config does not say."""
        return self._model.default_resolution

    @property
    def guidance(self) -> str:
        """How the model is guided: "cfg", "distilled" or "none"."""
        return self._model.guidance

    @property
    def model_id(self) -> str:
        """Name of the model in messages and the prompt cache's fingerprint."""
        return self._model.model_id

    @property
    def pipe(self) -> Any:
        """The diffusers pipeline the parts come from."""
        return self._model.pipe

    @property
    def max_sequence_length(self) -> int:
        """Text tokens per prompt the encoders produce."""
        return self._model.max_sequence_length

    @property
    def default_num_frames(self) -> int | None:
        """Frames per video when ``model.num_frames`` is null; None for image models."""
        return self._model.default_num_frames

    @property
    def evaluations_per_sample(self) -> int:
        """Network evaluations one ``velocity`` call costs per sample."""
        return self._model.evaluations_per_sample

    # -- methods -----------------------------------------------------------------------------

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts to conditioning tensors (delegated)."""
        return self._model.encode_prompt(prompts)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Predict the velocity (B, ...) of latents x at sigma (B,) (delegated)."""
        return self._model.velocity(x, sigma, cond)

    def decode(self, latents: Tensor) -> Tensor:
        """Decode latents to float32 images or videos in [0, 1] (delegated)."""
        return self._model.decode(latents)

    def decoder(self) -> Callable[[Tensor], Tensor]:
        """``decode`` as a picklable callable holding only the VAE (delegated)."""
        return self._model.decoder()

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Latent shape (without batch) for an output resolution (delegated)."""
        return self._model.latent_shape(height, width, frames)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        """The model's own (num_steps + 1,) sigma grid at this resolution, or None (delegated)."""
        return self._model.sigmas(num_steps, height, width)

    def combine_cfg(self, v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
        """Combine the unconditional and conditional velocities of true CFG (delegated)."""
        return self._model.combine_cfg(v_uncond, v_cond, scale)

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA state dict in the family's diffusers layout; returns the main file (delegated)."""
        return self._model.save_lora(directory, lora_state)

    def load_lora(self, path: str | Path) -> None:
        """Load a LoRA written by ``save_lora`` into the denoiser(s) (delegated)."""
        self._model.load_lora(path)

    def free_text_encoders(self) -> int:
        """Drop the text encoders; returns the number of parameters released (delegated)."""
        return self._model.free_text_encoders()
