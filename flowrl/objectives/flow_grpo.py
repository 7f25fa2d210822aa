"""Flow-GRPO: PPO-clip on the stored SDE transitions, with an optional KL to the base model.

For a stored transition x_j -> x_{j+1} of sample i:

    rho   = exp(log p_theta(x_{j+1} | x_j) - log p_old(x_{j+1} | x_j))
    L_pg  = mean_i max(-A_i rho, -A_i clip(rho, 1 - eps, 1 + eps))
    KL    = mean_elements (mu_theta - mu_ref)^2 / (2 std_j^2)     (reference = LoRA switched off)
    L     = L_pg + beta * KL

``std_j`` is the step's transition std (``s_j sqrt(sigma_j - sigma_{j+1})`` for the Flow-SDE), so
KL is the KL between the two per-step Gaussian kernels and ``kl_beta`` means the same for every
``sampler.sde``. The reference SD3 trainer divides by ``s_j^2`` instead (a KL ``|dt|`` times
smaller): its ``beta`` equals flowrl's ``kl_beta / |dt|`` (docs/alignment.md).

With ``ratio_norm`` (GRPO-Guard's RatioNorm) the ratio is taken on a step-independent scale,
``rho' = exp(c [log p_theta - log p_old + mean (mu_theta - mu_old)^2 / (2 c^2)])`` with ``c = std_j``,
and the step's policy loss is divided by ``sigma_j - sigma_{j+1}``.

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025.
    Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
    Regulated Clipping", 2025 (yifan123/flow_grpo ``scripts/train_sd3_GRPO_Guard.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.adapter import Cond, ModelAdapter, select_cond
from ..samplers.sde_steps import get_sde_step
from ..samplers.types import SDEStep
from .base import FrozenVelocities, Microbatch, Objective, RolloutBatch, check_ranges
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


def transition_kl(mean: Tensor, other: Tensor, std: Tensor) -> Tensor:
    """Closed-form ``KL(N(mean, std^2) || N(other, std^2))`` of two per-step kernels, averaged over elements.

    The same for every SDE step: ``std`` is the step's own transition std (``SDEStep.std``).

    Args:
        mean: (b, ...) transition mean of the trained policy.
        other: (b, ...) transition mean of the other policy (reference, anchor, rollout).
        std: (b, 1, ..., 1) or (b,) the step's transition std.

    Returns:
        (b,) KL; 0 where the step is deterministic (std 0).
    """
    std = std.reshape(-1)
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(std > 0, gaussian_mean_kl(mean, other, safe), torch.zeros_like(safe))


def guard_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's normalised log-ratio ``c [(log p - log p_old) + mean (mu - mu_old)^2 / (2 c^2)]``, ``c = std``.

    With log-probs averaged over elements (``reduce="mean"``) and ``x' = mu_old + c z`` this is
    ``mean((mu - mu_old) z)``: the mean-shift bias of the log-ratio removed, on a scale that does not
    depend on the step's noise.

    Args:
        log_prob: (b,) log-density of the stored transitions under theta (mean over elements).
        old_log_prob: (b,) the same under the rollout policy.
        mean: (b, ...) theta's transition mean.
        old_mean: (b, ...) the rollout policy's transition mean.
        std: (b, 1, ..., 1) the step's transition std.

    Returns:
        (b,) the normalised log-ratio (``exp`` of it is RatioNorm's ratio); 0 where the step is
        deterministic (std 0, e.g. CPS's step to sigma 0), as its log-prob and KL are.
    """
    c = std.reshape(-1)
    safe = torch.where(c > 0, c, torch.ones_like(c))
    dims = tuple(range(1, mean.ndim))
    bias = ((mean - old_mean) ** 2).mean(dim=dims) / (2 * safe**2)
    return torch.where(c > 0, safe * (log_prob - old_log_prob + bias), torch.zeros_like(safe))


