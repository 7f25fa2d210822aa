"""Base class of the neural reward models: the call contract, chunking and gradient handling.

A subclass implements :meth:`ModelReward.score`, a differentiable map from images (B, 3, H, W) in
[0, 1] and B prompts to (B,) scores. Calling the reward checks the inputs, scores in chunks of
``batch_size`` under ``torch.no_grad()`` and returns float32 scores on the images' device, as the
reward contract asks. Gradient-based uses (reward backpropagation, ReFL-style) call ``score`` directly.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .contract import check_images


def check_batch_size(batch_size: object) -> int:
    """A positive int chunk size, else ValueError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"reward batch_size must be a positive integer; got {batch_size!r}")
    return batch_size


class ModelReward:
    """A reward backed by a neural network (subclasses set ``name`` and implement :meth:`score`).

    Attributes:
        name: reward name used in error messages.
        device: where the network runs.
        dtype: the network's parameter dtype (scores are always returned in float32).
        batch_size: images per forward pass.
    """

    name = "model_reward"
    allows_nan = False

    def __init__(self, device: str | torch.device, dtype: torch.dtype, batch_size: int) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = check_batch_size(batch_size)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Differentiable scores (B,) for images (B, 3, H, W) in [0, 1] and B prompts."""
        raise NotImplementedError

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 on the images' device, computed without gradients."""
        check_images(images)
        prompts = list(prompts)
        if len(prompts) != images.shape[0]:
            raise ValueError(
                f"{self.name}: got {len(prompts)} prompts for {images.shape[0]} images; pass one prompt per image"
            )
        if any(not isinstance(p, str) for p in prompts):
            raise TypeError(f"{self.name}: prompts must be strings; got {[type(p).__name__ for p in prompts]}")
        with torch.no_grad():
            parts = [
                self.score(images[i : i + self.batch_size], prompts[i : i + self.batch_size]).float()
                for i in range(0, images.shape[0], self.batch_size)
            ]
        return (torch.cat(parts) if parts else torch.zeros(0)).to(images.device)
