"""ImageReward: a BLIP (ViT-L/16 + BERT with cross-attention) reward model with an MLP head.

Reference: Xu et al., "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation", NeurIPS 2023. The published ``ImageReward.pt`` (hub ``THUDM/ImageReward``) is a
``torch.save``'d state dict:

- ``blip.visual_encoder.*``: a timm-style ViT (``cls_token``, ``pos_embed``, ``patch_embed.proj``,
  ``blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``; LayerNorm eps 1e-6);
- ``blip.text_encoder.*``: BLIP's BERT with cross-attention (``embeddings``, ``encoder.layer.N.
  {attention, crossattention, intermediate, output}``), the same names transformers'
  ``BlipTextModel`` uses;
- ``mlp.layers.{0,2,4,6,7}.*``: the LAION-style affine head 768 -> 1024 -> 128 -> 64 -> 16 -> 1;
- ``blip.vision_proj.*``, ``blip.text_proj.*``: retrieval projections, unused for the score.

Score, per image and prompt: the prompt is tokenised by BLIP's BERT tokenizer (bert-base-uncased
plus ``[DEC]`` and ``[ENC]``, padded to 35 tokens), the text encoder cross-attends to the image
tokens, and ``r = (mlp(h_CLS) - 0.16717362830052426) / 1.0333394966054072`` (the published mean/std).
Images: shorter side 224 (bicubic), centre crop 224, OpenAI CLIP mean/std.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from .aesthetic import linear_chain_from_state
from .clip_embedder import quiet_transformers
from .image_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_pixels
from .model_reward import ModelReward
from .weights import CachedDefaults, WeightSource, load_checkpoint, resolve_file, resolve_model_folder, torch_dtype

IMAGEREWARD_REPO = "THUDM/ImageReward"
IMAGEREWARD_FILE = "ImageReward.pt"
BERT_TOKENIZER = "google-bert/bert-base-uncased"
REWARD_MEAN = 0.16717362830052426
REWARD_STD = 1.0333394966054072
TEXT_LENGTH = 35
# Head counts of ImageReward-v1.0's BLIP (not recoverable from tensor shapes): ViT-L/16 and BERT-base.
IMAGEREWARD_V1 = {"vision_heads": 16, "text_heads": 12}

_VISION_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_VISION_PARTS = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_PLAIN = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_UNUSED_PREFIXES = ("blip.vision_proj.", "blip.text_proj.")
_UNUSED_KEYS = {"blip.text_encoder.embeddings.position_ids"}


def split_checkpoint(
    state: Mapping[str, Tensor], where: str
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Split ImageReward.pt into (vision, text, head) state dicts with their prefixes removed.

    Raises:
        ValueError: a key outside the published layout (named in the message).
    """
    parts: dict[str, dict[str, Tensor]] = {"blip.visual_encoder.": {}, "blip.text_encoder.": {}, "mlp.": {}}
    for key, value in state.items():
        if key in _UNUSED_KEYS or key.startswith(_UNUSED_PREFIXES):
            continue
        prefix = next((p for p in parts if key.startswith(p)), None)
        if prefix is None:
            raise ValueError(
                f"{where}: key {key!r} is not part of the ImageReward layout "
                "(blip.visual_encoder, blip.text_encoder, mlp)"
            )
        parts[prefix][key[len(prefix) :]] = value
    missing = [p for p, d in parts.items() if not d]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} weights; is this ImageReward.pt?")
    return parts["blip.visual_encoder."], parts["blip.text_encoder."], parts["mlp."]


