"""Adapter for FLUX.1 pipelines (dev and schnell).

Wraps the parts of a diffusers ``FluxPipeline``: CLIP (pooled) + T5 (sequence) prompt encoding
through the pipeline's own ``encode_prompt``, the ``FluxTransformer2DModel`` as the velocity
model, and the ``AutoencoderKL`` (with its scaling and shift factors) for decoding.

Conventions checked against ``FluxPipeline.__call__`` (diffusers 0.42):

- latents stay unpacked, (B, C, h, w), outside the adapter; :meth:`FluxAdapter.velocity` packs
  2x2 patches into tokens with RoPE ids ``img_ids`` (and all-zero ``txt_ids``) and unpacks v;
- the transformer takes ``timestep = sigma`` (it multiplies by 1000 itself), not 1000 * sigma;
- its output is ``eps - x0``, the same as flowrl's ``v`` (the pipeline's Euler step is
  ``x + (sigma_next - sigma) * v``);
- FLUX.1-dev is guidance-distilled: a ``guidance`` scalar per sample (default 3.5) enters the
  time embedding. FLUX.1-schnell (``guidance_embeds = False``) has no such input and rejects one.

References:
    Black Forest Labs, "FLUX.1" (2024); Esser et al., "Scaling Rectified Flow Transformers for
    High-Resolution Image Synthesis", 2024.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from .adapter import Cond, freeze_modules, save_transformer_lora
from .packing import PackedImageAdapter, latent_image_ids, pack_latents, unpack_latents
from .sd3 import card_resolution, decode_scaled, read_model_card

FLUX_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
FLUX_MLP_TARGETS = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp")
DEFAULT_GUIDANCE = 3.5


def flux_lora_targets(num_single_layers: int) -> tuple[str, ...]:
    """Attention, MLP and single-block projections (the FLUX LoRA recipes adapt attention + MLPs).

    A single block's output projection is named per block, because a bare ``proj_out`` would
    also match the transformer's final output layer.
    """
    singles = tuple(f"single_transformer_blocks.{i}.proj_out" for i in range(num_single_layers))
    return FLUX_ATTENTION_TARGETS + FLUX_MLP_TARGETS + singles


class FluxAdapter(PackedImageAdapter):
    """Model adapter over a ``FluxPipeline`` (FLUX.1-dev or FLUX.1-schnell).

    Args:
        pipe: a loaded ``FluxPipeline``.
        guidance_scale: distilled guidance for guidance-embedding models (None = 3.5); must be
            None for models without guidance embeddings (schnell).
        max_sequence_length: T5 token length (512 for dev, 256 for schnell in the model cards).
        resolution: default (height, width); None = the pipeline's default sample size.
        model_id: name used in cache fingerprints and messages.

    Raises:
        ValueError: a guidance scale for a model without guidance embeddings.
    """

    family = "FLUX"
    decode_latents = staticmethod(decode_scaled)

    def __init__(
        self,
        pipe: Any,
        *,
        guidance_scale: float | None = None,
        max_sequence_length: int = 512,
        resolution: tuple[int, int] | None = None,
        model_id: str = "flux",
    ):
        super().__init__(pipe, max_sequence_length=max_sequence_length, model_id=model_id)
        self.lora_target_modules = flux_lora_targets(self.transformer.config.num_single_layers)
        size = pipe.default_sample_size * pipe.vae_scale_factor
        self.default_resolution = tuple(resolution) if resolution else (size, size)
        self.guidance_scale: float | None = None
        self.set_guidance_scale(guidance_scale)
        # dev: distilled guidance inside velocity (never an unconditional pass); schnell: none
        self.guidance = "distilled" if self.has_guidance_embeds else "none"
        freeze_modules(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        guidance_scale: float | None = None,
        model_id: str | None = None,
    ) -> "FluxAdapter":
        """Load a local diffusers folder holding a ``FluxPipeline`` (never with remote code).

        ``flowrl.json`` next to ``model_index.json`` may set ``resolution``, ``max_sequence_length``
        (default: 512 for guidance-distilled dev, 256 for schnell, as their model cards use) and
        ``guidance_scale``.
        """
        from diffusers import FluxPipeline

        card = read_model_card(path)
        pipe = FluxPipeline.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device)
        pipe.set_progress_bar_config(disable=True)
        if guidance_scale is None and pipe.transformer.config.guidance_embeds:
            guidance_scale = card.get("guidance_scale")
        return cls(
            pipe,
            guidance_scale=guidance_scale,
            max_sequence_length=int(
                card.get("max_sequence_length", 512 if pipe.transformer.config.guidance_embeds else 256)
            ),
            resolution=card_resolution(card),
            model_id=model_id or Path(path).name,
        )

    @property
    def has_guidance_embeds(self) -> bool:
        """True for guidance-distilled models (FLUX.1-dev), False for FLUX.1-schnell."""
        return bool(self.transformer.config.guidance_embeds)

    def set_guidance_scale(self, scale: float | None) -> None:
        """Set the distilled guidance used by every later :meth:`velocity` call.

        Rollout and training read the same attribute, so they always use the same guidance.

        Raises:
            ValueError: a scale for a model without guidance embeddings, or a non-finite scale.
        """
        if not self.has_guidance_embeds:
            if scale is not None:
                raise ValueError(
                    f"{self.model_id} has no guidance embedding (transformer.config.guidance_embeds=False, "
                    f"e.g. FLUX.1-schnell); remove model.distilled_guidance ({scale}) from the config"
                )
            self.guidance_scale = None
            return
        value = DEFAULT_GUIDANCE if scale is None else float(scale)
        if not math.isfinite(value):
            raise ValueError(f"FLUX guidance scale must be a finite number; got {scale!r}")
        self.guidance_scale = value

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode prompts (batched) with the pipeline's CLIP and T5 encoders.

        Returns:
            ``{"encoder_hidden_states": (B, L, D) T5, "pooled_projections": (B, P) CLIP pooled}``
            in the transformer's dtype.
        """
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": embeds.to(self.dtype), "pooled_projections": pooled.to(self.dtype)}

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Velocity ``eps - x0`` (B, C, h, w) for unpacked latents x (B, C, h, w) at sigma (B,).

        Returned in the transformer's dtype, as the model computes it.
        """
        b, _, h, w = x.shape
        text = cond["encoder_hidden_states"]
        guidance = None
        if self.guidance_scale is not None:
            guidance = torch.full((b,), self.guidance_scale, device=x.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=pack_latents(x.to(self.dtype)),
            timestep=(sigma * 1000).to(device=x.device, dtype=self.dtype) / 1000,  # rounded as the pipeline rounds it
            guidance=guidance,
            pooled_projections=cond["pooled_projections"],
            encoder_hidden_states=text,
            txt_ids=torch.zeros(text.shape[1], 3, device=x.device, dtype=text.dtype),
            img_ids=latent_image_ids(h, w, device=x.device, dtype=text.dtype),
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA in the layout ``FluxPipeline.load_lora_weights(directory)`` reads.

        The peft config (rank, alpha, targets) goes into the safetensors metadata, so diffusers
        restores the same ``alpha / r`` scale.
        """
        from diffusers import FluxPipeline

        return save_transformer_lora(FluxPipeline, directory, self.transformer, lora_state)
