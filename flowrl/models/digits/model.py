"""flowrl-digits: the embedded default model, a tiny real SD3 pipeline for 8x8 handwritten digits.

Every part is a real diffusers / transformers class (``SD3Transformer2DModel``, two
``CLIPTextModelWithProjection``, a ``T5EncoderModel``, ``AutoencoderKL``,
``FlowMatchEulerDiscreteScheduler``), so the same adapter and code paths that serve Stable
Diffusion 3 serve this model. The T5 branch is a real (tiny) encoder rather than None because
diffusers 0.42's ``StableDiffusion3Pipeline.from_pretrained`` refuses a folder whose
``text_encoder_3`` is null unless the caller passes ``text_encoder_3=None``; with it the folder
loads with no extra arguments. Its sequence length is ``MAX_SEQUENCE_LENGTH`` (room for every
prompt of :func:`digits_prompt`, so no truncation warnings). The weights are
trained by :mod:`flowrl.models.digits.pretrain` on scikit-learn's bundled ``load_digits`` data
(no download) and shipped under ``flowrl/assets/flowrl-digits``.

References:
    Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis", 2024.
    Peebles & Xie, "Scalable Diffusion Models with Transformers" (adaLN-Zero init), 2023.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from ..sd3 import encode_sd3_prompts

DIGITS_DIR = Path(__file__).resolve().parents[2] / "assets" / "flowrl-digits"
RESOLUTION = 8
MAX_SEQUENCE_LENGTH = 6
STYLES = ("bold", "thin")
TOKENIZER_MAX_LENGTH = 8
PROMPT_WORDS = ("a", "handwritten", "bold", "thin", "digit", "number", "of", "the")

_T5_SPACE = "\u2581"
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_EOW = "</w>"


def digits_prompt(digit: int, style: str | None = None) -> str:
    """The prompt for a digit, e.g. ``"a handwritten 7"`` or ``"a bold handwritten 7"``.

    Args:
        digit: 0..9.
        style: None, "bold" or "thin".
    """
    if not isinstance(digit, int) or not 0 <= digit <= 9:
        raise ValueError(f"digit must be an int in 0..9; got {digit!r}")
    if style is None:
        return f"a handwritten {digit}"
    if style not in STYLES:
        raise ValueError(f"style must be None or one of {STYLES}; got {style!r}")
    return f"a {style} handwritten {digit}"


def _byte_chars() -> list[str]:
    """The 256 printable unicode stand-ins for bytes used by byte-level BPE, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _word_merges(word: str) -> list[tuple[str, str]]:
    """Left-to-right merges that join ``word`` into the single token ``word + "</w>"``."""
    merges = []
    for i in range(1, len(word)):
        right = word[i] + _EOW if i == len(word) - 1 else word[i]
        merges.append((word[:i], right))
    return merges


def build_digits_tokenizer(words: Sequence[str] = PROMPT_WORDS) -> Any:
    """Build the CLIP tokenizer of flowrl-digits fully offline, in memory.

    The vocab is the 256 byte-level characters, the same with ``</w>``, one whole-word token per
    entry of ``words`` (digits are single characters already), and the two CLIP specials. Any
    other text still tokenizes, character by character.

    Returns:
        A ``transformers.CLIPTokenizer`` with ``model_max_length = TOKENIZER_MAX_LENGTH``.
    """
    from transformers import CLIPTokenizer

    chars = _byte_chars()
    tokens = chars + [c + _EOW for c in chars]
    merges: list[tuple[str, str]] = []
    for word in words:
        for pair in _word_merges(word):
            if pair not in merges:
                merges.append(pair)
                tokens.append(pair[0] + pair[1])
    tokens += [_BOS, _EOS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TOKENIZER_MAX_LENGTH)


