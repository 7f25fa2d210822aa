"""A small CNN that classifies 8x8 handwritten digits, trained on sklearn's ``load_digits``.

The shipped weights (``flowrl/assets/digit_classifier.safetensors``) back the
``digit_correctness`` reward. Regenerate them with::

    python -m flowrl.rewards.digit_classifier --out flowrl/assets/digit_classifier.safetensors

Training augments the 8x8 images so the classifier also recognises what a generator
produces: 1-pixel shifts, ink/intensity scaling, bolder (dilated) and thinner (eroded)
strokes, slight blur and gaussian noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .shipped import asset_path, load_shipped, save_shipped

WEIGHTS_FILENAME = "digit_classifier.safetensors"
REGENERATE_COMMAND = "python -m flowrl.rewards.digit_classifier --out flowrl/assets/digit_classifier.safetensors"
FORMAT = "flowrl.digit_classifier/1"


def default_weights_path() -> Path:
    """Path of the shipped classifier weights inside the installed ``flowrl`` package."""
    return asset_path(WEIGHTS_FILENAME)


class MaxPool2x2(nn.Module):
    """``nn.MaxPool2d(2)`` computed in channels-last memory order; the output is contiguous NCHW.

    A max selects one of its inputs, so the values are those of ``nn.MaxPool2d(2)`` bit for bit
    (tested, ties included), and the gradient goes to the same elements. torch's CPU kernel for
    contiguous NCHW maps is the slow one: on the classifier's (40, 32, 8, 8) maps it took 543 us
    against 97 us through channels-last, the two copies included (1 thread, 2026-11-26), which made
    pooling as dear as the convolutions in every ``digit_correctness`` call.
    """

    def forward(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, C, H // 2, W // 2)."""
        return F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2).contiguous()


