"""CLIPScore: prompt-image agreement under OpenAI's CLIP ViT-L/14.

Reference: Hessel et al., "CLIPScore: A Reference-free Evaluation Metric for Image Captioning",
EMNLP 2021: ``CLIP-S(c, v) = w * max(cos(E_c, E_v), 0)`` with ``w = 2.5``. The published weights
(hub ``openai/clip-vit-large-patch14``) are a transformers ``CLIPModel`` folder that also holds
the processor (shorter side 224, centre crop 224, OpenAI CLIP mean/std).
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import Tensor

from .clip_embedder import TransformersClipEmbedder, load_transformers_clip
from .model_reward import ModelReward
from .weights import CONFIG_FILES, PICKLE_WEIGHTS, SAFETENSORS_WEIGHTS, CachedDefaults

CLIP_L_MODEL = "openai/clip-vit-large-patch14"


class ClipScore(ModelReward):
    """``r = w * max(cos(e_img, e_txt), 0)`` per image and its prompt.

    Args:
        embedder: the loaded CLIP model, tokenizer and preprocessing.
        weight: ``w`` (2.5 in the paper).
        batch_size: images per forward pass.
    """

    name = "clipscore"

    def __init__(self, embedder: TransformersClipEmbedder, weight: float, batch_size: int) -> None:
        super().__init__(embedder.device, embedder.dtype, batch_size)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"clipscore weight must be a finite number; got {weight!r}")
        self.embedder, self.weight = embedder, float(weight)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        cos = (self.embedder.image_embeds(images) * self.embedder.text_embeds(prompts)).sum(-1)
        return self.weight * cos.clamp(min=0.0)


def clipscore(
    model: str = CLIP_L_MODEL,
    processor: str | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    weight: float = 2.5,
    batch_size: int = 16,
) -> ClipScore:
    """CLIPScore (Hessel et al. 2021): 2.5 * max(cosine(image, prompt), 0) under OpenAI CLIP ViT-L/14.

    Args:
        model: local ``CLIPModel`` folder or hub id.
        processor: CLIP processor folder or hub id; default: the model folder (OpenAI's repo holds both).
        device: torch device for the model.
        dtype: "float32", "bfloat16" or "float16" for the model weights (scores are float32).
        weight: the paper's ``w``.
        batch_size: images per forward pass.

    Returns:
        A reward ``(images (B, 3, H, W) in [0, 1], prompts) -> (B,) float32`` in [0, w].
    """
    names = ("OpenAI CLIP ViT-L/14", "OpenAI CLIP ViT-L/14 processor")
    embedder = load_transformers_clip("clipscore", model, processor or model, names, device, dtype)
    return ClipScore(embedder, weight, batch_size)


clipscore.offline = CachedDefaults((CLIP_L_MODEL, [CONFIG_FILES, SAFETENSORS_WEIGHTS + PICKLE_WEIGHTS]))  # type: ignore[attr-defined]