def build_digits_t5_tokenizer(words: Sequence[str] = PROMPT_WORDS) -> Any:
    """Build the T5 (Unigram) tokenizer of flowrl-digits fully offline, in memory.

    Each prompt word and each digit is one whole-word piece ("\u2581handwritten", "\u25817"); other
    text falls back to single characters, and characters outside ASCII map to ``<unk>``.

    Returns:
        A ``transformers.T5Tokenizer`` (no ``<extra_id_*>`` tokens).
    """
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (_T5_SPACE, -4.0)]
    whole = [_T5_SPACE + w for w in list(words) + [str(d) for d in range(10)]]
    pieces += [(piece, -1.0) for piece in whole]
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces += [(c, -6.0) for c in chars] + [(_T5_SPACE + c, -5.0) for c in chars if _T5_SPACE + c not in whole]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)


def _t5_encoder(tokenizer: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_kv=32,
        d_ff=128,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config)


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TOKENIZER_MAX_LENGTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


def _zero_adaln(transformer: torch.nn.Module) -> None:
    """DiT adaLN-Zero: modulation layers and the output projection start at zero."""
    layers = [transformer.norm_out.linear, transformer.proj_out]
    for block in transformer.transformer_blocks:
        layers += [block.norm1.linear, block.norm1_context.linear]
    with torch.no_grad():
        for layer in layers:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()


def build_digits_pipeline(seed: int = 0) -> Any:
    """A randomly initialised flowrl-digits ``StableDiffusion3Pipeline`` (untrained).

    Args:
        seed: torch seed for the initial weights.

    Returns:
        ``StableDiffusion3Pipeline`` producing (B, 3, 8, 8) images from 8x8x4 latents (no
        VAE downsampling, patch 2 -> 16 image tokens; 8 CLIP + ``MAX_SEQUENCE_LENGTH`` T5 text
        tokens, all 64-d).
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(seed)
    tokenizer = build_digits_tokenizer()
    tokenizer_2 = build_digits_tokenizer()
    text_encoder = _text_encoder(tokenizer)
    text_encoder_2 = _text_encoder(tokenizer_2)
    tokenizer_3 = build_digits_t5_tokenizer()
    text_encoder_3 = _t5_encoder(tokenizer_3)
    transformer = SD3Transformer2DModel(
        sample_size=RESOLUTION,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=128,
        pooled_projection_dim=64,
        pos_embed_max_size=RESOLUTION // 2,
    )
    _zero_adaln(transformer)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(32,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=RESOLUTION,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_digit_images() -> tuple[Tensor, Tensor, list[str | None]]:
    """scikit-learn's bundled 8x8 digits (1,797 images, no download) with per-image style labels.

    The style comes from the ink amount (mean intensity), split into thirds per digit class: the
    bottom third is "thin", the top third "bold", the middle has no style.

    Returns:
        images (N, 3, 8, 8) float32 in [0, 1] (white ink on black, gray replicated to 3 channels),
        labels (N,) int64, styles (list of N entries, each "bold", "thin" or None).
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    gray = torch.as_tensor(data.images, dtype=torch.float32) / 16.0
    images = gray.unsqueeze(1).repeat(1, 3, 1, 1).contiguous()
    labels = torch.as_tensor(data.target, dtype=torch.int64)
    ink = gray.mean(dim=(1, 2))
    styles: list[str | None] = [None] * len(labels)
    for digit in range(10):
        idx = torch.nonzero(labels == digit).flatten()
        low, high = torch.quantile(ink[idx], torch.tensor([1 / 3, 2 / 3]))
        for i in idx.tolist():
            if ink[i] <= low:
                styles[i] = "thin"
            elif ink[i] >= high:
                styles[i] = "bold"
    return images, labels, styles


def encode_prompts(pipe: Any, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """Encode prompts through the pipeline's own ``encode_prompt`` (gradients flow).

    Args:
        pipe: a flowrl-digits ``StableDiffusion3Pipeline``.
        prompts: B strings.

    Returns:
        prompt_embeds (B, TOKENIZER_MAX_LENGTH + MAX_SEQUENCE_LENGTH, 64), pooled (B, 64).
    """
    return encode_sd3_prompts(pipe, prompts, MAX_SEQUENCE_LENGTH, pipe.transformer.device)
