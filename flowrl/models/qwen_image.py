"""Adapter for Qwen-Image pipelines (``QwenImagePipeline``).

Wraps the parts of a diffusers ``QwenImagePipeline``: the Qwen2.5-VL text encoder through the
pipeline's own ``encode_prompt`` (chat template, the system-prompt tokens dropped), the
``QwenImageTransformer2DModel`` as the velocity model and the ``AutoencoderKLQwenImage`` (a
video VAE used with one frame, per-channel latent mean/std) for decoding.

Conventions checked against ``QwenImagePipeline.__call__`` (diffusers 0.42):

- latents stay unpacked, (B, C, h, w), outside the adapter; :meth:`QwenImageAdapter.velocity`
  packs 2x2 patches into tokens and passes ``img_shapes = (1, h/2, w/2)`` for RoPE;
- the transformer takes ``timestep = sigma``; its output is ``eps - x0`` (flowrl's ``v``);
- prompt embeddings have a per-prompt length. :meth:`QwenImageAdapter.encode_prompt` pads them
  to ``max_sequence_length`` with a 0/1 mask so every prompt has the same shape (the prompt cache
  concatenates single-prompt encodings); :meth:`QwenImageAdapter.velocity` trims the padding to
  the longest prompt of the batch and masks the rest, which leaves v unchanged;
- true CFG is not distilled into Qwen-Image: the pipeline combines conditional and unconditional
  velocities with a norm rescale, :func:`qwen_true_cfg` (the CFG wrapper applies it).

References:
    Wu et al., "Qwen-Image Technical Report", 2025.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ..samplers.broadcast import compute_dtype
from .adapter import Cond, freeze_modules, save_transformer_lora
from .packing import PackedImageAdapter, pack_latents, unpack_latents
from .sd3 import card_resolution, read_model_card

QWEN_IMAGE_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
"""Attention and both streams' MLPs (the Qwen-Image recipes adapt attention + MLPs)."""


def qwen_true_cfg(v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
    """Qwen-Image's true CFG with norm rescale, on unpacked velocities (B, C, h, w).

    ``v = u + w (c - u)``, then each packed token (a 2x2 patch, all channels) is rescaled to the
    norm of the conditional velocity's token: ``v * ||c|| / ||v||``.

    Args:
        v_uncond: (B, C, h, w) velocity without the prompt.
        v_cond: (B, C, h, w) velocity with the prompt.
        scale: guidance weight w (``true_cfg_scale``).

    Returns:
        (B, C, h, w) guided velocity, in fp32 (fp64 for fp64 inputs).
    """
    h, w = v_cond.shape[-2:]
    dtype = compute_dtype(v_uncond, v_cond)
    u, c = pack_latents(v_uncond.to(dtype)), pack_latents(v_cond.to(dtype))
    combined = u + scale * (c - u)
    rescaled = combined * (c.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    return unpack_latents(rescaled, h, w)


def decode_qwen_image(vae: Any, latents: Tensor) -> Tensor:
    """Latents (B, C, h, w) -> images (B, 3, H, W) in [0, 1], float32.

    Decodes through the one-frame ``AutoencoderKLQwenImage`` with its per-channel mean and std.
    """
    cfg = vae.config
    z = latents.to(vae.dtype).unsqueeze(2)
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    images = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


class QwenImageAdapter(PackedImageAdapter):
    """Model adapter over a ``QwenImagePipeline``.

    Args:
        pipe: a loaded ``QwenImagePipeline``.
        max_sequence_length: prompt tokens kept (after the template), and the padded length.
        resolution: default (height, width); None = the pipeline's default sample size.
        model_id: name used in cache fingerprints and messages.

    Raises:
        ValueError: a guidance-embedding transformer (not supported).
    """

    family = "Qwen-Image"
    lora_target_modules = QWEN_IMAGE_LORA_TARGETS
    guidance = "cfg"  # true CFG (flowrl.policy.guidance.GuidedAdapter) when sampler.guidance_scale != 1
    decode_latents = staticmethod(decode_qwen_image)

    @staticmethod
    def combine_cfg(v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
        """How this model combines CFG branches: :func:`qwen_true_cfg` (norm-rescaled, as the pipeline)."""
        return qwen_true_cfg(v_uncond, v_cond, scale)

    def __init__(
        self,
        pipe: Any,
        *,
        max_sequence_length: int = 512,
        resolution: tuple[int, int] | None = None,
        model_id: str = "qwen-image",
    ):
        if pipe.transformer.config.guidance_embeds:
            raise ValueError(
                f"{model_id}: guidance-embedding Qwen-Image transformers are not supported; "
                "use a model without guidance_embeds"
            )
        super().__init__(pipe, max_sequence_length=max_sequence_length, model_id=model_id)
        size = pipe.default_sample_size * pipe.vae_scale_factor
        self.default_resolution = tuple(resolution) if resolution else (size, size)
        freeze_modules(pipe.transformer, pipe.vae, pipe.text_encoder)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", model_id: str | None = None
    ) -> "QwenImageAdapter":
        """Load a local diffusers folder holding a ``QwenImagePipeline`` (never with remote code).

        ``flowrl.json`` next to ``model_index.json`` may set ``resolution`` and ``max_sequence_length``.
        """
        from diffusers import QwenImagePipeline

        card = read_model_card(path)
        pipe = QwenImagePipeline.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(
            pipe,
            max_sequence_length=int(card.get("max_sequence_length", 512)),
            resolution=card_resolution(card),
            model_id=model_id or Path(path).name,
        )

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode prompts (batched) with the Qwen2.5-VL encoder, padded to ``max_sequence_length``.

        Returns:
            ``{"encoder_hidden_states": (B, L, D), "encoder_hidden_states_mask": (B, L) 0/1}`` with
            ``L = max_sequence_length``; embeddings in the transformer's dtype, mask int64.
        """
        embeds, mask = self.pipe.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        b, length, dim = embeds.shape
        if mask is None:
            mask = torch.ones(b, length, dtype=torch.long, device=embeds.device)
        pad = self.max_sequence_length - length
        padded = torch.cat([embeds, embeds.new_zeros(b, pad, dim)], dim=1)
        mask = torch.cat([mask.long(), mask.new_zeros(b, pad).long()], dim=1)
        return {"encoder_hidden_states": padded.to(self.dtype), "encoder_hidden_states_mask": mask}

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Velocity ``eps - x0`` (B, C, h, w) for unpacked latents x (B, C, h, w) at sigma (B,).

        Returned in the transformer's dtype, as the model computes it.
        """
        b, _, h, w = x.shape
        mask = cond["encoder_hidden_states_mask"]
        length = max(int(mask.sum(dim=1).max()), 1)  # drop padding columns no prompt of the batch uses
        out = self.transformer(
            hidden_states=pack_latents(x.to(self.dtype)),
            encoder_hidden_states=cond["encoder_hidden_states"][:, :length],
            encoder_hidden_states_mask=mask[:, :length],
            timestep=(sigma * 1000).to(device=x.device, dtype=self.dtype) / 1000,  # rounded as the pipeline rounds it
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA in the layout ``QwenImagePipeline.load_lora_weights(directory)`` reads."""
        from diffusers import QwenImagePipeline

        return save_transformer_lora(QwenImagePipeline, directory, self.transformer, lora_state)
