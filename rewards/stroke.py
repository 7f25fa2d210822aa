"""Stroke width of white-on-black line drawings, and the ``stroke_width`` style reward built on it.

The width is measured on the shape, not on the brightness: the gray image is divided by its own
peak, bilinearly upsampled 2x, thresholded at half the peak, and thinned to a 1-pixel skeleton
(Zhang & Suen); ``width = ink area / skeleton length`` in the input's pixels. Dimming an image
leaves the width unchanged, and a filled blob has a large width, so a reward that asks for a
width inside a band taken from real digits cannot be won by either.

References:
    Zhang & Suen, "A Fast Parallel Algorithm for Thinning Digital Patterns", CACM 27(3), 1984.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import check_images
from .digits import sample_styles

UPSAMPLE = 2
THRESHOLD = 0.5  # of the image's own peak
PEAK_QUANTILE = 0.98
# The band of the stroke_width reward: the thinnest and boldest widths of the embedded model's
# style data (5th / 95th percentile of stroke_width over flowrl.models.digits.load_digit_images).
WIDTH_THIN = 1.15
WIDTH_BOLD = 3.25
FULL_CONTRAST = 0.6  # an image whose peak is below this is penalised in proportion
RENDER_SIZE = 32  # skeletons are drawn at 32x32 (the resolution of sklearn's original bitmaps)
SKELETON_THRESHOLD = 0.55  # of the bicubic 8 -> 32 upsample; of 0.3..0.75, the best for keeping loops open


def _neighbours(x: Tensor) -> list[Tensor]:
    """P2..P9 of Zhang & Suen (N, NE, E, SE, S, SW, W, NW) of a (B, H, W) 0/1 tensor, zero-padded."""
    p = F.pad(x, (1, 1, 1, 1))
    h, w = x.shape[-2:]
    offsets = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]
    return [p[:, 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy, dx in offsets]


def skeletonize(mask: Tensor, max_iterations: int = 64) -> Tensor:
    """Zhang–Suen thinning of a batch of binary shapes to 1-pixel-wide skeletons.

    Args:
        mask: (B, H, W) bool or 0/1.
        max_iterations: cap on the number of two-sub-pass iterations.

    Returns:
        (B, H, W) bool skeleton, a subset of ``mask``.
    """
    if mask.ndim != 3:
        raise ValueError(f"mask must be (B, H, W); got {tuple(mask.shape)}")
    x = mask.to(torch.uint8).clone()
    for _ in range(max_iterations):
        changed = False
        for first in (True, False):
            n = _neighbours(x)
            count = sum(v.to(torch.int32) for v in n)
            ring = n + n[:1]
            transitions = sum(((ring[i] == 0) & (ring[i + 1] == 1)).to(torch.int32) for i in range(8))
            p2, p4, p6, p8 = n[0], n[2], n[4], n[6]
            if first:
                c1, c2 = p2 * p4 * p6, p4 * p6 * p8
            else:
                c1, c2 = p2 * p4 * p8, p2 * p6 * p8
            remove = (x == 1) & (count >= 2) & (count <= 6) & (transitions == 1) & (c1 == 0) & (c2 == 0)
            if remove.any():
                x = x * (~remove).to(torch.uint8)
                changed = True
        if not changed:
            break
    return x.bool()


def draw_strokes(digits: Tensor, radii: Tensor, size: int = 16) -> Tensor:
    """Redraw 8x8 gray digits with a full-contrast pen of a given radius.

    Each digit is bicubically upsampled to ``RENDER_SIZE``, thresholded at ``SKELETON_THRESHOLD``,
    thinned to its skeleton (:func:`skeletonize`) and drawn with an anti-aliased disk of radius
    ``r`` (``ink = clip(r + 0.5 - distance to the skeleton, 0, 1)``), then area-pooled to ``size``.

    Args:
        digits: (N, 8, 8) in [0, 1].
        radii: (N,) pen radii in ``RENDER_SIZE`` pixels.
        size: output side (a divisor of ``RENDER_SIZE``).

    Returns:
        (N, size, size) float32 in [0, 1].
    """
    if digits.ndim != 3 or radii.shape != (len(digits),):
        raise ValueError(f"need digits (N, H, W) and radii (N,); got {tuple(digits.shape)} and {tuple(radii.shape)}")
    up = F.interpolate(digits[:, None].float(), size=(RENDER_SIZE, RENDER_SIZE), mode="bicubic")
    skeleton = skeletonize(up[:, 0].clamp(0, 1) >= SKELETON_THRESHOLD)
    axis = torch.arange(RENDER_SIZE, dtype=torch.float32) + 0.5
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), dim=-1).reshape(-1, 2)
    pens = []
    for bone, radius in zip(skeleton, radii.tolist()):
        points = grid[bone.flatten()]
        if len(points) == 0:
            pens.append(torch.zeros(RENDER_SIZE, RENDER_SIZE))
            continue
        distance = torch.cdist(grid, points).min(dim=1).values.view(RENDER_SIZE, RENDER_SIZE)
        pens.append((radius + 0.5 - distance).clamp(0, 1))
    return F.adaptive_avg_pool2d(torch.stack(pens)[:, None], size)[:, 0]


def peak_intensity(images: Tensor) -> Tensor:
    """The bright end of each image's gray values: the PEAK_QUANTILE quantile. (B, 3, H, W) -> (B,)."""
    gray = images.detach().float().mean(dim=1).flatten(1)
    return torch.quantile(gray, PEAK_QUANTILE, dim=1)


