"""Transformed real digits and no-digit images: the reader's checks (tests, ``bench/reader.py``).

These are not the training augmentation (:mod:`flowrl.models.digits.reader_augment`): each variant
is one fixed transform of the held-out digits, so a table row means one thing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .reader_augment import skeleton_distances
from .reader_features import gaussian_blur, resample


def _rotate(x: Tensor, degrees: float) -> Tensor:
    theta = torch.zeros(len(x), 2, 3)
    rad = math.radians(degrees)
    theta[:, 0, 0] = theta[:, 1, 1] = math.cos(rad)
    theta[:, 0, 1], theta[:, 1, 0] = -math.sin(rad), math.sin(rad)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _skeleton_render(images8: Tensor, width: float) -> Tensor:
    return (width / 2 + 0.5 - skeleton_distances(images8[:, 0].numpy(), 0.3)[:, None]).clamp(0, 1)


VARIANTS: dict[str, str] = {
    "plain 8x8": "the real digits as they are",
    "plain 16x16": "bilinear upsample",
    "plain 32x32": "bilinear upsample",
    "plain 64x64": "bilinear upsample",
    "eroded 16x16": "32x32 upsample, gray erosion 5x5 (strokes 4 px thinner at 32), area to 16",
    "dilated 16x16": "32x32 upsample, gray dilation 5x5 (strokes 4 px bolder at 32), area to 16",
    "eroded 8x8": "the same erosion, area to 8",
    "dilated 8x8": "the same dilation, area to 8",
    "skeleton 1.5px 16x16": "thinned to the skeleton, drawn 1.5 px wide at 32, full contrast, area to 16",
    "skeleton 6px 16x16": "thinned to the skeleton, drawn 6 px wide at 32, full contrast, area to 16",
    "dim x0.35 8x8": "ink scaled by 0.35",
    "gray bg 0.3 + noise 16x16": "16x16, background 0.3, ink 1, gaussian noise std 0.05",
    "rotated +12 16x16": "rotated 12 degrees anticlockwise",
    "rotated -12 16x16": "rotated 12 degrees clockwise",
    "blurred 16x16": "gaussian blur sigma 1.5 px at 32, area to 16",
}


def transformed_digits(images8: Tensor, variant: str, seed: int = 0) -> Tensor:
    """One of :data:`VARIANTS` of real digits (N, 1, 8, 8) in [0, 1] -> (N, 1, H, W) in [0, 1]."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; pick one of {sorted(VARIANTS)}")
    big = resample(images8)
    gen = torch.Generator().manual_seed(seed)
    if variant.startswith("plain"):
        size = int(variant.split()[-1].split("x")[0])
        return images8 if size == 8 else resample(images8, size)
    size = int(variant.split()[-1].split("x")[0])
    if variant.startswith("eroded"):
        out = -F.max_pool2d(-big, 5, 1, 2)
    elif variant.startswith("dilated"):
        out = F.max_pool2d(big, 5, 1, 2)
    elif variant.startswith("skeleton"):
        out = _skeleton_render(images8, float(variant.split()[1].removesuffix("px")))
    elif variant.startswith("dim"):
        out = big * 0.35
    elif variant.startswith("gray bg"):
        small = 0.3 + 0.7 * resample(images8, 16)
        return (small + 0.05 * torch.randn(small.shape, generator=gen)).clamp(0, 1)
    elif variant.startswith("rotated"):
        out = _rotate(big, float(variant.split()[1]))
    else:  # blurred
        out = gaussian_blur(big, 1.5)
    return F.interpolate(out.clamp(0, 1), size=(size, size), mode="area")


def unreadable_images() -> dict[str, Tensor]:
    """Images that show no digit (4, 1, 16, 16) each: blank, uniform gray, all white, a filled disk."""
    coords = torch.arange(16, dtype=torch.float32) + 0.5 - 8
    disk = ((coords.view(-1, 1) ** 2 + coords.view(1, -1) ** 2).sqrt() < 5.5).float()
    return {
        "blank": torch.zeros(4, 1, 16, 16),
        "uniform gray": torch.full((4, 1, 16, 16), 0.5),
        "all white": torch.ones(4, 1, 16, 16),
        "filled disk": disk.expand(4, 1, 16, 16) * torch.tensor([1.0, 0.7, 0.5, 0.3]).view(4, 1, 1, 1),
    }
