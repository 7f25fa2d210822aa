"""The objective contract: the algorithm-specific part of the one training loop.

The loop (``flowrl.trainer``) samples, scores and computes advantages; an objective says which
micro-batches make up each optimizer step (``plan``) and what the loss of one micro-batch is
(``loss``). Flow-GRPO trains on stored SDE transitions; forward-process objectives (DiffusionNFT,
AWM) can plug in by planning over clean samples instead.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ..models.adapter import Cond, ModelAdapter
from ..samplers.rollout import Trajectory


class RolloutBatch(NamedTuple):
    """Everything one iteration collected.

    Attributes:
        prompts: B prompt strings.
        group_ids: (B,) prompt-group index per sample.
        cond: conditioning for the B samples.
        trajectory: latents (B, T + 1, ...) and log_probs (B, T).
        images: (B, 3, H, W) decoded final samples in [0, 1].
        rewards: (B,) combined reward.
        advantages: (B,) float32.
        keep: (B,) bool, False for samples of zero-variance groups.
        chunk_size: the rollout micro-batch size; training reuses the same chunks so the
            forward pass sees the same batch geometry as sampling (ratio exactly 1).
    """

    prompts: list[str]
    group_ids: Tensor
    cond: Cond
    trajectory: Trajectory
    images: Tensor
    rewards: Tensor
    advantages: Tensor
    keep: Tensor
    chunk_size: int


class Microbatch(NamedTuple):
    """Sample indices (b,) and the trajectory step to train (or -1 for step-free objectives)."""

    index: Tensor
    step: int


class Objective(Protocol):
    """An RL objective plugged into the training loop."""

    name: str

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Micro-batches grouped per optimizer step, in the order they run."""

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss of one micro-batch and detached stats for logging."""


def chunk_indices(batch_size: int, chunk_size: int) -> list[Tensor]:
    """Consecutive index chunks of the rollout batch: [0..c), [c..2c), ..."""
    return [torch.arange(i, min(i + chunk_size, batch_size)) for i in range(0, batch_size, chunk_size)]


def split_even(items: list, parts: int) -> list[list]:
    """Split a list into ``parts`` consecutive groups of near-equal size (no empty group)."""
    parts = max(1, min(parts, len(items)))
    bounds = [round(i * len(items) / parts) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]
