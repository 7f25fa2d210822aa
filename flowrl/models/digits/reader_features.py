"""The independent digit reader's fixed maths: canonical form and oriented-gradient features.

Nothing here is learned. Any image (B, 3 or 1, H, W) becomes gray, 32x32, background-free,
contrast-stretched, centred and size-normalised (:func:`normalise`), then 833 numbers
(:func:`features`): histograms of oriented gradients (Dalal & Triggs, "Histograms of Oriented
Gradients for Human Detection", CVPR 2005) at two blur scales and a coarse ink map. The reader's
MLP (:mod:`flowrl.models.digits.reader`) reads those numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

SIZE = 32  # canonical side in pixels
ORIENTATIONS = 8  # unsigned gradient orientation bins over [0, pi)
INK_RADIUS = 7.0  # ink spread (radius of gyration, pixels) after normalisation
BLUR_SIGMAS = (1.0, 2.0)  # the two gradient scales
MIN_CONTRAST = 0.08  # a contrast below this is not stretched (blank images stay blank)
NO_CONTRAST = 0.02  # at or below this contrast the reader sees nothing: uniform probabilities


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