def stroke_width(images: Tensor) -> Tensor:
    """Mean stroke width of each image in its own pixels, independent of its brightness.

    ``gray / peak`` is upsampled ``UPSAMPLE`` x (bilinear), thresholded at ``THRESHOLD``, thinned with
    :func:`skeletonize`; ``width = area / skeleton length / UPSAMPLE``. An image with no ink
    (peak < 1e-3) has width 0.

    Args:
        images: (B, 3, H, W) in [0, 1], white strokes on black.

    Returns:
        (B,) float32 widths.
    """
    check_images(images)
    gray = images.detach().float().mean(dim=1, keepdim=True)
    peak = peak_intensity(images).clamp_min(1e-3).view(-1, 1, 1, 1)
    up = F.interpolate(gray / peak, scale_factor=UPSAMPLE, mode="bilinear", align_corners=False)
    mask = up[:, 0] >= THRESHOLD
    length = skeletonize(mask).flatten(1).sum(dim=1).float()
    area = mask.flatten(1).sum(dim=1).float()
    width = area / length.clamp_min(1.0) / UPSAMPLE
    return torch.where(peak.view(-1) > 1e-3, width, torch.zeros_like(width))


def band_score(width: Tensor, style: Tensor) -> Tensor:
    """Score of widths against the real-data band [WIDTH_THIN, WIDTH_BOLD], per style.

    With ``u = (width - WIDTH_THIN) / (WIDTH_BOLD - WIDTH_THIN)``: "bold" (+1) scores ``u`` up to 1
    and ``1 - 2 (u - 1)`` beyond the boldest real width; "thin" (-1) scores ``1 - u`` down to
    ``u = 0`` and ``1 + 2 u`` below the thinnest. Both peak at 1 at their end of the band; scores
    are clamped below at -1 (a blob or a blank image is as wrong as it gets).

    Args:
        width: (B,) stroke widths.
        style: (B,) +1 for bold, -1 for thin.
    """
    u = (width - WIDTH_THIN) / (WIDTH_BOLD - WIDTH_THIN)
    toward = torch.where(style > 0, u, 1.0 - u)
    beyond = torch.where(style > 0, u - 1.0, -u)
    return torch.where(beyond > 0, 1.0 - 2.0 * beyond, toward.clamp(max=1.0)).clamp(min=-1.0)


class StrokeWidth:
    """Style reward: the prompt's "bold"/"thin" asks for a stroke width at that end of the real band.

    ``r = band_score(stroke_width, style) * min(1, peak / FULL_CONTRAST)``; prompts with neither
    word score NaN ("not applicable", ``allows_nan = True``). The contrast factor makes a dimmed
    image score less, never more.
    """

    allows_nan = True

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) in [0, 1]; NaN where the prompt has no style."""
        check_images(images)
        styles = sample_styles(prompts, metadata.get("style"), images.shape[0])
        sign = torch.tensor([{"bold": 1.0, "thin": -1.0}.get(s, math.nan) for s in styles])
        contrast = (peak_intensity(images) / FULL_CONTRAST).clamp(max=1.0)
        score = band_score(stroke_width(images), sign) * contrast
        return torch.where(sign.isnan(), sign, score).float().to(images.device)


def stroke_width_reward() -> StrokeWidth:
    """Stroke-width style reward: width toward the thin / bold end of the real digits' band, per the prompt.

    Returns:
        A reward ``(images (B, 3, H, W), prompts, style=None) -> (B,) float32`` (NaN for style-less prompts).
    """
    return StrokeWidth()


stroke_width_reward.offline = True  # type: ignore[attr-defined]
