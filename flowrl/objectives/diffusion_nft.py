"""DiffusionNFT: negative-aware fine-tuning on the forward (noising) process.

Rollouts come from a separate *old* LoRA adapter with any black-box solver; only the clean
samples x0 and their rewards are kept. For fresh noise at a rollout sigma t,
``x_t = (1 - t) x0 + t eps`` and the velocity target is ``eps - x0``. With the trainable v_theta
and the frozen v_old:

    v+ = beta v_theta + (1 - beta) v_old            (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta            (implicit negative policy)
    r  = clip(A / (2 c) + 1/2, 0, 1)                (optimality probability, A clipped to +-c)
    L+ = mean (x0+ - x0)^2 / sg(mean |x0+ - x0|),   x0+ = x_t - t v+   (adaptive x0 weighting)
    L  = c (r L+ + (1 - r) L-) / beta + kl_beta * mean (v_theta - v_ref)^2

After each iteration ``theta_old <- eta theta_old + (1 - eta) theta`` with
``eta = min(old_decay_rate * iteration, old_decay_max)``, and an evaluation EMA adapter tracks
theta with decay ``min((1 + n) / (10 + n), ema_decay_max)``.

References:
    Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.adapter import ModelAdapter
from ..policy.lora import add_frozen_copy, soft_update
from ..samplers.broadcast import batch_view
from .base import (
    FrozenVelocities,
    Microbatch,
    Objective,
    RolloutBatch,
    check_ranges,
    noised_inputs,
    noised_microbatch,
    split_even,
    velocity_penalty,
)
from .planning import chunk_noise, kept_chunks, weigh_by_kept


def optimality_probability(advantages: Tensor, clip: float) -> Tensor:
    """``r = clip(A / (2 clip) + 1/2, 0, 1)`` for advantages already clipped to [-clip, clip]."""
    return (advantages.clamp(-clip, clip) / (2 * clip) + 0.5).clamp(0.0, 1.0)


def adaptive_x0_loss(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """Per-sample ``mean (x0_pred - x0)^2 / sg(mean |x0_pred - x0|)`` (denominator >= 1e-5, fp64)."""
    dims = tuple(range(1, x0.ndim))
    diff = x0_pred.double() - x0.double()
    scale = diff.abs().mean(dim=dims).clamp(min=1e-5).detach()
    return (diff**2).mean(dim=dims) / scale


def implicit_policies(v_theta: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``v+ = beta v_theta + (1 - beta) v_old`` and ``v- = (1 + beta) v_old - beta v_theta``."""
    return beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta


def nft_policy_loss(
    v_theta: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, sigma: Tensor, r: Tensor, beta: float, clip: float
) -> Tensor:
    """Per-sample NFT policy loss ``clip (r L+ + (1 - r) L-) / beta`` (b,), fp64.

    Args:
        v_theta: (b, ...) trainable velocity.
        v_old: (b, ...) sampling-policy velocity (no grad).
        x_t: (b, ...) noised samples at sigma.
        x0: (b, ...) clean samples.
        sigma: (b,) noise levels.
        r: (b,) optimality probabilities.
        beta: NFT mixing beta.
        clip: advantage clip c (scales the loss as in the reference).
    """
    t = batch_view(sigma.double(), x0.ndim)
    v_pos, v_neg = implicit_policies(v_theta.double(), v_old.double(), beta)
    loss_pos = adaptive_x0_loss(x_t.double() - t * v_pos, x0)
    loss_neg = adaptive_x0_loss(x_t.double() - t * v_neg, x0)
    r = r.double()
    return clip * (r * loss_pos + (1 - r) * loss_neg) / beta


