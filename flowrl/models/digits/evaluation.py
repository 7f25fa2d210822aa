"""Independent evaluation of flowrl-digits: an sklearn SVC on real digits, and sampling helpers.

The SVC (rbf, gamma 0.001, C 10) is fit on a stratified 75% of scikit-learn's real 8x8 digits and
scores about 99% on the held-out 25%. It shares nothing with the RL reward models, so it is the
honest yardstick for the base model's accuracy.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from .model import MAX_SEQUENCE_LENGTH, RESOLUTION, STYLES, digits_prompt, load_digit_images


@lru_cache(maxsize=1)
def fit_reference_classifier() -> Any:
    """The reference SVC, fit on a stratified 75% of the real digits (features on the 0..16 scale).

    Returns:
        A fitted ``sklearn.svm.SVC`` (cached: the same object on every call).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    data = load_digits()
    x_train, _, y_train, _ = train_test_split(
        data.data, data.target, train_size=0.75, stratify=data.target, random_state=0
    )
    return SVC(kernel="rbf", gamma=0.001, C=10.0).fit(x_train, y_train)


def _check_images(images: Tensor) -> None:
    if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[2:]) != (RESOLUTION, RESOLUTION):
        raise ValueError(f"images must be (B, 3, {RESOLUTION}, {RESOLUTION}); got {tuple(images.shape)}")


def classify_digits(images: Tensor) -> Tensor:
    """Predict the digit shown in each image with the reference SVC.

    Args:
        images: (B, 3, 8, 8) in [0, 1], white ink on black.

    Returns:
        (B,) int64 predicted digits.
    """
    _check_images(images)
    features = (images.detach().float().cpu().mean(dim=1) * 16.0).reshape(len(images), -1).numpy()
    return torch.as_tensor(fit_reference_classifier().predict(features), dtype=torch.int64)


def digit_accuracy(images: Tensor, labels: Tensor | Sequence[int]) -> float:
    """Fraction of images the reference SVC reads as their label.

    Args:
        images: (B, 3, 8, 8) in [0, 1].
        labels: (B,) target digits.
    """
    labels = torch.as_tensor(labels, dtype=torch.int64).cpu()
    if labels.shape != (len(images),):
        raise ValueError(f"labels must be ({len(images)},) to match images; got {tuple(labels.shape)}")
    return float((classify_digits(images) == labels).float().mean())


def class_diversity(images: Tensor, labels: Tensor) -> float:
    """Mean within-class pairwise L2 distance on the SVC's 0..16 gray scale (real digits: about 35.7).

    Args:
        images: (B, 3, 8, 8) in [0, 1].
        labels: (B,) digits.
    """
    features = images.detach().float().cpu().mean(dim=1).reshape(len(images), -1) * 16.0
    labels = torch.as_tensor(labels).cpu()
    means = []
    for digit in labels.unique().tolist():
        group = features[labels == digit]
        if len(group) > 1:
            dist = torch.cdist(group, group)
            means.append(dist.sum() / (len(group) * (len(group) - 1)))
    if not means:
        raise ValueError("class_diversity needs at least two images of one class")
    return float(torch.stack(means).mean())


def ink(images: Tensor) -> Tensor:
    """Ink amount per image: mean intensity. (B, 3, H, W) -> (B,)."""
    return images.detach().float().mean(dim=(1, 2, 3))


@torch.no_grad()
def sample_digits_with_pipeline(
    pipe: Any, prompts: Sequence[str], seeds: Sequence[int], steps: int = 10, batch_size: int = 256
) -> Tensor:
    """Sample with the real diffusers pipeline: Euler ODE, no CFG, one generator per seed.

    Args:
        pipe: a flowrl-digits ``StableDiffusion3Pipeline``.
        prompts: B prompts.
        seeds: B integer seeds (sample i depends only on prompts[i] and seeds[i]).
        steps: Euler steps.
        batch_size: prompts per pipeline call.

    Returns:
        (B, 3, 8, 8) float32 images in [0, 1].
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"need one seed per prompt; got {len(prompts)} prompts and {len(seeds)} seeds")
    chunks = []
    for start in range(0, len(prompts), batch_size):
        gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds[start : start + batch_size]]
        out = pipe(
            prompt=list(prompts[start : start + batch_size]),
            height=RESOLUTION,
            width=RESOLUTION,
            num_inference_steps=steps,
            guidance_scale=1.0,
            output_type="pt",
            generator=gens,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        ).images
        chunks.append(out.float().cpu())
    return torch.cat(chunks)


def evaluate_base_model(pipe: Any, per_class: int = 50, steps: int = 10, seed: int = 0) -> dict[str, Any]:
    """Accuracy and ink of a flowrl-digits pipeline under the reference SVC (no CFG).

    Plain, bold and thin prompts use the same seeds, so their ink difference is a paired
    comparison.

    Args:
        pipe: a flowrl-digits ``StableDiffusion3Pipeline``.
        per_class: samples per digit and prompt kind.
        steps: Euler steps.
        seed: first sample seed.

    Returns:
        ``{"accuracy", "per_class": {"0": acc, ...}, "accuracy_bold", "accuracy_thin", "ink_plain",
        "ink_bold", "ink_thin", "diversity", "data_diversity", "data_ink": {"plain", "bold", "thin"},
        "samples", "steps", "seconds"}``. Diversity is :func:`class_diversity` of the plain samples.
    """
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1; got {per_class}")
    labels = torch.arange(10).repeat_interleave(per_class)
    seeds = [seed + i for i in range(len(labels))]
    start = time.perf_counter()
    report: dict[str, Any] = {"samples": 3 * len(labels), "steps": steps}
    for style in (None, *STYLES):
        prompts = [digits_prompt(int(d), style) for d in labels]
        images = sample_digits_with_pipeline(pipe, prompts, seeds, steps=steps)
        correct = (classify_digits(images) == labels).float()
        name = style or "plain"
        report[f"ink_{name}"] = float(ink(images).mean())
        if style is None:
            report["accuracy"] = float(correct.mean())
            report["per_class"] = {str(d): float(correct[labels == d].mean()) for d in range(10)}
            report["diversity"] = class_diversity(images, labels)
        else:
            report[f"accuracy_{style}"] = float(correct.mean())
    report["seconds"] = time.perf_counter() - start
    real, real_labels, styles = load_digit_images()
    report["data_diversity"] = class_diversity(real, real_labels)
    real_ink = ink(real)
    report["data_ink"] = {"plain": float(real_ink.mean())} | {
        s: float(real_ink[[i for i, t in enumerate(styles) if t == s]].mean()) for s in STYLES
    }
    return report


def save_digit_grid(images: Tensor, path: str | Path, rows: int, scale: int = 8) -> Path:
    """Write images as a PNG grid (row-major), nearest-upscaled so 8x8 digits are visible.

    Args:
        images: (rows * cols, 3, H, W) in [0, 1].
        path: output .png file.
        rows: grid rows.
        scale: integer upscale factor.
    """
    from PIL import Image

    if len(images) % rows:
        raise ValueError(f"{len(images)} images do not fill {rows} rows; pass a multiple of rows")
    cols = len(images) // rows
    _, c, h, w = images.shape
    pad = 1
    grid = torch.full((c, rows * (h + pad) + pad, cols * (w + pad) + pad), 0.35)
    for k, img in enumerate(images.detach().float().cpu().clamp(0, 1)):
        r, q = divmod(k, cols)
        grid[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = img
    array = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    picture = Image.fromarray(array).resize((array.shape[1] * scale, array.shape[0] * scale), Image.NEAREST)
    path = Path(path)
    picture.save(path)
    return path
