"""Rewards for the embedded 8x8 digits model: digit correctness and ink (stroke weight).

Images are (B, 3, H, W) in [0, 1], white strokes on black. Both rewards work on the gray image
``gray = images.mean(dim=1)``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import check_images

_DIGIT_RE = re.compile(r"(?<![0-9A-Za-z_])([0-9])(?![0-9A-Za-z_])")
_STYLE_RE = re.compile(r"\b(bold|thin)\b", re.IGNORECASE)
INK_TARGETS = ("bold", "thin", "prompt")


def to_gray8(images: Tensor) -> Tensor:
    """Gray 8x8 version of a batch for the digit classifier.

    Args:
        images: (B, 3, H, W) in [0, 1].

    Returns:
        (B, 1, 8, 8) float32: channel mean, area-resized (adaptive average pool) when H, W != 8.
    """
    gray = images.float().mean(dim=1, keepdim=True)
    if gray.shape[-2:] != (8, 8):
        gray = F.adaptive_avg_pool2d(gray, (8, 8))
    return gray


def ink_amount(images: Tensor) -> Tensor:
    """Ink of each image: the mean intensity of its gray image.

    ``ink = mean_{h, w} (mean_c images[:, c, h, w])``, in [0, 1]: 0 is an all-black image, 1 all
    white. For the white-on-black digits, more or brighter stroke pixels mean more ink.

    Args:
        images: (B, 3, H, W) float in [0, 1].

    Returns:
        Ink (B,) float32.
    """
    check_images(images)
    return images.detach().float().mean(dim=(1, 2, 3))


def digit_from_prompt(prompt: str) -> int:
    """The last standalone digit 0-9 in a prompt (``"a bold handwritten 7"`` -> 7).

    Raises:
        ValueError: the prompt holds no standalone digit.
    """
    found = _DIGIT_RE.findall(prompt)
    if not found:
        raise ValueError(
            f"prompt {prompt!r} names no digit 0-9; write it like 'a handwritten 7' or pass metadata digit=[...]"
        )
    return int(found[-1])


def _target_digits(prompts: Sequence[str], digits: Any, batch_size: int) -> Tensor:
    """Per-sample target digits (B,) int64 from ``metadata["digit"]`` (None entries fall back to the prompt)."""
    if len(prompts) != batch_size:
        raise ValueError(f"got {len(prompts)} prompts for {batch_size} images; pass one prompt per image")
    if digits is None:
        return torch.tensor([digit_from_prompt(p) for p in prompts], dtype=torch.long)
    values = digits.tolist() if isinstance(digits, Tensor) else list(digits)
    if len(values) != batch_size:
        raise ValueError(f"metadata digit has {len(values)} entries for {batch_size} images; pass one digit per image")
    out = []
    for value, prompt in zip(values, prompts):
        if value is None:
            out.append(digit_from_prompt(prompt))
        elif isinstance(value, bool) or int(value) != value or not 0 <= int(value) <= 9:
            raise ValueError(
                f"metadata digit {value!r} for prompt {prompt!r} is not an integer 0-9; fix the prompt metadata"
            )
        else:
            out.append(int(value))
    return torch.tensor(out, dtype=torch.long)


class DigitCorrectness:
    """Probability, under the shipped CNN classifier, that each image shows its prompted digit.

    The target digit is ``metadata["digit"][i]`` when given (not None), else the last standalone
    0-9 in the prompt. Images are reduced with :func:`to_gray8`. Output (B,) float32 in [0, 1].
    """

    allows_nan = False

    def __init__(self, weights: str | Path | None = None, device: str | torch.device = "cpu") -> None:
        from .digit_classifier import load_digit_classifier

        self.device = torch.device(device)
        self.model = load_digit_classifier(weights, device=self.device)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) in [0, 1]."""
        check_images(images)
        target = _target_digits(prompts, metadata.get("digit"), images.shape[0]).to(self.device)
        probs = self.model(to_gray8(images).to(self.device)).float().softmax(dim=-1)
        return probs.gather(1, target[:, None])[:, 0].to(images.device)


