"""Training augmentation of the independent digit reader, at 32x32 before resampling to 8..32 px.

- Stroke width: each digit is thinned to its skeleton (Zhang & Suen, "A fast parallel algorithm
  for thinning digital patterns", CACM 1984) and re-rendered at 1-8 px from the skeleton's
  distance transform, or its own gray image is eroded or dilated.
- Affine warps (rotation +-15 degrees, scale, aspect, shear, shift) and an elastic field (Simard,
  Steinkraus & Platt, "Best practices for convolutional neural networks applied to visual
  document analysis", ICDAR 2003).
- Blur, gamma, ink level, gray backgrounds, resolution (8, 12, 16, 24 or 32 px) and noise.
- Unreadable images (blobs, blank or gray, speckle) with uniform targets.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .reader_features import N_FEATURES, SIZE, features, gaussian_blur, resample

SKELETON_THRESHOLDS = (0.2, 0.35, 0.55)  # training skeletons: three ways to binarise each digit


def thin(binary: Tensor) -> Tensor:
    """Zhang-Suen thinning of binary images (B, H, W) bool to one-pixel skeletons (B, H, W) bool.

    Reference: Zhang & Suen, "A fast parallel algorithm for thinning digital patterns", CACM 1984.
    """
    x = binary.clone()
    while True:
        changed = False
        for step in (0, 1):
            p = F.pad(x.float(), (1, 1, 1, 1))[:, None]
            # neighbours P2..P9, clockwise from north
            shifts = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]
            h, w = x.shape[1:]
            n = [p[:, 0, 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy, dx in shifts]
            count = sum(n)
            transitions = sum((n[i] == 0) & (n[(i + 1) % 8] == 1) for i in range(8))
            p2, p4, p6, p8 = n[0], n[2], n[4], n[6]
            if step == 0:
                cond = (p2 * p4 * p6 == 0) & (p4 * p6 * p8 == 0)
            else:
                cond = (p2 * p4 * p8 == 0) & (p2 * p6 * p8 == 0)
            remove = x & (count >= 2) & (count <= 6) & (transitions == 1) & cond
            if remove.any():
                x = x & ~remove
                changed = True
        if not changed:
            return x


def skeleton_distances(images: np.ndarray, threshold: float = 0.3) -> Tensor:
    """Distance (pixels at 32x32) from every pixel to the digit's skeleton.

    Args:
        images: (N, h, w) gray digits in [0, 1].
        threshold: ink level of the bicubic 32x32 upsample that counts as stroke.

    Returns:
        (N, 32, 32) float32; rendering ``clamp(width / 2 + 0.5 - d, 0, 1)`` draws the digit with
        strokes ``width`` pixels wide.
    """
    from scipy.ndimage import distance_transform_edt

    small = torch.as_tensor(images, dtype=torch.float32)[:, None]
    big = F.interpolate(small, size=(SIZE, SIZE), mode="bicubic", align_corners=False)[:, 0]
    skeleton = thin(big > threshold).numpy()
    out = np.stack([distance_transform_edt(~s) if s.any() else np.full(s.shape, 99.0) for s in skeleton])
    return torch.as_tensor(out, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# augmentation


def _uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen)


def _warp(x: Tensor, gen: torch.Generator, elastic: float = 1.5) -> Tensor:
    """Random affine and elastic warp of x (B, 1, 32, 32), one bilinear resample.

    Rotation +-15 deg, scale 0.8-1.2, aspect +-10 %, shear +-0.25, shift +-3 px, plus a smooth
    elastic displacement field (5x5 control points, bicubic, up to ``elastic`` px; Simard et al. 2003).
    """
    b = x.shape[0]
    angle = _uniform(b, -15, 15, gen) * math.pi / 180
    scale = _uniform(b, 0.8, 1.2, gen)
    aspect = _uniform(b, 0.9, 1.1, gen)
    shear = _uniform(b, -0.25, 0.25, gen)
    shift = _uniform(2 * b, -3, 3, gen).view(b, 2) * 2 / SIZE
    cos, sin = angle.cos(), angle.sin()
    rot = torch.stack([torch.stack([cos, -sin], 1), torch.stack([sin, cos], 1)], 1)
    shr = torch.eye(2).repeat(b, 1, 1)
    shr[:, 0, 1] = shear
    scl = torch.diag_embed(torch.stack([scale * aspect, scale / aspect], 1))
    inv = torch.linalg.inv(rot @ shr @ scl)  # affine_grid maps output -> input coordinates
    theta = torch.cat([inv, -(inv @ shift[:, :, None])], dim=2)
    grid = F.affine_grid(theta, [b, 1, SIZE, SIZE], align_corners=False)
    field = torch.randn(b, 2, 5, 5, generator=gen) * _uniform(b, 0, elastic, gen).view(b, 1, 1, 1) * 2 / SIZE
    field = F.interpolate(field, size=(SIZE, SIZE), mode="bicubic", align_corners=True)
    return F.grid_sample(
        x, grid + field.permute(0, 2, 3, 1), mode="bilinear", padding_mode="zeros", align_corners=False
    )


def _stroke(images8: Tensor, distances: Tensor, gen: torch.Generator) -> Tensor:
    """Each digit (B, 8, 8) at 32x32 with a random stroke width, (B, 1, 32, 32).

    Half are re-rendered from one of their skeletons (``distances`` (B, S, 32, 32), one per
    threshold) at a width of 1-8 px; half are the gray upsample itself, eroded or dilated (3x3 or
    5x5) or left alone.
    """
    b = images8.shape[0]
    width = _uniform(b, 1.0, 8.0, gen).view(b, 1, 1, 1)
    which = torch.randint(0, distances.shape[1], (b,), generator=gen)
    rendered = (width / 2 + 0.5 - distances[torch.arange(b), which][:, None]).clamp(0, 1)
    gray = resample(images8[:, None])
    k = (torch.rand(b, generator=gen) < 0.5).view(b, 1, 1, 1)
    dil = torch.where(k, F.max_pool2d(gray, 5, 1, 2), F.max_pool2d(gray, 3, 1, 1))
    ero = torch.where(k, -F.max_pool2d(-gray, 5, 1, 2), -F.max_pool2d(-gray, 3, 1, 1))
    pick = torch.randint(0, 4, (b,), generator=gen).view(b, 1, 1, 1)
    gray = torch.where(pick == 1, dil, torch.where(pick == 2, ero, gray))
    use_skeleton = (torch.rand(b, generator=gen) < 0.5).view(b, 1, 1, 1)
    return torch.where(use_skeleton, rendered, gray)


def _photometric(x: Tensor, gen: torch.Generator) -> Tensor:
    """Blur, gamma, ink level and background of x (B, 1, 32, 32).

    Blur sigma 0-1.2 px (half the time), gamma 0.6-1.6, ink level 0.3-1, a gray background 0-0.3
    (a third of the time, always at least 0.2 below the ink).
    """
    b = x.shape[0]
    blur = _uniform(b, 0.0, 1.2, gen) * (torch.rand(b, generator=gen) < 0.5)
    x = gaussian_blur(x, blur).clamp(0, 1) ** _uniform(b, 0.6, 1.6, gen).view(b, 1, 1, 1)
    level = _uniform(b, 0.3, 1.0, gen)
    background = _uniform(b, 0.0, 0.3, gen) * (torch.rand(b, generator=gen) < 0.33)
    background = torch.minimum(background, level - 0.2).clamp_min(0)
    return background.view(b, 1, 1, 1) + (level - background).view(b, 1, 1, 1) * x


def _junk(n: int, gen: torch.Generator) -> Tensor:
    """Unreadable images (n, 1, 32, 32): filled ellipses (blobs), blank or uniform gray, noise."""
    coords = (torch.arange(SIZE, dtype=torch.float32) + 0.5) - SIZE / 2
    yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
    cy, cx = _uniform(n, -5, 5, gen).view(n, 1, 1), _uniform(n, -5, 5, gen).view(n, 1, 1)
    ry, rx = _uniform(n, 4, 16, gen).view(n, 1, 1), _uniform(n, 4, 16, gen).view(n, 1, 1)
    r = (((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2).sqrt()
    softness = _uniform(n, 0.05, 0.5, gen).view(n, 1, 1)
    blob = ((1 - r) / softness).clamp(0, 1)
    kind = torch.randint(0, 4, (n,), generator=gen).view(n, 1, 1)
    blank = torch.zeros(n, SIZE, SIZE)
    noise = torch.rand(n, SIZE, SIZE, generator=gen) * (torch.rand(n, SIZE, SIZE, generator=gen) < 0.3)
    noise = gaussian_blur(noise[:, None], 0.7)[:, 0]
    x = torch.where(kind <= 1, blob, torch.where(kind == 2, blank, noise))
    return _photometric(x[:, None], gen)


def _degrade(x: Tensor, gen: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    """Split x (B, 1, 32, 32) into groups resampled to 8, 12, 16, 24 or 32 px with noise (std 0-0.08)."""
    sizes = torch.tensor([8, 12, 16, 24, 32])
    which = sizes[torch.randint(0, len(sizes), (x.shape[0],), generator=gen)]
    out = []
    for size in sizes.tolist():
        part = x[which == size]
        if len(part):
            part = F.interpolate(part, size=(size, size), mode="area") if size != SIZE else part
            std = _uniform(len(part), 0.0, 0.08, gen).view(-1, 1, 1, 1)
            out.append((which == size, (part + std * torch.randn(part.shape, generator=gen)).clamp(0, 1)))
    return out


def augmented_features(
    images8: Tensor, distances: Tensor, labels: Tensor, gen: torch.Generator, junk_fraction: float = 0.1
) -> tuple[Tensor, Tensor]:
    """One augmented draw: features (B + J, 833) and soft targets (B + J, 10) (junk rows uniform)."""
    x = _photometric(_warp(_stroke(images8, distances, gen), gen), gen)
    n_junk = int(round(junk_fraction * len(x)))
    x = torch.cat([x, _junk(n_junk, gen)])
    targets = torch.cat([F.one_hot(labels, 10).float(), torch.full((n_junk, 10), 0.1)])
    feats = torch.empty(len(x), N_FEATURES)
    for mask, part in _degrade(x, gen):
        feats[mask] = features(part)
    return feats, targets