def policy_terms(
    step: SDEStep, old_log_prob: Tensor, old_mean: Tensor | None, advantages: Tensor, clip_range: float, dt: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-sample clipped loss and ratio, plain or with GRPO-Guard's RatioNorm.

    Args:
        step: the recomputed step (log_prob (b,), mean, std).
        old_log_prob: (b,) rollout-time log-density.
        old_mean: (b, ...) the rollout policy's mean for RatioNorm; None = the plain ratio.
        advantages: (b,) advantages.
        clip_range: epsilon.
        dt: (b,) ``sigma - sigma_next`` (> 0); RatioNorm divides each sample's loss by it.

    Returns:
        (loss (b,), ratio (b,)).
    """
    if old_mean is None:
        return clipped_policy_loss(step.log_prob, old_log_prob, advantages, clip_range)
    log_ratio = guard_log_ratio(step.log_prob, old_log_prob, step.mean, old_mean, step.std)
    loss, ratio = clipped_policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_range)
    return loss / dt.reshape(-1), ratio


def _transition_inputs(batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, Tensor, Cond]:
    """The model inputs of a micro-batch's stored transition: x (b, ...) at its step, sigma (b,), cond."""
    traj, idx = batch.trajectory, mb.index
    return traj.latents[idx, mb.step], traj.sigmas[mb.step].float().expand(len(idx)), select_cond(batch.cond, idx)


def check_ratio_norm(ratio_norm: bool, updates_per_iteration: int, where: str) -> None:
    """RatioNorm reads the rollout policy's means from theta, which holds only with one update per iteration.

    Raises:
        ValueError: ratio_norm with several updates per iteration (one line: the fix).
    """
    if ratio_norm and updates_per_iteration > 1:
        raise ValueError(
            f"{where}: objective.ratio_norm needs the rollout policy's means, which are theta's only with "
            f"objective.updates_per_iteration=1 (got {updates_per_iteration}); set it to 1, or use "
            "objective.name=sage_grpo, which keeps a frozen copy of the rollout policy"
        )


@dataclass
class FlowGRPO(Objective):
    """Flow-GRPO objective.

    Args:
        clip_range: PPO epsilon (reference default 1e-4).
        kl_beta: weight of the KL between the per-step kernels of theta and the base model (0 disables the
            reference pass); the reference SD3 trainer's beta is ``kl_beta / |dt|`` (docs/alignment.md).
        updates_per_iteration: optimizer steps per iteration (the reference does 2).
        ratio_norm: GRPO-Guard's ratio normalisation (off); needs ``updates_per_iteration = 1``.
    """

    clip_range: float = 1e-4
    kl_beta: float = 0.0
    updates_per_iteration: int = 1
    ratio_norm: bool = False
    name: str = "flow_grpo"
    rollout = "sde"

    def __post_init__(self) -> None:
        checks = {
            "clip_range": self.clip_range > 0,
            "kl_beta": self.kl_beta >= 0,
            "updates_per_iteration": self.updates_per_iteration >= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/flow_grpo.py")
        self.frozen = FrozenVelocities()  # not a field: no config key
        check_ratio_norm(self.ratio_norm, self.updates_per_iteration, self.name)

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Every (chunk, stochastic step) pair once; chunks and steps in random order."""
        return plan_transitions(batch, generator, self.updates_per_iteration)

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """With a KL term: the base model's velocities at the step's transitions, under one adapter switch."""
        self.frozen.clear()
        if self.kl_beta > 0:
            self.frozen.fill(model, None, [(mb, *_transition_inputs(batch, mb)) for mb in microbatches])

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Clipped ratio loss (+ beta KL) on one chunk at one step, times the plan's weight ``mb.weight``."""
        traj, idx, j = batch.trajectory, mb.index, mb.step
        x, sigma, cond = _transition_inputs(batch, mb)
        x_next = traj.latents[idx, j + 1]
        sigma_next = traj.sigmas[j + 1].float().expand(len(idx))
        level = float(traj.noise_levels[j])
        step_fn = get_sde_step(traj.sde)  # the step that drew x_next, so the ratio starts at 1
        step = step_fn(x, model.velocity(x, sigma, cond), sigma, sigma_next, level, prev_sample=x_next)
        keep = batch.keep[idx].float()
        old_mean = step.mean.detach() if self.ratio_norm else None  # theta is the rollout policy (one update)
        per_sample, ratio = policy_terms(
            step, traj.log_probs[idx, j], old_mean, batch.advantages[idx], self.clip_range, sigma - sigma_next
        )
        denom = keep.sum().clamp(min=1.0)
        loss = (per_sample * keep).sum() / denom
        stats = {
            "ratio": float(ratio.detach().mean()),
            "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
            "approx_kl": float(0.5 * ((step.log_prob.detach() - traj.log_probs[idx, j]) ** 2).mean()),
        }
        if self.kl_beta > 0:
            v_ref = self.frozen.velocity(model, None, mb, x, sigma, cond)
            with torch.no_grad():
                ref = step_fn(x, v_ref, sigma, sigma_next, level, prev_sample=x_next)
            kl = (transition_kl(step.mean, ref.mean, step.std) * keep).sum() / denom
            loss = loss + self.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss * mb.weight, stats
