"""BranchGRPO: PPO-clip on the edges of branching tree rollouts, with depth-wise advantages.

Each iteration grows one tree per prompt (:mod:`flowrl.tree.rollouts`). Every edge
parent -> child of every tree is a training transition, trained once (shared prefixes are not
repeated per leaf), with the child's depth-wise advantage ``A_e``:

    rho_e = exp(log p_theta(child | parent) - log p_old(child | parent))
    L     = (1 / E) sum_e max(-A_e rho_e, -A_e clip(rho_e, 1 - eps, 1 + eps))  [+ beta KL_e]

over the E trained (unpruned) edges of the optimizer step. A micro-batch is one chunk of the
parent frontier at one step, exactly as the rollout evaluated it: the model runs once per
parent and its velocity serves all of the parent's children, so the first update sees a ratio
of exactly 1. At split steps the density is the one the child was drawn from (scaled noise).

References:
    Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
    Models", arXiv 2509.06040, 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.adapter import Cond, ModelAdapter, select_cond
from ..samplers.sde_steps import get_sde_step
from ..samplers.tree import branch_step
from .base import FrozenVelocities, Objective, RolloutBatch, check_ranges
from .flow_grpo import check_ratio_norm, policy_terms, transition_kl
from .planning import EdgeMicrobatch, chunk_children, plan_tree_edges


@dataclass
class BranchGRPO(Objective):
    """BranchGRPO objective (reference script values in parentheses).

    Args:
        clip_range: PPO epsilon (1e-3).
        kl_beta: weight of the KL between the per-step kernels of theta and the base model (0: the
            reference has none); the same meaning for every ``sampler.sde`` (docs/alignment.md).
        updates_per_iteration: optimizer steps per iteration.
        ratio_norm: GRPO-Guard's ratio normalisation (off; :func:`flowrl.objectives.flow_grpo.guard_log_ratio`).
    """

    clip_range: float = 1e-3
    kl_beta: float = 0.0
    updates_per_iteration: int = 1
    ratio_norm: bool = False
    name: str = "branch_grpo"
    rollout = "tree"

    def __post_init__(self) -> None:
        checks = {
            "clip_range": self.clip_range > 0,
            "kl_beta": self.kl_beta >= 0,
            "updates_per_iteration": self.updates_per_iteration >= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/branch_grpo.py")
        check_ratio_norm(self.ratio_norm, self.updates_per_iteration, self.name)
        self.frozen = FrozenVelocities()  # not a field: no config key

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[EdgeMicrobatch]]:
        """Every (step, frontier chunk) with a trained edge once, in random order."""
        return plan_tree_edges(batch, generator, self.updates_per_iteration)

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[EdgeMicrobatch]) -> None:
        """With a KL term: the base model's velocities at the step's parent chunks, under one adapter switch."""
        self.frozen.clear()
        if self.kl_beta > 0:
            self.frozen.fill(model, None, [(mb, *_parent_inputs(batch, mb)) for mb in microbatches])

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: EdgeMicrobatch) -> tuple[Tensor, dict[str, float]]:
        """Summed clipped loss of the trained edges below one chunk of parents, times the weight."""
        tb, t, parents = batch.tree, mb.step, mb.index
        tr = tb.rollout
        children, local = chunk_children(parents, int(tr.factors[t]), tb.train[t])
        x, sigma_p, cond = _parent_inputs(batch, mb)
        v = model.velocity(x, sigma_p, cond)
        step_fn, level, scale = get_sde_step(tr.sde), float(tr.noise_levels[t]), float(tr.noise_scales[t])
        sigma, sigma_next = tr.sigmas[t].float().expand(len(children)), tr.sigmas[t + 1].float().expand(len(children))
        x_next = tr.nodes[t + 1][children]
        step = branch_step(step_fn, x[local], v[local], sigma, sigma_next, level, scale, prev_sample=x_next)
        old = tr.log_probs[t][children]
        old_mean = step.mean.detach() if self.ratio_norm else None  # theta is the rollout policy (one update)
        per_edge, ratio = policy_terms(
            step, old, old_mean, tb.advantages[t][children], self.clip_range, sigma - sigma_next
        )
        loss = per_edge.sum() * mb.weight
        stats = {
            "ratio": float(ratio.detach().mean()),
            "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
            "approx_kl": float(0.5 * ((step.log_prob.detach() - old) ** 2).mean()),
            "edges": float(len(children)),
        }
        if self.kl_beta > 0:
            v_ref = self.frozen.velocity(model, None, mb, x, sigma_p, cond)
            with torch.no_grad():
                ref = branch_step(step_fn, x[local], v_ref[local], sigma, sigma_next, level, scale, prev_sample=x_next)
            kl = transition_kl(step.mean, ref.mean, step.std).sum() * mb.weight
            loss = loss + self.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats


def _parent_inputs(batch: RolloutBatch, mb: EdgeMicrobatch) -> tuple[Tensor, Tensor, Cond]:
    """The model inputs of a micro-batch's parent nodes: x (p, ...) at its depth, sigma (p,), cond."""
    tr, parents = batch.tree.rollout, mb.index
    x = tr.nodes[mb.step][parents]
    return x, tr.sigmas[mb.step].float().expand(len(parents)), select_cond(batch.tree.cond, tr.trees(mb.step)[parents])
