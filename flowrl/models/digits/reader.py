"""An independent reader for the embedded digits task: oriented-gradient features and an MLP head.

The ``digit_correctness`` reward is a 3-conv CNN trained on the ``reward`` part of the real digits
(:mod:`flowrl.rewards.digit_data`). This reader shares none of it, so it does not share its
blind spots:

- **Data**: it trains only on the ``reader`` part (35 % of the 1,797 digits); the ``test`` part
  (15 %) is held out from both.
- **Family**: no learned convolutions. Every image is brought to one canonical form by fixed
  maths (gray, resampled to 32x32, background removed, contrast stretched, ink centre of mass
  centred and ink spread scaled to a fixed radius), then described by histograms of oriented
  gradients (Dalal & Triggs, 2005) at two blur scales plus a coarse ink map, and a small MLP
  reads those 833 numbers.
- **Augmentation** at 32x32 before resampling to 8..32 pixels: stroke width (each digit is
  thinned to its skeleton, Zhang & Suen 1984, and re-rendered at widths 1..8 px from the
  skeleton's distance transform, or its own gray image is eroded or dilated), ink level and
  gray backgrounds, affine warps (rotation +-15 degrees, scale, shear, shift), elastic
  deformation (Simard et al., 2003), blur and noise. Blobs, blank and noise images are trained
  towards the uniform distribution, so an unreadable image is not read with confidence.

Public API: :func:`read_digits`, :func:`reader_probabilities`, :func:`reader_accuracy`,
:func:`train_reader`. Regenerate the shipped weights with::

    python -m flowrl.models.digits.reader --out flowrl/assets/digit_reader.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHTS_FILENAME = "digit_reader.safetensors"
REGENERATE_COMMAND = "python -m flowrl.models.digits.reader --out flowrl/assets/digit_reader.safetensors"
FORMAT = "flowrl.digit_reader/1"
SIZE = 32  # canonical side in pixels
ORIENTATIONS = 8  # unsigned gradient orientation bins over [0, pi)
INK_RADIUS = 7.0  # ink spread (radius of gyration, pixels) after normalisation
BLUR_SIGMAS = (1.0, 2.0)  # the two gradient scales
MIN_CONTRAST = 0.08  # a contrast below this is not stretched (blank images stay blank)
NO_CONTRAST = 0.02  # at or below this contrast the reader sees nothing: uniform probabilities
HIDDEN = 256
SKELETON_THRESHOLDS = (0.2, 0.35, 0.55)  # training skeletons: three ways to binarise each digit


def default_weights_path() -> Path:
    """Path of the shipped reader weights inside the installed ``flowrl`` package."""
    return Path(__file__).resolve().parents[2] / "assets" / WEIGHTS_FILENAME


# --------------------------------------------------------------------------------------------
# canonical form and features (fixed maths, no learned parameters)


def to_gray(images: Tensor) -> Tensor:
    """Gray (B, 1, H, W) float32 on the CPU from images (B, 3, H, W) or (B, 1, H, W) in [0, 1].

    Values outside [0, 1] are clipped.

    Raises:
        TypeError: images is not a tensor.
        ValueError: the shape is not (B, 3 or 1, H, W) with B >= 1 and H, W >= 4, or a value is
            NaN or inf.
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a torch.Tensor (B, 3, H, W); got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1] not in (1, 3) or min(images.shape[2:]) < 4:
        raise ValueError(
            f"images must be (B, 3, H, W) or (B, 1, H, W) with H, W >= 4, white ink on black; got {tuple(images.shape)}"
        )
    if images.shape[0] == 0:
        raise ValueError("images is an empty batch (0, C, H, W); pass at least one image")
    gray = images.detach().float().cpu().mean(dim=1, keepdim=True)
    if not torch.isfinite(gray).all():
        raise ValueError("images contain NaN or inf; decode or clamp them to [0, 1] first")
    return gray.clamp(0, 1)


def resample(gray: Tensor, size: int = SIZE) -> Tensor:
    """Resample (B, 1, H, W) to (B, 1, size, size): area average when shrinking, bilinear when enlarging."""
    if gray.shape[-2:] == (size, size):
        return gray
    if gray.shape[-2] >= size and gray.shape[-1] >= size:
        return F.interpolate(gray, size=(size, size), mode="area")
    return F.interpolate(gray, size=(size, size), mode="bilinear", align_corners=False)


