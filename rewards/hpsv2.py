"""HPSv2 / HPSv2.1: human-preference score from an open_clip ViT-H-14 fine-tuned on HPD v2.

Reference: Wu et al., "Human Preference Score v2: A Solid Benchmark for Evaluating Human
Preferences of Text-to-Image Synthesis", 2023. The published checkpoints (hub ``xswu/HPSv2``:
``HPS_v2_compressed.pt``, ``HPS_v2.1_compressed.pt``) are ``torch.save``'d dicts whose
``"state_dict"`` holds an open_clip ``CLIP`` state dict. The score is the cosine between the unit
image and text embeddings (``image_features @ text_features.T`` on the diagonal, no logit scale),
with open_clip's evaluation transform: longer side resized to 224, zero-padded to 224 x 224,
OpenAI CLIP mean/std.

Two backends load the same file:

- ``open_clip`` (``pip install 'flowrl[openclip]'``, needs torchvision): open_clip's own model and tokenizer;
- ``transformers`` (core install): the state dict converted into ``transformers.CLIPModel``
  (:mod:`flowrl.rewards.openclip_convert`) with the CLIP-H tokenizer from the hub or a local folder.

Both give the same scores on the same weights (``tests/rewards/test_hpsv2_openclip.py`` runs in the
open_clip environment).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .clip_embedder import ClipEmbedder, TransformersClipEmbedder, quiet_transformers
from .image_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from .model_reward import ModelReward
from .openclip_convert import architecture_config, openclip_to_transformers
from .pickscore import CLIP_H_PROCESSOR
from .weights import CachedDefaults, WeightSource, load_checkpoint, resolve_file, resolve_model_folder, torch_dtype

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
BACKENDS = ("auto", "open_clip", "transformers")


class OpenClipEmbedder(ClipEmbedder):
    """:class:`ClipEmbedder` over an ``open_clip`` CLIP model and its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, **geometry: Any) -> None:
        super().__init__(**geometry)
        self.model, self.tokenizer = model, tokenizer

    def _encode_image(self, pixels: Tensor) -> Tensor:
        return self.model.encode_image(pixels)

    def _encode_text(self, prompts: list[str]) -> Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device))


class HPSv2(ModelReward):
    """``r = cos(e_img, e_txt)`` under the HPS-tuned CLIP, per image and its prompt.

    Args:
        embedder: open_clip or transformers CLIP with HPSv2's preprocessing.
        batch_size: images per forward pass.
    """

    name = "hpsv2"

    def __init__(self, embedder: ClipEmbedder, batch_size: int) -> None:
        super().__init__(embedder.device, embedder.dtype, batch_size)
        self.embedder = embedder

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        return (self.embedder.image_embeds(images) * self.embedder.text_embeds(prompts)).sum(-1)


def openclip_installed() -> bool:
    """Whether the optional ``open_clip`` package (``flowrl[openclip]``) can be imported."""
    return importlib.util.find_spec("open_clip") is not None


def _geometry(cfg: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    size = int(cfg["vision_cfg"]["image_size"])
    return dict(
        image_size=size,
        crop=(size, size),
        mean=OPENAI_CLIP_MEAN,
        std=OPENAI_CLIP_STD,
        longest_pad=True,
        device=device,
        dtype=dtype,
    )


def _openclip_embedder(
    state: dict[str, Tensor], architecture: str | Mapping[str, Any], device: torch.device, dtype: torch.dtype
) -> OpenClipEmbedder:
    import open_clip

    cfg = architecture_config(architecture)
    model = open_clip.model.CLIP(
        embed_dim=cfg["embed_dim"],
        vision_cfg=cfg["vision_cfg"],
        text_cfg=cfg["text_cfg"],
        quick_gelu=cfg.get("quick_gelu", False),
    )
    model.load_state_dict({k: v for k, v in state.items() if k not in ("attn_mask", "visual.attn_mask")}, strict=True)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if isinstance(architecture, str):
        tokenizer = open_clip.get_tokenizer(architecture)
    else:
        tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=int(cfg["text_cfg"]["context_length"]))
    return OpenClipEmbedder(model, tokenizer, **_geometry(cfg, device, dtype))


