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
from typing import NamedTuple

import torch
from torch import Tensor

from ..policy.lora import adapters_disabled
from ..models.adapter import ModelAdapter, select_cond
from ..samplers.sde_steps import get_sde_step
from ..samplers.tree import branch_step
from .base import RolloutBatch, chunk_indices, split_even
from .flow_grpo import clipped_policy_loss, gaussian_mean_kl, kl_scale


class EdgeMicrobatch(NamedTuple):
    """Parents (b,) of one frontier chunk at one step, and the loss weight ``n_mb / E``.

    ``noise`` is unused (kept for the trainer's micro-batch shape).
    """

    index: Tensor
    step: int
    noise: Tensor | None = None
    weight: float = 1.0


def chunk_children(parents: Tensor, factor: int, train: Tensor) -> tuple[Tensor, Tensor]:
    """Trained children of ``parents`` at a step with ``factor`` children per node.

    Returns:
        (children (c,) index into the step's edges, local (c,) row of each child's parent in
        ``parents``).
    """
    children = (parents[:, None] * factor + torch.arange(factor)).reshape(-1)
    local = torch.arange(len(parents)).repeat_interleave(factor)
    keep = train[children]
    return children[keep], local[keep]


@dataclass
class BranchGRPO:
    """BranchGRPO objective (reference script values in parentheses).

    Args:
        clip_range: PPO epsilon (1e-3).
        kl_beta: weight of the KL to the base model (0: the reference has none).
        updates_per_iteration: optimizer steps per iteration.
    """

    clip_range: float = 1e-3
    kl_beta: float = 0.0
    updates_per_iteration: int = 1
    name: str = "branch_grpo"
    rollout = "tree"
    sampling_adapter = "default"
    eval_adapter = "default"

    def setup(self, model: ModelAdapter) -> None:
        """No extra adapter (the KL reference is the LoRA switched off)."""

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """Nothing to update between iterations."""
        return {}

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[EdgeMicrobatch]]:
        """Every (step, frontier chunk) with a trained edge once, in random order.

        Raises:
            ValueError: the batch holds no tree (run with an objective whose rollout is "tree").
        """
        tb = batch.tree
        if tb is None:
            raise ValueError("branch_grpo needs tree rollouts (batch.tree is None); run it through the Trainer")
        tr, mbs, edges = tb.rollout, [], []
        for t in range(len(tb.train)):
            f, parents_n = int(tr.factors[t]), tr.nodes[t].shape[0]
            has_child = tb.train[t].reshape(parents_n, f).any(dim=1)
            for chunk in chunk_indices(parents_n, tb.chunk_size):
                parents = chunk[has_child[chunk]]
                if len(parents):
                    mbs.append(EdgeMicrobatch(parents, t))
                    edges.append(len(chunk_children(parents, f, tb.train[t])[0]))
        if not mbs:
            return []
        order = torch.randperm(len(mbs), generator=generator).tolist()
        groups = split_even(order, self.updates_per_iteration)
        return [[mbs[i]._replace(weight=len(g) / sum(edges[j] for j in g)) for i in g] for g in groups]

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: EdgeMicrobatch) -> tuple[Tensor, dict[str, float]]:
        """Summed clipped loss of the trained edges below one chunk of parents, times the weight."""
        tb, t, parents = batch.tree, mb.step, mb.index
        tr = tb.rollout
        children, local = chunk_children(parents, int(tr.factors[t]), tb.train[t])
        x = tr.nodes[t][parents]
        cond = select_cond(tb.cond, tr.trees(t)[parents])
        v = model.velocity(x, tr.sigmas[t].float().expand(len(parents)), cond)
        step_fn, level, scale = get_sde_step(tr.sde), float(tr.noise_levels[t]), float(tr.noise_scales[t])
        sigma, sigma_next = tr.sigmas[t].float().expand(len(children)), tr.sigmas[t + 1].float().expand(len(children))
        x_next = tr.nodes[t + 1][children]
        step = branch_step(step_fn, x[local], v[local], sigma, sigma_next, level, scale, prev_sample=x_next)
        old = tr.log_probs[t][children]
        per_edge, ratio = clipped_policy_loss(step.log_prob, old, tb.advantages[t][children], self.clip_range)
        loss = per_edge.sum() * mb.weight
        stats = {
            "ratio": float(ratio.detach().mean()),
            "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
            "approx_kl": float(0.5 * ((step.log_prob.detach() - old) ** 2).mean()),
            "edges": float(len(children)),
        }
        if self.kl_beta > 0:
            with torch.no_grad(), adapters_disabled(model.transformer):
                v_ref = model.velocity(x, tr.sigmas[t].float().expand(len(parents)), cond)
            ref = branch_step(step_fn, x[local], v_ref[local], sigma, sigma_next, level, scale, prev_sample=x_next)
            s = kl_scale(tr.sde, step, sigma, sigma_next, level)
            kl = gaussian_mean_kl(step.mean, ref.mean, s).sum() * mb.weight
            loss = loss + self.kl_beta * kl
            stats["kl"] = float(kl.detach())
        return loss, stats