def gaussian_blur(x: Tensor, sigma: float | Tensor) -> Tensor:
    """Separable Gaussian blur of x (B, 1, H, W); sigma a float or (B,) per image (0 = no blur)."""
    b = x.shape[0]
    sig = torch.as_tensor(sigma, dtype=x.dtype).expand(b).clamp_min(1e-3)
    radius = max(1, int(math.ceil(3 * float(sig.max()))))
    taps = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel = torch.exp(-0.5 * (taps[None] / sig[:, None]) ** 2)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)  # (B, K)
    k = kernel.shape[1]
    # grouped conv: one kernel per image
    y = F.conv2d(F.pad(x.transpose(0, 1), (radius, radius, 0, 0), mode="replicate"), kernel.view(b, 1, 1, k), groups=b)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="replicate"), kernel.view(b, 1, k, 1), groups=b)
    return y.transpose(0, 1)


def contrast(gray: Tensor) -> Tensor:
    """Ink contrast (B,) of gray images (B, 1, H, W).

    At 32x32: the brightest 2x2 block mean minus the darkest 4x4 block mean (the background).
    """
    x = resample(gray)
    return F.avg_pool2d(x, 2).amax(dim=(1, 2, 3)) - F.avg_pool2d(x, 4).amin(dim=(1, 2, 3))