@dataclass
class DiffusionNFT(Objective):
    """DiffusionNFT objective (reference defaults in parentheses).

    Args:
        beta: mixing beta of the implicit policies (1.0; 0.1 for OCR / multi-reward).
        kl_beta: weight of the velocity-space KL to the base model (1e-4).
        adv_clip: advantage clip c (5).
        train_fraction: fraction of the rollout steps trained per sample (0.99 -> 9 of 10).
        updates_per_iteration: optimizer steps per iteration (1).
        old_decay_rate, old_decay_max: ``eta = min(rate * iteration, max)`` (0.001, 0.5).
        ema_decay_max: cap of the evaluation EMA decay (0.9).
    """

    beta: float = 1.0
    kl_beta: float = 1e-4
    adv_clip: float = 5.0
    train_fraction: float = 0.99
    updates_per_iteration: int = 1
    old_decay_rate: float = 0.001
    old_decay_max: float = 0.5
    ema_decay_max: float = 0.9
    name: str = "diffusion_nft"
    rollout = "solver"
    sampling_adapter = "old"
    eval_adapter = "ema"

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"objective.beta must be > 0 (the NFT mixing beta); got {self.beta}")
        checks = {
            "kl_beta": self.kl_beta >= 0,
            "adv_clip": self.adv_clip > 0,
            "train_fraction": 0 < self.train_fraction <= 1,
            "updates_per_iteration": self.updates_per_iteration >= 1,
            "old_decay_rate": self.old_decay_rate >= 0,
            "old_decay_max": 0 <= self.old_decay_max <= 1,
            "ema_decay_max": 0 <= self.ema_decay_max <= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/diffusion_nft.py")
        self.frozen = FrozenVelocities()  # not a field: no config key

    def setup(self, model: ModelAdapter) -> None:
        """Add the frozen "old" (sampling) and "ema" (evaluation) adapters."""
        add_frozen_copy(model.transformer, "old")
        add_frozen_copy(model.transformer, "ema")

    def noise_per_row(self, num_steps: int) -> int:
        """Training sigmas per sample: ``max(1, int(num_steps * train_fraction))``, one fresh noise each."""
        return max(1, int(num_steps * self.train_fraction))

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Every chunk at a random subset of the rollout sigmas (excluding sigma = 0), fresh noise."""
        num = len(batch.sigmas) - 1
        count = self.noise_per_row(num)
        mbs = []
        for idx in kept_chunks(batch):
            for j in torch.randperm(num, generator=generator)[:count].tolist():
                mbs.append(Microbatch(idx, j, chunk_noise(batch, idx, generator)))
        if not mbs:
            return []
        order = torch.randperm(len(mbs), generator=generator).tolist()
        return weigh_by_kept(split_even([mbs[i] for i in order], self.updates_per_iteration), batch.global_keep)

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """The "old" policy's velocities (and the base model's, with a KL term), one switch each."""
        self.frozen.clear()
        items = noised_inputs(batch, microbatches)
        self.frozen.fill(model, "old", items)
        if self.kl_beta > 0:
            self.frozen.fill(model, None, items)

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """NFT loss on one chunk at one sigma, times the plan's weight ``mb.weight``."""
        idx = mb.index
        x0, sigma, x_t, cond = noised_microbatch(batch, mb)
        v_theta = model.velocity(x_t, sigma, cond)
        v_old = self.frozen.velocity(model, "old", mb, x_t, sigma, cond)
        r = optimality_probability(batch.advantages[idx], self.adv_clip)
        per_sample = nft_policy_loss(v_theta, v_old, x_t, x0, sigma, r, self.beta, self.adv_clip)
        keep = batch.keep[idx].double()
        loss = (per_sample * keep).sum() / keep.sum().clamp(min=1.0)
        stats = {"policy_loss": float(loss.detach()), "r_mean": float(r.mean())}
        if self.kl_beta > 0:
            v_ref = self.frozen.velocity(model, None, mb, x_t, sigma, cond)
            kl = velocity_penalty(model, x_t, sigma, cond, v_theta, None, v_other=v_ref, keep=batch.keep[idx])
            loss = loss + self.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return (loss * mb.weight).float(), stats

    def old_decay(self, iteration: int) -> float:
        """``eta = min(old_decay_rate * iteration, old_decay_max)``."""
        return min(self.old_decay_rate * iteration, self.old_decay_max)

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """Soft-update the sampling adapter and the evaluation EMA."""
        eta = self.old_decay(iteration)
        soft_update(model.transformer, "old", keep=eta)
        n = iteration - 1  # EMA updates done before this one
        ema = min((1 + n) / (10 + n), self.ema_decay_max)
        soft_update(model.transformer, "ema", keep=ema)
        return {"old_decay": eta, "ema_decay": ema}
