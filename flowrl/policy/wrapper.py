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
        return self._model.transformer

    @property
    def lora_target_modules(self) -> tuple[str, ...]:
        return self._model.lora_target_modules

    @property
    def dtype(self) -> torch.dtype:
        return self._model.dtype

    @property
    def device(self) -> torch.device:
        return self._model.device

    @property
    def default_resolution(self) -> tuple[int, int]:
        return self._model.default_resolution

    @property
    def guidance(self) -> str:
        return self._model.guidance

    @property
    def model_id(self) -> str:
        return self._model.model_id

    @property
    def pipe(self) -> Any:
        return self._model.pipe

    @property
    def max_sequence_length(self) -> int:
        return self._model.max_sequence_length

    @property
    def default_num_frames(self) -> int | None:
        return self._model.default_num_frames

    @property
    def evaluations_per_sample(self) -> int:
        return self._model.evaluations_per_sample

    # -- methods -----------------------------------------------------------------------------

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        return self._model.encode_prompt(prompts)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self._model.velocity(x, sigma, cond)

    def decode(self, latents: Tensor) -> Tensor:
        return self._model.decode(latents)

    def decoder(self) -> Callable[[Tensor], Tensor]:
        return self._model.decoder()

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        return self._model.latent_shape(height, width, frames)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        return self._model.sigmas(num_steps, height, width)

    def combine_cfg(self, v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
        return self._model.combine_cfg(v_uncond, v_cond, scale)

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        return self._model.save_lora(directory, lora_state)

    def load_lora(self, path: str | Path) -> None:
        self._model.load_lora(path)

    def free_text_encoders(self) -> int:
        return self._model.free_text_encoders()
