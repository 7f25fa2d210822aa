"""Adapter for Stable Diffusion 3 / 3.5 pipelines (and the embedded flowrl-digits model).

Wraps the parts of a diffusers ``StableDiffusion3Pipeline``: the CLIP (+ optional T5) text
encoders through the pipeline's own ``encode_prompt``, the ``SD3Transformer2DModel`` as the
velocity model, and the ``AutoencoderKL`` for decoding.

References:
    Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from .adapter import AdapterBase, Cond, freeze_modules, save_transformer_lora

SD3_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
MODEL_CARD = "flowrl.json"


def read_model_card(path: str | Path) -> dict[str, Any]:
    """Read the optional ``flowrl.json`` sampling defaults shipped next to a diffusers folder."""
    card = Path(path) / MODEL_CARD
    if not card.is_file():
        return {}
    try:
        return json.loads(card.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model card {card} is not valid JSON ({err}); fix or delete it") from err


def card_resolution(card: dict[str, Any]) -> Sequence[int] | None:
    """The model card's default ``resolution``: an int becomes (res, res); a pair or None is returned as is."""
    res = card.get("resolution")
    return (res, res) if isinstance(res, int) else res


def encode_sd3_prompts(
    pipe: Any, prompts: Sequence[str], max_sequence_length: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Encode prompts through the pipeline's own ``encode_prompt``, without CFG (gradients flow).

    Args:
        pipe: a ``StableDiffusion3Pipeline``.
        prompts: B strings (the second and third encoders get the same).
        max_sequence_length: T5 token length (zeros of this length when there is no T5).
        device: where the embeddings go (the transformer's device).

    Returns:
        prompt_embeds (B, L, D) and pooled projections (B, P).
    """
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=list(prompts),
        prompt_2=None,
        prompt_3=None,
        device=device,
        num_images_per_prompt=1,
        do_classifier_free_guidance=False,
        max_sequence_length=max_sequence_length,
    )
    return embeds, pooled


def _missing_optional_parts(path: str | Path) -> dict[str, None]:
    """SD3 may ship without T5 (text_encoder_3/tokenizer_3); tell diffusers they are absent."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return {}
    listed = json.loads(index.read_text())
    return {k: None for k in ("text_encoder_3", "tokenizer_3") if listed.get(k, [None])[0] is None}


def decode_scaled(vae: Any, latents: Tensor) -> Tensor:
    """Decode with an ``AutoencoderKL``'s scaling and shift factors (SD3, FLUX).

    Args:
        vae: the pipeline's ``AutoencoderKL``.
        latents: (B, C, h, w) in the sampler's normalised space.

    Returns:
        Images (B, 3, H, W) in [0, 1], float32.
    """
    cfg = vae.config
    z = latents.to(vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
    images = vae.decode(z, return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


class SD3Adapter(AdapterBase):
    """Model adapter over a ``StableDiffusion3Pipeline``.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        max_sequence_length: T5 token length (zeros of this length when there is no T5).
        resolution: default (height, width).
        model_id: name used in the prompt cache's fingerprint and messages.
    """

    lora_target_modules = SD3_LORA_TARGETS
    guidance = "cfg"  # true CFG (flowrl.policy.guidance.GuidedAdapter) when sampler.guidance_scale != 1
    decode_latents = staticmethod(decode_scaled)

    def __init__(
        self,
        pipe: Any,
        *,
        max_sequence_length: int = 256,
        resolution: tuple[int, int] | None = None,
        model_id: str = "sd3",
    ):
        super().__init__(pipe, max_sequence_length=max_sequence_length, model_id=model_id)
        size = self.transformer.config.sample_size * pipe.vae_scale_factor
        self.default_resolution = tuple(resolution) if resolution else (size, size)
        freeze_modules(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", model_id: str | None = None
    ) -> "SD3Adapter":
        """Load a local diffusers folder (or hub id) holding a ``StableDiffusion3Pipeline``."""
        from diffusers import StableDiffusion3Pipeline

        card = read_model_card(path) if Path(path).is_dir() else {}
        optional = _missing_optional_parts(path)
        pipe = StableDiffusion3Pipeline.from_pretrained(str(path), dtype=dtype, **optional).to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(
            pipe,
            max_sequence_length=int(card.get("max_sequence_length", 256)),
            resolution=card_resolution(card),
            model_id=model_id or Path(path).name,
        )

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode prompts with the pipeline's CLIP/T5 encoders.

        Returns:
            ``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``.
        """
        embeds, pooled = encode_sd3_prompts(self.pipe, prompts, self.max_sequence_length, self.device)
        return {"encoder_hidden_states": embeds.to(self.dtype), "pooled_projections": pooled.to(self.dtype)}

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Velocity (B, C, H, W); SD3 takes ``timestep = 1000 * sigma`` in fp32, as the pipeline does."""
        out = self.transformer(
            hidden_states=x.to(self.dtype),
            timestep=(sigma * 1000).float().to(x.device),
            encoder_hidden_states=cond["encoder_hidden_states"],
            pooled_projections=cond["pooled_projections"],
            return_dict=False,
        )[0]
        return out

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(C, H / f, W / f) where f is the VAE's downsampling factor (``frames`` must be None: an image model)."""
        self._image_only(frames)
        factor = self.pipe.vae_scale_factor * self.transformer.config.patch_size
        if height % factor or width % factor:
            raise ValueError(f"SD3 resolution must be a multiple of {factor}; got {height}x{width}")
        f = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // f, width // f)

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA in the layout ``pipe.load_lora_weights(directory)`` reads.

        The peft config (rank, alpha, targets) goes into the safetensors metadata, so diffusers
        restores the same ``alpha / r`` scale.
        """
        from diffusers import StableDiffusion3Pipeline

        return save_transformer_lora(StableDiffusion3Pipeline, directory, self.transformer, lora_state)