def normalise(gray: Tensor) -> Tensor:
    """The canonical form: (B, 1, H, W) in [0, 1] -> (B, 1, 32, 32).

    Resample to 32x32; subtract the background (the darkest 4x4 block mean); divide by the ink
    level (the brightest 2x2 block mean above background), but never by less than
    ``MIN_CONTRAST``, so a blank image stays blank; then an affine resample that moves the ink's
    centre of mass to the centre and scales its radius of gyration to ``INK_RADIUS`` pixels (scale
    factor clipped to [0.6, 2.5]).
    """
    x = resample(gray)
    b = x.shape[0]
    background = F.avg_pool2d(x, 4).amin(dim=(1, 2, 3))
    level = contrast(x).clamp_min(MIN_CONTRAST)
    x = ((x - background.view(b, 1, 1, 1)) / level.view(b, 1, 1, 1)).clamp(0, 1)
    coords = (torch.arange(SIZE, dtype=x.dtype) + 0.5) / SIZE * 2 - 1  # pixel centres in [-1, 1]
    mass = x.sum(dim=(1, 2, 3)).clamp_min(1e-6)
    cy = (x.sum(dim=3)[:, 0] * coords).sum(dim=1) / mass
    cx = (x.sum(dim=2)[:, 0] * coords).sum(dim=1) / mass
    spread = x[:, 0] * (
        (coords.view(1, -1, 1) - cy.view(b, 1, 1)) ** 2 + (coords.view(1, 1, -1) - cx.view(b, 1, 1)) ** 2
    )
    radius = (spread.sum(dim=(1, 2)) / mass).sqrt() * SIZE / 2
    empty = x.sum(dim=(1, 2, 3)) < 1.0
    scale = (radius / INK_RADIUS).clamp(1 / 2.5, 1 / 0.6)  # sampling step: >1 shrinks the ink
    scale = torch.where(empty, torch.ones_like(scale), scale)
    cx = torch.where(empty, torch.zeros_like(cx), cx)
    cy = torch.where(empty, torch.zeros_like(cy), cy)
    theta = torch.zeros(b, 2, 3, dtype=x.dtype)
    theta[:, 0, 0] = scale
    theta[:, 1, 1] = scale
    theta[:, 0, 2] = cx
    theta[:, 1, 2] = cy
    grid = F.affine_grid(theta, [b, 1, SIZE, SIZE], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _cells(x: Tensor) -> Tensor:
    """Sums over overlapping cells: (B, C, 16, 16) -> (B, C, 7, 7), cells of 4x4 at stride 2."""
    b, c = x.shape[:2]
    blocks = x.view(b, c, 8, 2, 8, 2).sum(dim=(3, 5))
    return blocks[:, :, :-1, :-1] + blocks[:, :, 1:, :-1] + blocks[:, :, :-1, 1:] + blocks[:, :, 1:, 1:]


def _oriented_gradients(x: Tensor, sigma: float) -> Tensor:
    """HOG-like cells of x (B, 1, 32, 32): (B, ORIENTATIONS * 7 * 7), power- and L2-normalised.

    After a Gaussian blur the image is area-halved to 16x16 and differentiated with central
    differences. The gradient is written as its double-angle vector
    ``m (cos 2t, sin 2t) = ((gx^2 - gy^2) / m, 2 gx gy / m)``, so opposite directions agree (unsigned
    orientation); its response to orientation bin k is ``relu(<that vector, (cos 2p_k, sin 2p_k)>)``,
    a soft bin. Responses are summed over 4x4 cells at stride 2 (7x7 cells of the 16x16 image).
    """
    g = F.avg_pool2d(gaussian_blur(x, sigma), 2)
    p = F.pad(g, (1, 1, 1, 1), mode="replicate")
    gx = (p[:, :, 1:-1, 2:] - p[:, :, 1:-1, :-2]) / 2
    gy = (p[:, :, 2:, 1:-1] - p[:, :, :-2, 1:-1]) / 2
    magnitude = (gx**2 + gy**2 + 1e-12).sqrt()
    c, s = (gx**2 - gy**2) / magnitude, 2 * gx * gy / magnitude
    phase = 2 * math.pi * torch.arange(ORIENTATIONS, dtype=x.dtype) / ORIENTATIONS
    response = F.relu(c * phase.cos().view(1, -1, 1, 1) + s * phase.sin().view(1, -1, 1, 1))  # (B, O, 16, 16)
    hist = _cells(response).flatten(1).sqrt()
    return hist / (hist.norm(dim=1, keepdim=True) + 0.05)


def features(gray: Tensor) -> Tensor:
    """Reader features (B, 833) of gray images (B, 1, H, W) in [0, 1].

    The canonical form (:func:`normalise`), then two oriented-gradient maps (blur sigma 1 and 2 px,
    8 x 7 x 7 each) and a 7x7 ink map.
    """
    x = normalise(gray)
    ink = _cells(F.avg_pool2d(x, 2)).flatten(1) / 16
    return torch.cat([_oriented_gradients(x, s) for s in BLUR_SIGMAS] + [ink], dim=1)


N_FEATURES = 2 * ORIENTATIONS * 49 + 49


class ReaderHead(nn.Module):
    """MLP on the reader features: standardise, Linear(833, 256) -> GELU -> Linear(256, 10)."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(N_FEATURES))
        self.register_buffer("std", torch.ones(N_FEATURES))
        self.net = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.GELU(), nn.Dropout(0.2), nn.Linear(hidden, 10))

    def forward(self, feats: Tensor) -> Tensor:
        """Logits (B, 10) for features (B, 833)."""
        return self.net((feats - self.mean) / self.std)


# --------------------------------------------------------------------------------------------
# public API


@lru_cache(maxsize=4)
def _cached_reader(path: str) -> ReaderHead:
    return load_reader(path)


def reader_probabilities(images: Tensor, weights: str | Path | None = None) -> Tensor:
    """Class probabilities (B, 10) float32 of the reader for images (B, 3 or 1, H, W) in [0, 1].

    Any H, W works (they are resampled to 32x32). White ink on black. Computed on the CPU.
    An unreadable image (a blob, noise) gets a flat distribution from the model; an image with no
    contrast (:func:`contrast` at most ``NO_CONTRAST``: blank, uniform) gets exactly uniform
    probabilities, blended linearly into the model's up to ``MIN_CONTRAST``.
    """
    gray = to_gray(images)
    model = _cached_reader(str(weights or default_weights_path()))
    with torch.no_grad():
        probs = model(features(gray)).softmax(dim=-1)
    legible = ((contrast(gray) - NO_CONTRAST) / (MIN_CONTRAST - NO_CONTRAST)).clamp(0, 1)[:, None]
    return legible * probs + (1 - legible) * 0.1


def read_digits(images: Tensor, weights: str | Path | None = None) -> Tensor:
    """The digit (B,) int64 the reader sees in each image (B, 3 or 1, H, W) in [0, 1]."""
    return reader_probabilities(images, weights).argmax(dim=1)


def reader_accuracy(images: Tensor, labels: Tensor | Sequence[int], weights: str | Path | None = None) -> float:
    """Fraction of images (B, 3 or 1, H, W) that the reader reads as their label (B,)."""
    labels = torch.as_tensor(labels, dtype=torch.int64).cpu()
    if labels.shape != (len(images),):
        raise ValueError(f"labels must be ({len(images)},) to match images; got {tuple(labels.shape)}")
    return float((read_digits(images, weights) == labels).float().mean())


# --------------------------------------------------------------------------------------------
# stroke-width augmentation: skeleton and distance transform


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


# --------------------------------------------------------------------------------------------
# transformed real digits: the checks (tests, bench/reader.py), not the training augmentation


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


# --------------------------------------------------------------------------------------------
# training, saving, loading


def _soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    return -(targets * logits.log_softmax(dim=-1)).sum(dim=-1).mean()


def train_reader(
    seed: int = 0,
    epochs: int = 20,
    copies: int = 8,
    batch_size: int = 256,
    lr: float = 2e-3,
    threads: int = 1,
    smoothing: float = 0.05,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Train the reader head deterministically on the ``reader`` part only.

    Every epoch draws ``copies`` fresh augmentations of each of the 629 reader digits (plus 10 %
    junk images with uniform targets), computes their features and takes AdamW steps on them.

    Args:
        seed: seed of the initialisation and of every augmentation draw.
        epochs: fresh augmented draws.
        copies: augmentations of each digit per epoch.
        batch_size: minibatch size.
        lr: peak AdamW learning rate (one-cycle schedule).
        threads: torch intra-op threads while training (restored afterwards).
        smoothing: label smoothing of the digit targets.

    Returns:
        ``(state_dict, report)``; the report holds the training indices' checksum, accuracy on the
        held-out ``test`` part and timing.
    """
    from flowrl.rewards.digit_data import digit_part

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        indices, images, labels = digit_part("reader")
        images8 = torch.as_tensor(images)
        labels_t = torch.as_tensor(labels)
        distances = torch.stack([skeleton_distances(images, t) for t in SKELETON_THRESHOLDS], dim=1)
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        model = ReaderHead()
        rep = torch.arange(len(labels_t)).repeat(copies)
        first, _ = augmented_features(images8[rep], distances[rep], labels_t[rep], gen)
        model.mean.copy_(first.mean(dim=0))
        model.std.copy_(first.std(dim=0).clamp_min(1e-3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        n_rows = len(first)
        steps_per_epoch = -(-n_rows // batch_size)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.1
        )
        for _ in range(epochs):
            feats, targets = augmented_features(images8[rep], distances[rep], labels_t[rep], gen)
            targets = targets * (1 - smoothing) + smoothing / 10
            model.train()
            order = torch.randperm(len(feats), generator=gen)
            for i in range(0, len(order), batch_size):
                batch = order[i : i + batch_size]
                loss = _soft_cross_entropy(model(feats[batch]), targets[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
        model.eval()
        seconds = time.perf_counter() - start
        _, test_images, test_labels = digit_part("test")
        with torch.no_grad():
            test_pred = model(features(torch.as_tensor(test_images)[:, None])).argmax(dim=1)
        report = {
            "seed": seed,
            "epochs": epochs,
            "copies": copies,
            "n_train": len(labels),
            "train_part": "reader",
            "train_indices_sha256": _indices_digest(indices),
            "test_accuracy": float((test_pred == torch.as_tensor(test_labels)).float().mean()),
            "train_seconds": round(seconds, 1),
            "threads": threads,
        }
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        return state, report
    finally:
        torch.set_num_threads(previous_threads)


def _indices_digest(indices: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()


def save_reader(state: dict[str, Tensor], path: str | Path, report: dict[str, Any]) -> Path:
    """Save the reader with safetensors; the report (training part, indices checksum) goes in the header."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"format": FORMAT, "report": json.dumps(report, sort_keys=True)})
    return path


def reader_report(path: str | Path | None = None) -> dict[str, Any]:
    """The training report stored in the weights' safetensors header."""
    from safetensors import safe_open

    with safe_open(str(path or default_weights_path()), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("report", "{}"))


def load_reader(path: str | Path | None = None) -> ReaderHead:
    """Load the reader head from safetensors, in eval mode.

    Raises:
        FileNotFoundError: the file is missing (the message gives the command that regenerates it).
        ValueError: the file is not a valid safetensors file of this reader.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path) if path is not None else default_weights_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"digit reader weights not found at {path}; regenerate them with `{REGENERATE_COMMAND}`"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            fmt = (f.metadata() or {}).get("format")
        state = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - safetensors raises several error types for corrupt files
        raise ValueError(
            f"digit reader weights at {path} are corrupt ({type(err).__name__}); regenerate them with "
            f"`{REGENERATE_COMMAND}`"
        ) from err
    if fmt != FORMAT:
        raise ValueError(
            f"{path} is not a digit reader ({FORMAT}; got {fmt!r}); regenerate it with `{REGENERATE_COMMAND}`"
        )
    model = ReaderHead()
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"digit reader weights at {path} do not match ReaderHead; regenerate them with `{REGENERATE_COMMAND}`"
        ) from err
    model.requires_grad_(False)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    """CLI: train the reader, save the weights and print the report as JSON."""
    parser = argparse.ArgumentParser(description="Train the independent digit reader (reader part of the real digits).")
    parser.add_argument("--out", type=Path, default=default_weights_path(), help="output .safetensors path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    state, report = train_reader(seed=args.seed, epochs=args.epochs, copies=args.copies, threads=args.threads)
    path = save_reader(state, args.out, report)
    print(json.dumps(report | {"out": str(path), "bytes": path.stat().st_size}, indent=2))


if __name__ == "__main__":
    main()
