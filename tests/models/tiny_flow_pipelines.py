"""Tiny random-init FLUX.1 and Qwen-Image pipelines built from configs, fully offline."""

from __future__ import annotations

import torch


def tiny_flux_pipeline(*, guidance_embeds: bool = True, seed: int = 0):
    """A real ``FluxPipeline``: 16x16 images, 4 latent channels (8x8 latents, 16 packed tokens).

    ``guidance_embeds=True`` mimics FLUX.1-dev (dynamic-shift scheduler); False mimics
    FLUX.1-schnell (no guidance embedding, static shift 1). The VAE has non-trivial scaling and
    shift factors so decoding must apply both.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from flowrl.models.digits import build_digits_t5_tokenizer, build_digits_tokenizer

    torch.manual_seed(seed)
    tok, t5_tok = build_digits_tokenizer(), build_digits_t5_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=8, projection_dim=16, bos_token_id=len(tok) - 2, eos_token_id=len(tok) - 1, pad_token_id=len(tok) - 1,
    ))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=guidance_embeds, axes_dims_rope=[2, 2, 4],
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1, scaling_factor=0.5,
    )
    if guidance_embeds:  # FLUX.1-dev's scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
        )
    else:  # FLUX.1-schnell's
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=tok, text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer,
    )


def tiny_flux(*, guidance_embeds: bool = True, seed: int = 0, **kwargs):
    """A FluxAdapter over :func:`tiny_flux_pipeline` (16x16, T5 length 8)."""
    from flowrl.models.flux import FluxAdapter

    pipe = tiny_flux_pipeline(guidance_embeds=guidance_embeds, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return FluxAdapter(pipe, max_sequence_length=8, resolution=(16, 16), model_id="tiny-flux", **kwargs)
