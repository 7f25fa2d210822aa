"""The model-adapter contract every model family implements (SD3, FLUX, Wan, the embedded model).

A trainer, sampler or reward never touches a diffusers pipeline directly: it calls these
methods, so every algorithm runs on every model.

Conditioning for true classifier-free guidance rides in the same :data:`Cond` dict: the negative
prompt's tensors are stored under keys prefixed ``"uncond."`` (see :mod:`flowrl.policy.guidance`), so
:func:`select_cond` / :func:`repeat_cond` slice them with everything else and no objective needs
to know whether guidance is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

Cond = dict[str, Tensor]
"""Prompt conditioning: a dict of batch-first tensors, e.g. SD3's
``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``; with true CFG also
``"uncond.encoder_hidden_states"`` etc. for the negative prompt."""

GUIDANCE_KINDS = ("cfg", "distilled", "none")


@runtime_checkable
class ModelAdapter(Protocol):
    """What flowrl needs from a text-to-image (or text-to-video) flow model.

    Attributes:
        transformer: the denoiser module LoRA is attached to (for a two-expert model such as
            Wan2.2-A14B: the trained expert, or ``WanExperts`` holding both).
        lora_target_modules: default LoRA target module names for this family.
        dtype: the dtype the model weights run in (log-probs and SDE means stay fp32 regardless).
        default_resolution: (height, width) used when a config does not say.
        guidance: how the model is guided. ``"cfg"``: true classifier-free guidance, an
            unconditional (negative-prompt) pass combined as ``v_u + w (v_c - v_u)``; the trainer
            wraps the adapter in :class:`flowrl.policy.guidance.GuidedAdapter` when
            ``sampler.guidance_scale != 1`` (SD3, Wan). ``"distilled"``: the guidance scale is an
            input of the network (FLUX.1-dev's guidance embedding), handled inside the adapter's
            ``velocity``; flowrl never adds an unconditional pass. ``"none"``: no guidance.
        default_num_frames: video adapters only: frame count used when ``model.num_frames`` is
            null. Image adapters do not define it.

    Optional: ``decoder()`` returns ``decode`` as a picklable callable holding only the VAE (e.g.
    ``functools.partial(decode_scaled, vae)``); ``train.rewards_async: process`` sends it to the
    scoring process. Every built-in adapter defines it.
    """

    transformer: nn.Module
    lora_target_modules: tuple[str, ...]
    dtype: torch.dtype
    default_resolution: tuple[int, int]
    guidance: str

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts in one batched call to conditioning tensors (no gradient).

        A negative prompt is encoded by the same method (it is just another prompt).
        """

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Predict ``v = eps - x0`` for latents x (B, C, H, W) or video latents (B, C, F, H, W)
        at sigma (B,) in [0, 1] (the adapter converts to its model's timestep convention)."""

    def decode(self, latents: Tensor) -> Tensor:
        """Decode latents to float32 in [0, 1]: images (B, 3, H, W) or videos (B, F, 3, H, W)."""

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Latent shape (without batch) for an output resolution.

        Video adapters take a third argument ``frames`` (``latent_shape(h, w, frames=None)``,
        None = ``default_num_frames``) and return (C, F_lat, H_lat, W_lat).
        """

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA state dict (``flowrl.policy.lora.lora_state_dict(transformer)``) in the layout the
        family's diffusers pipeline reads with ``pipe.load_lora_weights``; returns the main file.

        An adapter whose LoRA spans several files (Wan2.2: one per expert) also defines
        ``load_lora(directory)``, which ``flowrl sample --lora`` prefers over ``pipe.load_lora_weights``.
        """


def is_video(model: object) -> bool:
    """Whether an adapter produces videos (it defines ``default_num_frames``)."""
    return getattr(model, "default_num_frames", None) is not None


def output_resolution(resolution: int | Sequence[int] | None, model: ModelAdapter) -> tuple[int, int]:
    """(height, width) from ``model.resolution``: an int (square), [height, width], or None (model default).

    Raises:
        ValueError: anything else (one line naming the key and the allowed forms).
    """
    if resolution is None:
        return tuple(model.default_resolution)
    if isinstance(resolution, int) and not isinstance(resolution, bool) and resolution > 0:
        return (resolution, resolution)
    if isinstance(resolution, (list, tuple)) and len(resolution) == 2 and all(isinstance(r, int) and r > 0 for r in resolution):
        return (int(resolution[0]), int(resolution[1]))
    raise ValueError(f"model.resolution must be a positive int (square) or [height, width]; got {resolution!r}")


def model_latent_shape(model: ModelAdapter, resolution: tuple[int, int], frames: int | None = None) -> tuple[int, ...]:
    """Latent shape for a resolution and (video models only) a frame count.

    Args:
        model: the adapter.
        resolution: (height, width).
        frames: ``model.num_frames``; None = the video model's default (ignored by image models).

    Raises:
        ValueError: a frame count given for an image model.
    """
    if is_video(model):
        return tuple(model.latent_shape(*resolution, frames=frames))
    if frames is not None:
        raise ValueError(
            f"model.num_frames={frames} is set but {type(model).__name__} is an image model; remove model.num_frames"
        )
    return tuple(model.latent_shape(*resolution))


def freeze_modules(*modules: nn.Module | None) -> None:
    """Put the frozen parts of a pipeline (denoiser, VAE, text encoders) in eval mode without
    gradients; ``None`` entries (absent optional encoders) are skipped. LoRA adds trainable
    parameters afterwards."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False)
            module.eval()


def select_cond(cond: Cond, index: Tensor | slice) -> Cond:
    """Index every tensor of a conditioning dict along the batch dimension."""
    return {key: value[index] for key, value in cond.items()}


def repeat_cond(cond: Cond, repeats: int) -> Cond:
    """Repeat each row ``repeats`` times consecutively: (B, ...) -> (B * repeats, ...)."""
    return {key: value.repeat_interleave(repeats, dim=0) for key, value in cond.items()}


class CountingAdapter:
    """Wraps a model adapter and counts network evaluations per sample (NFE).

    A guided adapter (true CFG) declares ``evaluations_per_sample = 2`` and is counted twice per
    sample. Everything but ``velocity`` is forwarded to the wrapped adapter unchanged.
    """

    def __init__(self, model: ModelAdapter):
        self._model = model
        self.nfe = 0

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Count ``B * evaluations_per_sample`` evaluations, then call the wrapped model."""
        self.nfe += x.shape[0] * int(getattr(self._model, "evaluations_per_sample", 1))
        return self._model.velocity(x, sigma, cond)

    def __getattr__(self, name: str):
        return getattr(self._model, name)
