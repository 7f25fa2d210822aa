"""JPEG (in)compressibility rewards, as in DDPO.

Reference: Black et al., "Training Diffusion Models with Reinforcement Learning" (DDPO), 2023:
each image is JPEG-encoded and the reward is minus (compressibility) or plus (incompressibility)
the file size in kilobytes (1 kB = 1000 bytes).
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch
from torch import Tensor

from .contract import check_images


def _check_quality(quality: object) -> int:
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"jpeg quality must be an integer in [1, 100]; got {quality!r}")
    return quality


def jpeg_sizes_kb(images: Tensor, quality: int = 95) -> Tensor:
    """JPEG file size of each image in kB, encoded with PIL.

    Args:
        images: (B, 3, H, W) float in [0, 1]; quantised to uint8 with ``round(255 x)``.
        quality: PIL JPEG quality in [1, 100].

    Returns:
        Sizes (B,) float32 in kilobytes (bytes / 1000).
    """
    from PIL import Image

    check_images(images)
    quality = _check_quality(quality)
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32, device=images.device)


class JpegSize:
    """Signed JPEG size reward: ``sign * size_kB`` (sign -1: compressibility, +1: incompressibility)."""

    allows_nan = False

    def __init__(self, quality: int, sign: float) -> None:
        self.quality = _check_quality(quality)
        self.sign = sign

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        return self.sign * jpeg_sizes_kb(images, self.quality)


def jpeg_compressibility(quality: int = 95) -> JpegSize:
    """JPEG compressibility (DDPO): minus the JPEG size in kB at the given quality.

    Args:
        quality: PIL JPEG quality in [1, 100].

    Returns:
        A reward ``(images (B, 3, H, W), prompts) -> (B,) float32``, ``-size_kB``.
    """
    return JpegSize(quality, -1.0)


def jpeg_incompressibility(quality: int = 95) -> JpegSize:
    """JPEG incompressibility (DDPO): the JPEG size in kB at the given quality.

    Args:
        quality: PIL JPEG quality in [1, 100].

    Returns:
        A reward ``(images (B, 3, H, W), prompts) -> (B,) float32``, ``+size_kB``.
    """
    return JpegSize(quality, 1.0)


jpeg_compressibility.offline = True  # type: ignore[attr-defined]
jpeg_incompressibility.offline = True  # type: ignore[attr-defined]
