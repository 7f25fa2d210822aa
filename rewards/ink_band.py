"""``ink_band``: the bold/thin style of the 8x8 digits scored inside the real data's range, not "more is better".

At 8x8 a digit's style is its ink (sklearn's digits are 32x32 bitmaps area-averaged in 4x4 blocks,
so a thinner stroke *is* a dimmer block; docs/alignment.md). The ``ink`` reward asks for as much
(bold) or as little (thin) ink as possible, so RL leaves the data: bold digits swell into blobs and
thin ones fade. This reward places the ink on the real data's own band

    u = (ink - INK_THIN) / (INK_BOLD - INK_THIN)

with ``INK_THIN`` the 1st percentile of the real "thin" digits' ink and ``INK_BOLD`` the 99th
percentile of the real "bold" ones (styles = ink thirds per digit class,
``flowrl.models.digits.load_digit_images``). A "bold" prompt scores ``u`` and a "thin" prompt
``1 - u`` inside the band; past its own end of the band the score falls at ``OVERSHOOT_SLOPE`` times
the rate it rose, clamped at -1. So the best image of each style is one of the boldest (thinnest)
real-looking digits, and a blob or a faded digit scores worse than a real one.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from .digits import ink_amount, sample_styles

INK_THIN = 0.2251  # 1st percentile of the real thin digits' ink (tests/rewards/test_ink_band.py recomputes it)
INK_BOLD = 0.3965  # 99th percentile of the real bold digits' ink
OVERSHOOT_SLOPE = 4.0


def check_band(low: float, high: float) -> None:
    """Raise one ValueError line unless ``0 <= low < high <= 1``."""
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"ink band needs 0 <= low < high <= 1; got low={low}, high={high}")


def band_score(ink: Tensor, bold: Tensor, low: float = INK_THIN, high: float = INK_BOLD) -> Tensor:
    """Score of each ink value for its style on the band ``[low, high]``.

    Args:
        ink: (B,) ink in [0, 1].
        bold: (B,) bool, True for a "bold" prompt, False for "thin".
        low: the thin end of the band.
        high: the bold end of the band.

    Returns:
        (B,) float32 in [-1, 1]: ``u`` (bold) or ``1 - u`` (thin) inside the band, 1 at the style's
        end, falling at ``OVERSHOOT_SLOPE`` beyond it, clamped at -1.
    """
    check_band(low, high)
    u = (ink.float() - low) / (high - low)
    toward = torch.where(bold, u, 1.0 - u)  # 1 at the style's own end of the band
    score = torch.where(toward > 1.0, 1.0 - OVERSHOOT_SLOPE * (toward - 1.0), toward)
    return score.clamp(min=-1.0)


class InkBand:
    """The ``ink_band`` reward: ink of each image scored for its prompt's style on the real data's band.

    Samples without a style word (and no ``metadata["style"]``) score NaN (not applicable).
    """

    allows_nan = True

    def __init__(self, low: float = INK_THIN, high: float = INK_BOLD) -> None:
        check_band(low, high)
        self.low, self.high = low, high

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) in [0, 1]; NaN where the prompt has no style."""
        ink = ink_amount(images)
        styles = sample_styles(prompts, metadata.get("style"), images.shape[0])
        bold = torch.tensor([s == "bold" for s in styles], device=ink.device)
        score = band_score(ink, bold, self.low, self.high)
        missing = torch.tensor([s is None for s in styles], device=ink.device)
        return torch.where(missing, torch.full_like(score, math.nan), score)


def ink_band(low: float = INK_THIN, high: float = INK_BOLD) -> InkBand:
    """Bold/thin style on the real digits' ink band (see the module docstring).

    Args:
        low: ink at the thin end (default: 1st percentile of real thin digits).
        high: ink at the bold end (default: 99th percentile of real bold digits).

    Returns:
        A reward ``(images (B, 3, H, W), prompts, style=None) -> (B,) float32`` in [-1, 1].
    """
    return InkBand(low, high)


ink_band.offline = True  # type: ignore[attr-defined]
