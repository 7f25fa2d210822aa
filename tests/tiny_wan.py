"""A tiny random-init ``WanPipeline`` built in-process (real diffusers/transformers classes, no downloads).

Sizes follow ../shared/reference/ecosystem.md §4: a 2-layer ``WanTransformer3DModel`` (2 heads x 12),
an ``AutoencoderKLWan`` with base_dim 3 and 16 latent channels (temporal x4, spatial x8), and a
2-layer ``T5EncoderModel`` with an in-memory T5 (Unigram) tokenizer standing in for UMT5.
"""

from __future__ import annotations

import torch

WORDS = "a an the cat dog fox red blue green video of running jumping slowly blurry ugly static".split()


def tiny_t5_tokenizer():
    """A T5Tokenizer (tokenizers-backed Unigram) over a small word list plus single letters."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in WORDS]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(99, -1, -1)]
    return T5Tokenizer(vocab=vocab, extra_ids=100)


def tiny_wan_transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def tiny_wan_pipeline(
    seed: int = 0,
    *,
    two_experts: bool = False,
    boundary_ratio: float = 0.875,
    shift: float = 3.0,
    expand_timesteps: bool = False,
):
    """A random-init WanPipeline (Wan2.1 layout; ``two_experts`` adds transformer_2 + boundary_ratio as
    Wan2.2-A14B; ``expand_timesteps`` gives per-token timesteps as Wan2.2-TI2V-5B)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tok = tiny_t5_tokenizer()
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformer = tiny_wan_transformer()
    extra = {"transformer_2": tiny_wan_transformer(), "boundary_ratio": boundary_ratio} if two_experts else {}
    return WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        transformer=transformer,
        expand_timesteps=expand_timesteps,
        **extra,
    )


def tiny_wan_adapter(seed: int = 0, **kwargs):
    """A WanAdapter over :func:`tiny_wan_pipeline`: 16x16 videos of 5 frames (latents 16 x 2 x 2 x 2)."""
    from flowrl.models.wan import WanAdapter

    pipe_kwargs = {k: kwargs.pop(k) for k in ("two_experts", "boundary_ratio", "expand_timesteps") if k in kwargs}
    return WanAdapter(
        tiny_wan_pipeline(seed, **pipe_kwargs), max_sequence_length=8, resolution=(16, 16), num_frames=5, **kwargs
    )
