"""Differentiable image preprocessing for reward models, in torch (no PIL round trip).

Images arrive as float (B, 3, H, W) in [0, 1]. Resizing uses ``F.interpolate(mode="bicubic",
antialias=True)``, whose kernel is PIL's bicubic (a = -0.5) with antialiasing when shrinking, so it
stays close to the published PIL/torchvision pipelines while keeping gradients to the pixels.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _bicubic(images: Tensor, size: tuple[int, int]) -> Tensor:
    if tuple(images.shape[-2:]) == size:
        return images
    return F.interpolate(images, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)


def resize_shortest_center_crop(images: Tensor, size: int, crop: tuple[int, int] | None = None) -> Tensor:
    """Resize the shorter side to ``size`` (aspect kept), then take the centred crop.

    This is CLIP's / transformers' ``CLIPImageProcessor`` geometry: the long side becomes
    ``int(size * long / short)``; the crop's top-left corner is ``((H - h) // 2, (W - w) // 2)``.

    Args:
        images: (B, 3, H, W) float in [0, 1].
        size: target length of the shorter side.
        crop: (h, w) of the centre crop; default (size, size).

    Returns:
        (B, 3, h, w) float.
    """
    h, w = images.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    new_long = int(size * long / short)
    new_hw = (size, new_long) if h <= w else (new_long, size)
    resized = _bicubic(images, new_hw)
    ch, cw = crop or (size, size)
    top, left = max((new_hw[0] - ch) // 2, 0), max((new_hw[1] - cw) // 2, 0)
    return resized[..., top : top + ch, left : left + cw]


def resize_longest_pad(images: Tensor, size: int) -> Tensor:
    """Resize the longer side to ``size`` (aspect kept) and zero-pad, centred, to (size, size).

    This is open_clip's ``ResizeMaxSize`` (used by HPSv2's evaluation transform): padding is added
    before normalisation, with ``pad // 2`` on the top/left and the rest on the bottom/right. Unlike
    some open_clip versions, a non-square image whose longer side already equals ``size`` is padded
    too (the model needs a square input).

    Args:
        images: (B, 3, H, W) float in [0, 1].
        size: output side length.

    Returns:
        (B, 3, size, size) float.
    """
    h, w = images.shape[-2:]
    scale = size / float(max(h, w))
    if scale == 1.0 and h == w:
        return images
    new_h, new_w = round(h * scale), round(w * scale)
    resized = _bicubic(images, (new_h, new_w))
    pad_h, pad_w = size - new_h, size - new_w
    return F.pad(resized, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel ``(x - mean) / std`` for (B, 3, H, W)."""
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def clip_pixels(
    images: Tensor,
    size: int,
    *,
    crop: tuple[int, int] | None = None,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
    longest_pad: bool = False,
) -> Tensor:
    """CLIP-style pixel values: resize (+ centre crop, or longest-side resize + pad), then normalise.

    Args:
        images: (B, 3, H, W) float in [0, 1]; computed in float32.
        size: shorter-side size (crop mode) or output side (``longest_pad``).
        crop: (h, w) centre crop; default (size, size).
        mean: per-channel mean.
        std: per-channel std.
        longest_pad: use :func:`resize_longest_pad` instead of shortest-side resize + centre crop.

    Returns:
        (B, 3, h, w) float32 pixel values, differentiable with respect to ``images``.
    """
    x = images.float()
    x = resize_longest_pad(x, size) if longest_pad else resize_shortest_center_crop(x, size, crop)
    return normalize(x, mean, std)
