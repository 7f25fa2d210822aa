"""Low-precision SDE rollouts trained without regeneration: truncated importance weights (``solrl.mode: correct``).

verl-omni trains Flow-GRPO directly on rollouts of a low-precision sampler and corrects for the
precision gap per transition with a truncated importance weight between the full-precision
policy ``p`` and the low-precision policy ``q`` that drew the transition:

    w_{i,j} = min(exp(log p(x_{j+1} | x_j) - log q(x_{j+1} | x_j)), C)

(Ionides, "Truncated importance sampling", 2008; Yao et al., "Your efficient RL framework secretly
brings you off-policy RL training", 2025, the TIS of verl). Both log-densities are those of the
same stored transition, under the same SDE step; ``p`` is the sampling policy at full precision
before any update of the iteration. The objective's PPO ratio is taken against ``p`` (so it
starts at exactly 1) and each transition's policy-gradient term is multiplied by ``w`` (detached).
Multiplying the advantage by ``w > 0`` does exactly that for the clipped loss, since
``max(-w A r, -w A clip(r)) = w max(-A r, -A clip(r))``; a KL term is left unweighted.
Deterministic steps (noise level 0) carry weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..models.adapter import ModelAdapter, select_cond
from ..objectives.base import Microbatch, Objective, RolloutBatch
from ..policy.lora import use_adapter
from ..samplers.sde_steps import get_sde_step
from ..samplers.types import Trajectory


def truncated_importance_weights(log_p: Tensor, log_q: Tensor, clip: float, levels: Tensor | None = None) -> Tensor:
    """``min(exp(log_p - log_q), clip)`` per transition, 1 on deterministic steps.

    Args:
        log_p: (B, T) log-density of each transition under the full-precision policy.
        log_q: (B, T) the same under the low-precision policy that drew it.
        clip: the truncation ``C >= 1``.
        levels: (T,) noise level per step; steps with level 0 get weight 1 (None: every step is stochastic).

    Returns:
        (B, T) weights in ``(0, clip]``, in the dtype of ``log_p`` (float64 in, float64 out).

    Raises:
        ValueError: mismatched shapes or ``clip < 1``.
    """
    if log_p.shape != log_q.shape or log_p.ndim != 2:
        raise ValueError(f"log_p and log_q must both be (B, T); got {tuple(log_p.shape)} and {tuple(log_q.shape)}")
    if clip < 1:
        raise ValueError(f"the truncation C must be >= 1 (solrl.is_clip); got {clip}")
    weights = torch.exp(log_p - log_q.to(log_p.dtype)).clamp(max=clip)
    if levels is not None:
        weights = torch.where(levels.to(weights.device)[None, :] > 0, weights, torch.ones_like(weights))
    return weights


@torch.no_grad()
def transition_log_probs(model: ModelAdapter, adapter: str, batch: RolloutBatch) -> Tensor:
    """(B, T) fp32 log-density of every stored transition under ``model`` with LoRA ``adapter`` active.

    Recomputed on the rollout's own chunks (``batch.chunk_size``), with the SDE step that drew the
    transitions, exactly as Flow-GRPO's loss recomputes them; deterministic steps are 0.
    """
    traj: Trajectory = batch.trajectory
    step_fn = get_sde_step(traj.sde)
    out = torch.zeros_like(traj.log_probs)
    rows = traj.latents.shape[0]
    with use_adapter(model.transformer, adapter):
        for start in range(0, rows, batch.chunk_size):
            idx = torch.arange(start, min(start + batch.chunk_size, rows))
            cond = select_cond(batch.cond, idx)
            for j in range(traj.log_probs.shape[1]):
                level = float(traj.noise_levels[j])
                if level == 0:
                    continue
                x, x_next = traj.latents[idx, j], traj.latents[idx, j + 1]
                sigma = traj.sigmas[j].float().expand(len(idx))
                sigma_next = traj.sigmas[j + 1].float().expand(len(idx))
                step = step_fn(x, model.velocity(x, sigma, cond), sigma, sigma_next, level, prev_sample=x_next)
                out[idx, j] = step.log_prob.float()
    return out


@dataclass
class ImportanceWeighted(Objective):
    """An SDE objective whose policy-gradient terms carry per-transition importance weights.

    Every member is the wrapped objective's; :meth:`loss` multiplies the advantages of the
    micro-batch's step ``j`` by ``weights[:, j]`` (set each iteration by the Sol-RL pipeline;
    None = unweighted).

    Args:
        inner: the objective (``rollout == "sde"``: Flow-GRPO, SAGE-GRPO).
    """

    inner: Objective
    weights: Tensor | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        """The wrapped objective's name."""
        return self.inner.name

    @property
    def rollout(self) -> str:  # type: ignore[override]
        """The wrapped objective's rollout kind."""
        return self.inner.rollout

    @property
    def sampling_adapter(self) -> str:  # type: ignore[override]
        """The wrapped objective's sampling adapter."""
        return self.inner.sampling_adapter

    @property
    def eval_adapter(self) -> str:  # type: ignore[override]
        """The wrapped objective's evaluation adapter."""
        return self.inner.eval_adapter

    def setup(self, model: ModelAdapter) -> None:
        """The wrapped objective's setup."""
        self.inner.setup(model)

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """The wrapped objective's plan."""
        return self.inner.plan(batch, generator)

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """The wrapped objective's prepare (what it precomputes does not depend on the advantages)."""
        self.inner.prepare(model, batch, microbatches)

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """The wrapped loss with the advantages of step ``mb.step`` scaled by the importance weights."""
        if self.weights is None:
            return self.inner.loss(model, batch, mb)
        weight = self.weights[:, mb.step].to(batch.advantages)
        return self.inner.loss(model, batch._replace(advantages=batch.advantages * weight), mb)

    def after_update(self, model: ModelAdapter) -> dict[str, float]:
        """The wrapped objective's hook."""
        return self.inner.after_update(model)

    def sync_step(self, reduce_sum: Callable[[Tensor], Tensor], microbatches: int) -> None:
        """The wrapped objective's hook."""
        self.inner.sync_step(reduce_sum, microbatches)

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """The wrapped objective's hook."""
        return self.inner.after_iteration(model, iteration)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped objective's state (the weights live for one iteration only)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the wrapped objective's state."""
        self.inner.load_state_dict(state)