def digit_correctness(weights: str | None = None, device: str = "cpu") -> DigitCorrectness:
    """Probability that the image shows the prompted digit, from the bundled 8x8 CNN classifier.

    Args:
        weights: safetensors file of a :class:`~flowrl.rewards.digit_classifier.DigitClassifier`;
            None uses the shipped ``flowrl/assets/digit_classifier.safetensors``.
        device: where the classifier runs.

    Returns:
        A reward ``(images (B, 3, H, W), prompts, digit=None) -> (B,) float32`` in [0, 1].
    """
    return DigitCorrectness(weights, device)


digit_correctness.offline = True  # type: ignore[attr-defined]


def prompt_style(prompt: str) -> str | None:
    """The style word of a prompt: "bold", "thin" or None (case-insensitive, whole words).

    Raises:
        ValueError: the prompt asks for both bold and thin.
    """
    styles = {m.lower() for m in _STYLE_RE.findall(prompt)}
    if len(styles) > 1:
        raise ValueError(f"prompt {prompt!r} asks for both bold and thin; keep one style word per prompt")
    return styles.pop() if styles else None


def sample_styles(prompts: Sequence[str], styles: Any, batch_size: int) -> list[str | None]:
    """Per-sample style: ``metadata["style"][i]`` when given and not None, else the prompt's style word.

    Returns:
        B entries, each "bold", "thin" or None.

    Raises:
        ValueError: counts disagree or a style is not "bold", "thin" or None.
    """
    if len(prompts) != batch_size:
        raise ValueError(f"got {len(prompts)} prompts for {batch_size} images; pass one prompt per image")
    given = [None] * batch_size if styles is None else list(styles)
    if len(given) != batch_size:
        raise ValueError(f"metadata style has {len(given)} entries for {batch_size} images; pass one per image")
    out = []
    for style, prompt in zip(given, prompts):
        style = prompt_style(prompt) if style is None else str(style).lower()
        if style not in (None, "bold", "thin"):
            raise ValueError(f"metadata style {style!r} for prompt {prompt!r} must be 'bold', 'thin' or None")
        out.append(style)
    return out


class Ink:
    """Stroke-weight reward from :func:`ink_amount` (ink in [0, 1]).

    - ``target="bold"``: ``r = ink``.
    - ``target="thin"``: ``r = 1 - ink`` (complement, so both targets lie in [0, 1]).
    - ``target="prompt"``: per sample, the style word of its prompt (or ``metadata["style"][i]`` when
      given and not None) picks ``ink`` ("bold") or ``1 - ink`` ("thin"); samples with neither word
      get NaN ("not applicable"), so this target sets ``allows_nan = True``.
    """

    def __init__(self, target: str = "prompt") -> None:
        if target not in INK_TARGETS:
            raise ValueError(f"ink target must be one of {INK_TARGETS}; got {target!r}")
        self.target = target
        self.allows_nan = target == "prompt"

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for images (B, 3, H, W) in [0, 1]; NaN where not applicable."""
        ink = ink_amount(images)
        if self.target == "bold":
            return ink
        if self.target == "thin":
            return 1.0 - ink
        styles = sample_styles(prompts, metadata.get("style"), images.shape[0])
        sign = torch.tensor([{"bold": 1.0, "thin": -1.0}.get(s, math.nan) for s in styles], device=ink.device)
        return torch.where(sign > 0, ink, torch.where(sign < 0, 1.0 - ink, sign)).float()


def ink(target: str = "prompt") -> Ink:
    """Stroke weight: ink (mean gray intensity) for "bold", 1 - ink for "thin", or per the prompt's style word.

    Args:
        target: "bold" (``r = ink``), "thin" (``r = 1 - ink``) or "prompt" (each prompt's "bold"/"thin"
            word picks one of the two; style-less prompts score NaN = not applicable).

    Returns:
        A reward ``(images (B, 3, H, W), prompts, style=None) -> (B,) float32``.
    """
    return Ink(target)


ink.offline = True  # type: ignore[attr-defined]
