"""Flow-GRPO: PPO-clip on the stored SDE transitions, with an optional KL to the base model.

For a stored transition x_j -> x_{j+1} of sample i:

    rho   = exp(log p_theta(x_{j+1} | x_j) - log p_old(x_{j+1} | x_j))
    L_pg  = mean_i max(-A_i rho, -A_i clip(rho, 1 - eps, 1 + eps))
    KL    = mean_elements (mu_theta - mu_ref)^2 / (2 s_j^2)       (reference = LoRA switched off)
    L     = L_pg + beta * KL

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.adapter import ModelAdapter, select_cond
from ..policy.lora import adapters_disabled
from ..samplers.flow_sde import flow_sde_diffusion
from ..samplers.sde_steps import get_sde_step
from ..samplers.types import SDEStep
from .base import Microbatch, Objective, RolloutBatch, check_ranges
from .planning import plan_transitions


def clipped_policy_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float
) -> tuple[Tensor, Tensor]:
    """Per-sample PPO-clip loss.

    Args:
        log_prob: (b,) current policy log-density of the stored transitions.
        old_log_prob: (b,) rollout-time log-density.
        advantages: (b,) advantages.
        clip_range: epsilon.

    Returns:
        (loss (b,), ratio (b,)).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def gaussian_mean_kl(mean: Tensor, ref_mean: Tensor, s: Tensor) -> Tensor:
    """KL between two Gaussians with a shared variance, averaged over elements: (b,)."""
    dims = tuple(range(1, mean.ndim))
    return ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * s.reshape(-1) ** 2)


def kl_scale(sde: str, step: SDEStep, sigma: Tensor, sigma_next: Tensor, level: float) -> Tensor:
    """The std in the KL denominator, shape (b, 1).

    Flow-GRPO's diffusion ``s`` for the Flow-SDE (as the reference computes it), the transition std
    for every other SDE step.
    """
    if sde == "flow":
        return flow_sde_diffusion(sigma.view(-1, 1), sigma_next.view(-1, 1), level).to(step.mean.device)
    return step.std.reshape(len(sigma), 1)


@dataclass
class FlowGRPO(Objective):
    """Flow-GRPO objective.

    Args:
        clip_range: PPO epsilon (reference default 1e-4).
        kl_beta: weight of the KL to the base model (0 disables the reference pass).
        updates_per_iteration: optimizer steps per iteration (the reference does 2).
    """

    clip_range: float = 1e-4
    kl_beta: float = 0.0
    updates_per_iteration: int = 1
    name: str = "flow_grpo"
    rollout = "sde"

    def __post_init__(self) -> None:
        checks = {
            "clip_range": self.clip_range > 0,
            "kl_beta": self.kl_beta >= 0,
            "updates_per_iteration": self.updates_per_iteration >= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/flow_grpo.py")

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Every (chunk, stochastic step) pair once; chunks and steps in random order."""
        return plan_transitions(batch, generator, self.updates_per_iteration)

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Clipped ratio loss (+ beta KL) on one chunk at one step."""
        traj, idx, j = batch.trajectory, mb.index, mb.step
        x, x_next = traj.latents[idx, j], traj.latents[idx, j + 1]
        sigma = traj.sigmas[j].float().expand(len(idx))
        sigma_next = traj.sigmas[j + 1].float().expand(len(idx))
        level = float(traj.noise_levels[j])
        cond = select_cond(batch.cond, idx)
        step_fn = get_sde_step(traj.sde)  # the step that drew x_next, so the ratio starts at 1
        step = step_fn(x, model.velocity(x, sigma, cond), sigma, sigma_next, level, prev_sample=x_next)
        keep = batch.keep[idx].float()
        per_sample, ratio = clipped_policy_loss(
            step.log_prob, traj.log_probs[idx, j], batch.advantages[idx], self.clip_range
        )
        denom = keep.sum().clamp(min=1.0)
        loss = (per_sample * keep).sum() / denom
        stats = {
            "ratio": float(ratio.detach().mean()),
            "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
            "approx_kl": float(0.5 * ((step.log_prob.detach() - traj.log_probs[idx, j]) ** 2).mean()),
        }
        if self.kl_beta > 0:
            with torch.no_grad(), adapters_disabled(model.transformer):
                ref = step_fn(x, model.velocity(x, sigma, cond), sigma, sigma_next, level, prev_sample=x_next)
            s = kl_scale(traj.sde, step, sigma, sigma_next, level)
            kl = (gaussian_mean_kl(step.mean, ref.mean, s) * keep).sum() / denom
            loss = loss + self.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