class DigitClassifier(nn.Module):
    """Three-conv CNN for 8x8 grayscale digits (~40k parameters).

    Input (B, 1, 8, 8) in [0, 1] (white strokes on black); output logits (B, 10).
    """

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            MaxPool2x2(),  # 4x4
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            MaxPool2x2(),  # 2x2
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * width, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, 10) for images x (B, 1, 8, 8) in [0, 1]."""
        return self.head(self.features(x * 2.0 - 1.0))


def digits_split(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sklearn ``load_digits`` scaled to [0, 1] with a stratified 75/25 split.

    Args:
        seed: split seed (the shipped weights use 0, so ``digits_split(0)`` test images are unseen).

    Returns:
        ``(x_train (N, 1, 8, 8) float32, y_train (N,) int64, x_test (M, 1, 8, 8), y_test (M,))``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.25, stratify=data.target, random_state=seed
    )
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def dilate(x: Tensor) -> Tensor:
    """Grayscale dilation with a 3x3 box (bolder strokes), x (B, 1, H, W)."""
    return F.max_pool2d(x, 3, stride=1, padding=1)


def erode(x: Tensor) -> Tensor:
    """Grayscale erosion with a 3x3 box (thinner strokes), x (B, 1, H, W)."""
    return -F.max_pool2d(-x, 3, stride=1, padding=1)


def blur(x: Tensor) -> Tensor:
    """Light blur: 3x3 kernel with centre weight 4, edges 2 and corners 1 (sum 16), x (B, 1, H, W)."""
    k = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]], dtype=x.dtype, device=x.device) / 16
    return F.conv2d(F.pad(x, (1, 1, 1, 1)), k.view(1, 1, 3, 3))


def _shift(x: Tensor, generator: torch.Generator) -> Tensor:
    """Shift each image by -1, 0 or +1 pixel along each axis, filling with black."""
    b = x.shape[0]
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (b,), generator=generator)
    dx = torch.randint(0, 3, (b,), generator=generator)
    rows = (dy.view(b, 1) + torch.arange(x.shape[2])).view(b, 1, -1, 1).expand(b, 1, x.shape[2], padded.shape[3])
    out = padded.gather(2, rows)
    cols = (dx.view(b, 1) + torch.arange(x.shape[3])).view(b, 1, 1, -1).expand(b, 1, x.shape[2], x.shape[3])
    return out.gather(3, cols)


def augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """Randomly perturb a batch of digits like a generator might draw them.

    Per image: 1-pixel shift; with prob 0.35 dilation (mixed 50-100 %) and with prob 0.2
    erosion (mixed 30-70 %); with prob 0.3 blur; ink scaling by a factor in [0.5, 1.6] and a
    gamma in [0.6, 1.6]; gaussian noise with std in [0, 0.08]; clamp to [0, 1].

    Args:
        x: (B, 1, 8, 8) in [0, 1].
        generator: CPU generator driving every random choice (determinism).

    Returns:
        Augmented (B, 1, 8, 8) in [0, 1].
    """
    b = x.shape[0]

    def rand(lo: float, hi: float) -> Tensor:
        return (lo + (hi - lo) * torch.rand(b, generator=generator)).view(b, 1, 1, 1)

    def coin(p: float) -> Tensor:
        return (torch.rand(b, generator=generator) < p).float().view(b, 1, 1, 1)

    x = _shift(x, generator)
    x = x + coin(0.35) * rand(0.5, 1.0) * (dilate(x) - x)
    x = x + coin(0.2) * rand(0.3, 0.7) * (erode(x) - x)
    x = x + coin(0.3) * (blur(x) - x)
    x = (x * rand(0.5, 1.6)).clamp(0, 1) ** rand(0.6, 1.6)
    x = x + rand(0.0, 0.08) * torch.randn(x.shape, generator=generator)
    return x.clamp(0, 1)


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Fraction of images x (N, 1, 8, 8) whose argmax logit equals y (N,)."""
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def train_digit_classifier(
    seed: int = 0, epochs: int = 100, threads: int = 1, batch_size: int = 64, lr: float = 3e-3
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Train :class:`DigitClassifier` deterministically on augmented ``load_digits``.

    Args:
        seed: seed for the split, the initialisation and the augmentation.
        epochs: passes over the 1347 training images.
        threads: torch intra-op threads used while training (restored afterwards).
        batch_size: minibatch size.
        lr: peak AdamW learning rate (cosine decay to 0).

    Returns:
        ``(state_dict, report)``; the report holds held-out accuracy on clean images and on
        bold (half-dilated), fully dilated, thin (half-eroded) and faint (ink x 0.5) versions, plus timing.
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        x_train, y_train, x_test, y_test = digits_split(seed)
        torch.manual_seed(seed)
        model = DigitClassifier()
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
        steps_per_epoch = -(-len(y_train) // batch_size)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.1
        )
        for _ in range(epochs):
            model.train()
            order = torch.randperm(len(y_train), generator=generator)
            for i in range(0, len(order), batch_size):
                batch = order[i : i + batch_size]
                loss = F.cross_entropy(model(augment(x_train[batch], generator)), y_train[batch], label_smoothing=0.05)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
        seconds = time.perf_counter() - start
        report = {
            "seed": seed,
            "epochs": epochs,
            "n_train": len(y_train),
            "n_test": len(y_test),
            "train_accuracy": accuracy(model, x_train, y_train),
            "heldout_accuracy": accuracy(model, x_test, y_test),
            "heldout_accuracy_bold": accuracy(model, x_test + 0.5 * (dilate(x_test) - x_test), y_test),
            "heldout_accuracy_dilated": accuracy(model, dilate(x_test), y_test),
            "heldout_accuracy_thin": accuracy(model, x_test + 0.5 * (erode(x_test) - x_test), y_test),
            "heldout_accuracy_faint": accuracy(model, x_test * 0.5, y_test),
            "train_seconds": round(seconds, 2),
            "threads": threads,
        }
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        return state, report
    finally:
        torch.set_num_threads(previous_threads)


def load_digit_classifier(path: str | Path | None = None, device: str | torch.device = "cpu") -> DigitClassifier:
    """Load classifier weights saved with safetensors, frozen and in eval mode.

    Args:
        path: weights file; ``None`` means the shipped :func:`default_weights_path`.
        device: device to place the model on.

    Returns:
        The :class:`DigitClassifier` in eval mode with gradients disabled.

    Raises:
        FileNotFoundError: the file is missing (message gives the command that regenerates it).
        ValueError: the file is corrupt, not a digit classifier's, or does not match :class:`DigitClassifier`.
    """
    path = path if path is not None else default_weights_path()
    model = load_shipped(
        DigitClassifier(), path, fmt=FORMAT, what="digit classifier weights", regenerate=REGENERATE_COMMAND
    )
    return model.to(device)


def save_digit_classifier(state: dict[str, Tensor], path: str | Path, report: dict[str, Any] | None = None) -> Path:
    """Save a state dict with safetensors (report stored as string metadata); returns the path."""
    return save_shipped(state, path, FORMAT, report)


def main(argv: list[str] | None = None) -> None:
    """CLI: train the classifier, save the weights and print the report as JSON."""
    parser = argparse.ArgumentParser(description="Train the 8x8 digit classifier used by the digit_correctness reward.")
    parser.add_argument("--out", type=Path, default=default_weights_path(), help="output .safetensors path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    state, report = train_digit_classifier(seed=args.seed, epochs=args.epochs, threads=args.threads)
    path = save_digit_classifier(state, args.out, report)
    report["out"] = str(path)
    report["bytes"] = path.stat().st_size
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
