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

The fixed maths lives in :mod:`~flowrl.models.digits.reader_features`, the augmentation in
:mod:`~flowrl.models.digits.reader_augment` and the transformed test digits of the checks in
:mod:`~flowrl.models.digits.reader_checks`; this module holds the MLP, the public API, training
and the weights file.

Public API: :func:`read_digits`, :func:`reader_probabilities`, :func:`reader_accuracy`,
:func:`train_reader`. Regenerate the shipped weights with::

    python -m flowrl.models.digits.reader --out flowrl/assets/digit_reader.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from flowrl.rewards.shipped import asset_path, load_shipped, save_shipped, shipped_report

from .reader_augment import SKELETON_THRESHOLDS, augmented_features, skeleton_distances
from .reader_features import MIN_CONTRAST, N_FEATURES, NO_CONTRAST, contrast, features, to_gray

WEIGHTS_FILENAME = "digit_reader.safetensors"
REGENERATE_COMMAND = "python -m flowrl.models.digits.reader --out flowrl/assets/digit_reader.safetensors"
FORMAT = "flowrl.digit_reader/1"
HIDDEN = 256


def default_weights_path() -> Path:
    """Path of the shipped reader weights inside the installed ``flowrl`` package."""
    return asset_path(WEIGHTS_FILENAME)


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


def readings(probs: Tensor) -> Tensor:
    """The digit (B,) int64 read from :func:`reader_probabilities`; -1 (never a label) for a blank.

    An image with no contrast gets exactly uniform probabilities, whose argmax would be 0: a blank
    must read as no digit, not as a zero.
    """
    uniform = probs.amax(dim=1) == probs.amin(dim=1)
    return torch.where(uniform, torch.full_like(probs[:, 0], -1, dtype=torch.int64), probs.argmax(dim=1))


def read_digits(images: Tensor, weights: str | Path | None = None) -> Tensor:
    """The digit (B,) int64 the reader sees in each image (B, 3 or 1, H, W) in [0, 1]; -1 for a blank."""
    return readings(reader_probabilities(images, weights))


def reader_accuracy(images: Tensor, labels: Tensor | Sequence[int], weights: str | Path | None = None) -> float:
    """Fraction of images (B, 3 or 1, H, W) that the reader reads as their label (B,)."""
    labels = torch.as_tensor(labels, dtype=torch.int64).cpu()
    if labels.shape != (len(images),):
        raise ValueError(f"labels must be ({len(images)},) to match images; got {tuple(labels.shape)}")
    return float((read_digits(images, weights) == labels).float().mean())


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
            "train_indices_sha256": indices_digest(indices),
            "test_accuracy": float((test_pred == torch.as_tensor(test_labels)).float().mean()),
            "train_seconds": round(seconds, 1),
            "threads": threads,
        }
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        return state, report
    finally:
        torch.set_num_threads(previous_threads)


def indices_digest(indices: np.ndarray) -> str:
    """sha256 hex digest of int64 indices (N,): the fingerprint of a training part in the weights' header."""
    return hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()


def save_reader(state: dict[str, Tensor], path: str | Path, report: dict[str, Any]) -> Path:
    """Save the reader with safetensors; the report (training part, indices checksum) goes in the header."""
    return save_shipped(state, path, FORMAT, report)


def reader_report(path: str | Path | None = None) -> dict[str, Any]:
    """The training report stored in the weights' safetensors header."""
    return shipped_report(path or default_weights_path())


def load_reader(path: str | Path | None = None) -> ReaderHead:
    """Load the reader head from safetensors, frozen and in eval mode.

    Raises:
        FileNotFoundError: the file is missing (the message gives the command that regenerates it).
        ValueError: the file is corrupt, not a digit reader's, or does not match :class:`ReaderHead`.
    """
    path = path if path is not None else default_weights_path()
    return load_shipped(ReaderHead(), path, fmt=FORMAT, what="digit reader weights", regenerate=REGENERATE_COMMAND)


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