def convert_vision(state: Mapping[str, Tensor], where: str) -> dict[str, Tensor]:
    """BLIP's timm-style ViT keys -> transformers ``BlipVisionModel`` keys (qkv stays fused: same layout)."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key in _VISION_PLAIN:
            out[_VISION_PLAIN[key]] = value
            continue
        match = _VISION_BLOCK.match(key)
        module, _, kind = match.group(2).rpartition(".") if match else ("", "", "")
        if match is None or module not in _VISION_PARTS:
            raise ValueError(f"{where}: vision key {key!r} has no BlipVisionModel counterpart")
        out[f"encoder.layers.{match.group(1)}.{_VISION_PARTS[module]}.{kind}"] = value
    return out


def _count(state: Mapping[str, Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for k in state if (m := re.match(pattern, k))}
    return max(found) + 1 if found else 0


def build_blip_towers(
    vision: Mapping[str, Tensor], text: Mapping[str, Tensor], architecture: Mapping[str, int], where: str
) -> tuple[Any, Any]:
    """Transformers ``BlipVisionModel`` and ``BlipTextModel`` (with cross-attention) holding the checkpoint.

    Sizes come from tensor shapes; head counts from ``architecture`` (``vision_heads``, ``text_heads``).
    """
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    width, patch = vision["patch_embed.proj.weight"].shape[0], vision["patch_embed.proj.weight"].shape[-1]
    grid = int(round((vision["pos_embed"].shape[1] - 1) ** 0.5))
    vision_config = BlipVisionConfig(
        hidden_size=int(width),
        intermediate_size=int(vision["blocks.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=_count(vision, r"^blocks\.(\d+)\."),
        num_attention_heads=int(architecture["vision_heads"]),
        image_size=int(grid * patch),
        patch_size=int(patch),
        layer_norm_eps=1e-6,
        hidden_act="gelu",
    )
    vocab, hidden = text["embeddings.word_embeddings.weight"].shape
    text_config = BlipTextConfig(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        encoder_hidden_size=int(text["encoder.layer.0.crossattention.self.key.weight"].shape[1]),
        intermediate_size=int(text["encoder.layer.0.intermediate.dense.weight"].shape[0]),
        num_hidden_layers=_count(text, r"^encoder\.layer\.(\d+)\."),
        num_attention_heads=int(architecture["text_heads"]),
        max_position_embeddings=int(text["embeddings.position_embeddings.weight"].shape[0]),
        layer_norm_eps=1e-12,
        hidden_act="gelu",
        is_decoder=True,
        pad_token_id=0,
    )
    for name, size, heads in (
        ("vision", width, vision_config.num_attention_heads),
        ("text", hidden, text_config.num_attention_heads),
    ):
        if size % heads:
            raise ValueError(
                f"{where}: {name} width {int(size)} is not divisible by {heads} heads; check the architecture option"
            )
    vision_model, text_model = BlipVisionModel(vision_config), BlipTextModel(text_config, add_pooling_layer=False)
    vision_model.load_state_dict(convert_vision(vision, where), strict=True)
    text_model.load_state_dict({k: v.float() for k, v in text.items()}, strict=True)
    return vision_model.eval().requires_grad_(False), text_model.eval().requires_grad_(False)


class ImageReward(ModelReward):
    """ImageReward score per image and prompt (see the module docstring).

    Args:
        vision: ``BlipVisionModel``.
        text: ``BlipTextModel`` with cross-attention.
        head: affine MLP on the [CLS] feature.
        tokenizer: BLIP's BERT tokenizer.
        image_size: model input side (224 published).
        device: torch device.
        dtype: model dtype.
        batch_size: images per forward pass.
    """

    name = "imagereward"

    def __init__(
        self,
        vision: Any,
        text: Any,
        head: nn.Sequential,
        tokenizer: Any,
        image_size: int,
        device: torch.device,
        dtype: torch.dtype,
        batch_size: int,
    ) -> None:
        super().__init__(device, dtype, batch_size)
        self.vision, self.text = vision.to(device=device, dtype=dtype), text.to(device=device, dtype=dtype)
        self.head, self.tokenizer, self.image_size = head.to(device), tokenizer, image_size

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        pixels = clip_pixels(images.to(self.device), self.image_size, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)
        image_tokens = self.vision(pixel_values=pixels.to(self.dtype)).last_hidden_state
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=TEXT_LENGTH, return_tensors="pt"
        )
        out = self.text(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=torch.ones(image_tokens.shape[:2], dtype=torch.long, device=self.device),
        )
        raw = self.head(out.last_hidden_state[:, 0].float())[:, 0]
        return (raw - REWARD_MEAN) / REWARD_STD


def load_blip_tokenizer(spec: str) -> Any:
    """bert-base-uncased plus BLIP's added specials ``[DEC]`` (bos) and ``[ENC]``."""
    folder = resolve_model_folder(
        spec,
        WeightSource("ImageReward's BERT tokenizer (bert-base-uncased)", "rewards.imagereward.tokenizer"),
        weights=False,
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    return tokenizer


def imagereward(
    checkpoint: str = IMAGEREWARD_REPO,
    tokenizer: str = BERT_TOKENIZER,
    architecture: dict[str, int] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> ImageReward:
    """ImageReward (Xu et al. 2023): BLIP-based human-preference reward, normalised by the published mean/std.

    Args:
        checkpoint: ``ImageReward.pt`` file, a folder holding it, the hub repo ("THUDM/ImageReward")
            or "owner/repo/file.pt". Read with ``torch.load(weights_only=True)`` (or safetensors).
        tokenizer: bert-base-uncased tokenizer folder or hub id.
        architecture: head counts ``{"vision_heads": 16, "text_heads": 12}`` (ImageReward-v1.0's).
        device: torch device.
        dtype: "float32", "bfloat16" or "float16" for BLIP (the head runs in float32; scores are float32).
        batch_size: images per forward pass.

    Returns:
        A reward ``(images (B, 3, H, W) in [0, 1], prompts) -> (B,) float32``.
    """
    arch = dict(IMAGEREWARD_V1, **(architecture or {}))
    path = resolve_file(
        checkpoint, WeightSource("ImageReward-v1.0", "rewards.imagereward.checkpoint"), IMAGEREWARD_FILE
    )
    quiet_transformers()
    where = str(path)
    vision_state, text_state, head_state = split_checkpoint(load_checkpoint(path, nested_key="state_dict"), where)
    tok = load_blip_tokenizer(tokenizer)
    vision, text = build_blip_towers(vision_state, text_state, arch, where)
    if len(tok) > text.config.vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {len(tok)} tokens but the text encoder only {text.config.vocab_size}; "
            "use bert-base-uncased"
        )
    head = linear_chain_from_state(head_state, where + " (mlp)", text.config.hidden_size)
    return ImageReward(
        vision, text, head, tok, vision.config.image_size, torch.device(device), torch_dtype(dtype), batch_size
    )


imagereward.offline = CachedDefaults(  # type: ignore[attr-defined]
    (IMAGEREWARD_REPO, [(IMAGEREWARD_FILE,)]), (BERT_TOKENIZER, [("vocab.txt", "tokenizer.json")])
)
