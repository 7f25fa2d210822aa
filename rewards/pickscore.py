"""PickScore: a CLIP-H model fine-tuned on Pick-a-Pic human preferences.

Reference: Kirstain et al., "Pick-a-Pic: An Open Dataset of User Preferences for Text-to-Image
Generation", NeurIPS 2023. The published model (hub ``yuvalkirstain/PickScore_v1``) is a
transformers ``CLIPModel``; its processor is the LAION CLIP-H one
(``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: shorter side 224, centre crop 224, OpenAI CLIP mean/std).
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import Tensor

from .clip_embedder import TransformersClipEmbedder, load_transformers_clip
from .model_reward import ModelReward
from .weights import CONFIG_FILES, PICKLE_WEIGHTS, SAFETENSORS_WEIGHTS, CachedDefaults

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
CLIP_H_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


class PickScore(ModelReward):
    """``r = scale * exp(logit_scale) * cos(e_img, e_txt)``, per image and its prompt.

    Args:
        embedder: the loaded CLIP model, tokenizer and preprocessing.
        scale: multiplier on the published score (1.0 = the paper's PickScore).
        batch_size: images per forward pass.
    """

    name = "pickscore"

    def __init__(self, embedder: TransformersClipEmbedder, scale: float, batch_size: int) -> None:
        super().__init__(embedder.device, embedder.dtype, batch_size)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"pickscore scale must be a finite number; got {scale!r}")
        self.embedder, self.scale = embedder, float(scale)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        img = self.embedder.image_embeds(images)
        txt = self.embedder.text_embeds(prompts)
        return self.scale * self.embedder.logit_scale * (img * txt).sum(-1)


def pickscore(
    model: str = PICKSCORE_MODEL,
    processor: str = CLIP_H_PROCESSOR,
    device: str = "cpu",
    dtype: str = "float32",
    scale: float = 1.0,
    batch_size: int = 16,
) -> PickScore:
    """PickScore (Kirstain et al. 2023): human-preference score of a CLIP-H fine-tuned on Pick-a-Pic.

    Scale: we return ``exp(logit_scale) * cos(image, prompt)``, the quantity the PickScore model
    card computes, unscaled, so scores compare with published PickScore tables; per-group
    advantages (GRPO) do not depend on the scale. Flow-GRPO divides this value by 26 to bring it
    near [0, 1]; pass ``scale: 0.038461538`` (1/26) to reproduce Flow-GRPO's rewards, e.g. for
    objectives that use the reward's value directly (DiffusionNFT's optimality weights).

    Args:
        model: local ``CLIPModel`` folder or hub id of PickScore_v1.
        processor: local CLIP processor folder (tokenizer + ``preprocessor_config.json``) or hub id.
        device: torch device for the model.
        dtype: "float32", "bfloat16" or "float16" for the model weights (scores are float32).
        scale: multiplier on the score.
        batch_size: images per forward pass.

    Returns:
        A reward ``(images (B, 3, H, W) in [0, 1], prompts) -> (B,) float32``.
    """
    names = ("PickScore_v1", "PickScore's CLIP-H processor")
    embedder = load_transformers_clip("pickscore", model, processor, names, device, dtype)
    return PickScore(embedder, scale, batch_size)


pickscore.offline = CachedDefaults(  # type: ignore[attr-defined]
    (PICKSCORE_MODEL, [CONFIG_FILES, SAFETENSORS_WEIGHTS + PICKLE_WEIGHTS]),
    (CLIP_H_PROCESSOR, [("preprocessor_config.json",)]),
)
