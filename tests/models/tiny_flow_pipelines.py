"""Tiny random-init FLUX.1 and Qwen-Image pipelines built from configs, fully offline."""

from __future__ import annotations

import torch
from conftest import tiny_flux_transformer


def tiny_flux_pipeline(*, guidance_embeds: bool = True, seed: int = 0):
    """A real ``FluxPipeline``: 16x16 images, 4 latent channels (8x8 latents, 16 packed tokens).

    ``guidance_embeds=True`` mimics FLUX.1-dev (dynamic-shift scheduler); False mimics
    FLUX.1-schnell (no guidance embedding, static shift 1). The VAE has non-trivial scaling and
    shift factors so decoding must apply both.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from flowrl.models.digits.model import build_digits_t5_tokenizer, build_digits_tokenizer

    torch.manual_seed(seed)
    tok, t5_tok = build_digits_tokenizer(), build_digits_t5_tokenizer()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=8,
            projection_dim=16,
            bos_token_id=len(tok) - 2,
            eos_token_id=len(tok) - 1,
            pad_token_id=len(tok) - 1,
        )
    )
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    transformer = tiny_flux_transformer(guidance_embeds=guidance_embeds)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.1,
        scaling_factor=0.5,
    )
    if guidance_embeds:  # FLUX.1-dev's scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    else:  # FLUX.1-schnell's
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def tiny_flux(*, guidance_embeds: bool = True, seed: int = 0, **kwargs):
    """A FluxAdapter over :func:`tiny_flux_pipeline` (16x16, T5 length 8)."""
    from flowrl.models.flux import FluxAdapter

    pipe = tiny_flux_pipeline(guidance_embeds=guidance_embeds, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    return FluxAdapter(pipe, max_sequence_length=8, resolution=(16, 16), model_id="tiny-flux", **kwargs)


QWEN_TEMPLATE_WORDS = (
    "system",
    "user",
    "assistant",
    "Describe",
    " the",
    " image",
    " by",
    " detailing",
    " color",
    " shape",
    " size",
    " texture",
    " quantity",
    " text",
    " spatial",
    " relationships",
    " of",
    " objects",
    " and",
    " background",
)
QWEN_PROMPT_WORDS = (" a", " bold", " thin", " handwritten", " digit", " number")


def tiny_qwen_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` built in memory (no files, no hub).

    The vocab is the 256 byte-level characters, whole-word tokens for the chat template's words
    (so its system prefix is 34 tokens, like the real tokenizer the pipeline's ``drop_idx`` assumes)
    and a few prompt words, plus Qwen's three specials. Any other text still tokenizes byte by byte.
    """
    from transformers import Qwen2Tokenizer

    from flowrl.models.digits.model import _byte_chars

    chars = _byte_chars()  # byte-level BPE's printable stand-ins, in byte order
    byte_map = dict(enumerate(chars))
    vocab = {c: i for i, c in enumerate(chars)}
    merges: list[tuple[str, str]] = []
    for word in QWEN_TEMPLATE_WORDS + QWEN_PROMPT_WORDS:
        pieces = "".join(byte_map[b] for b in word.encode("utf-8"))
        for i in range(2, len(pieces) + 1):
            pair = (pieces[: i - 1], pieces[i - 1])
            if pair not in merges:
                merges.append(pair)
                vocab.setdefault(pieces[:i], len(vocab))
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def tiny_qwen_image_pipeline(seed: int = 0):
    """A real ``QwenImagePipeline``: 16x16 images, 4 latent channels (8x8 latents, 16 packed tokens).

    Text encoder: a random-init ``Qwen2_5_VLForConditionalGeneration`` (1 text layer, hidden 16,
    1-block vision tower) built from config. Scheduler: Qwen-Image's config (dynamic shift with
    ``max_image_seq_len=8192``, ``max_shift=0.9``, terminal sigma 0.02). The VAE has non-trivial
    latent mean/std so decoding must apply both.
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tok = tiny_qwen_tokenizer()
    text = dict(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=16,
        fullatt_block_indexes=[0],
        patch_size=2,
        window_size=4,
        spatial_merge_size=1,
        temporal_patch_size=1,
    )
    encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=len(tok))
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.1, -0.2, 0.0, 0.3],
        latents_std=[1.5, 0.5, 1.0, 2.0],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tok, transformer=transformer)


def tiny_qwen_image(seed: int = 0, **kwargs):
    """A QwenImageAdapter over :func:`tiny_qwen_image_pipeline` (16x16, prompts padded to 24 tokens)."""
    from flowrl.models.qwen_image import QwenImageAdapter

    pipe = tiny_qwen_image_pipeline(seed)
    pipe.set_progress_bar_config(disable=True)
    return QwenImageAdapter(pipe, max_sequence_length=24, resolution=(16, 16), model_id="tiny-qwen-image", **kwargs)