def _transformers_embedder(
    state: dict[str, Tensor],
    architecture: str | Mapping[str, Any],
    folder: Path,
    where: str,
    device: torch.device,
    dtype: torch.dtype,
) -> TransformersClipEmbedder:
    from transformers import AutoTokenizer

    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(folder))
    cfg = architecture_config(architecture)
    model = openclip_to_transformers(state, cfg, tok.eos_token_id, where).to(device=device, dtype=dtype)
    return TransformersClipEmbedder(model, tok, **_geometry(cfg, device, dtype))


def hpsv2(
    checkpoint: str = HPS_REPO,
    version: str = "v2.1",
    backend: str = "auto",
    architecture: str | dict[str, Any] = "ViT-H-14",
    tokenizer: str = CLIP_H_PROCESSOR,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 16,
) -> HPSv2:
    """HPSv2 / HPSv2.1 (Wu et al. 2023): cosine of image and prompt under the HPS-tuned open_clip ViT-H-14.

    Args:
        checkpoint: the published ``.pt`` file, a folder holding it, the hub repo ("xswu/HPSv2";
            the file is picked by ``version``) or "owner/repo/file.pt".
        version: "v2.0" (``HPS_v2_compressed.pt``) or "v2.1" (``HPS_v2.1_compressed.pt``).
        backend: "open_clip" (needs ``pip install 'flowrl[openclip]'``), "transformers" (key
            conversion into ``CLIPModel``, core install), or "auto" (open_clip when installed).
        architecture: open_clip model config name ("ViT-H-14") or dict (open_clip JSON format).
        tokenizer: CLIP tokenizer folder or hub id for the transformers backend (the open_clip
            backend uses open_clip's own tokenizer).
        device: torch device.
        dtype: "float32", "bfloat16" or "float16" for the model (scores are float32).
        batch_size: images per forward pass.

    Returns:
        A reward ``(images (B, 3, H, W) in [0, 1], prompts) -> (B,) float32`` in [-1, 1].
    """
    if version not in HPS_FILES:
        raise ValueError(f"hpsv2 version must be one of {sorted(HPS_FILES)}; got {version!r}")
    if backend not in BACKENDS:
        raise ValueError(f"hpsv2 backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "open_clip" and not openclip_installed():
        raise ImportError(
            "hpsv2 backend 'open_clip' needs open_clip: pip install 'flowrl[openclip]', "
            "or set rewards.hpsv2.backend=transformers"
        )
    architecture_config(architecture)  # fail on a bad architecture before reading gigabytes
    use_open_clip = backend == "open_clip" or (backend == "auto" and openclip_installed())
    device_, dtype_ = torch.device(device), torch_dtype(dtype)
    path = resolve_file(checkpoint, WeightSource(f"HPS{version}", "rewards.hpsv2.checkpoint"), HPS_FILES[version])
    tok_folder = (
        None
        if use_open_clip
        else resolve_model_folder(
            tokenizer, WeightSource("HPSv2's CLIP-H tokenizer", "rewards.hpsv2.tokenizer"), weights=False
        )
    )
    state = load_checkpoint(path, nested_key="state_dict")
    if tok_folder is None:
        embedder: ClipEmbedder = _openclip_embedder(state, architecture, device_, dtype_)
    else:
        embedder = _transformers_embedder(state, architecture, tok_folder, str(path), device_, dtype_)
    return HPSv2(embedder, batch_size)


hpsv2.offline = CachedDefaults((HPS_REPO, [(HPS_FILES["v2.1"],)]), (CLIP_H_PROCESSOR, [("*.json",)]))  # type: ignore[attr-defined]
