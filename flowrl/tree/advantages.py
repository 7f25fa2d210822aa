"""BranchGRPO's tree credit assignment: reward fusion to inner nodes, depth-wise advantages.

Leaves carry their rewards. An inner node's reward is either the mean of its descendant leaves
("mean", BranchGRPO's default) or the softmax-weighted sum of its children's rewards, the
weights being a softmax (temperature 1) over the children's edge log-probs ("softmax",
``--tree_prob_weighted``), applied bottom-up. Then, per tree and per depth d >= 1,

    A = (R - mean_d R) / (std_d R + 1e-8),

with the unbiased std of the depth; a depth with one node or std < 1e-6 gets A = 0. An edge
parent -> child is trained with the child's advantage.

Layout (see :mod:`flowrl.samplers.tree`): per-depth tensors are tree-major with children next
to each other, so node j at depth d has the leaves ``[j L_d, (j + 1) L_d)``, ``L_d = n_T / n_d``.

References:
    Li et al., "BranchGRPO", arXiv 2509.06040, 2025 (reward fusion, depth-wise normalisation).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

Fusion = Literal["mean", "softmax"]


def fuse_rewards(
    leaf_rewards: Tensor, widths: Sequence[int], log_probs: Sequence[Tensor], num_trees: int, fusion: Fusion = "mean"
) -> list[Tensor]:
    """Rewards of every node, depth by depth.

    Args:
        leaf_rewards: (N * n_T,) rewards of the leaves, tree-major.
        widths: nodes per tree at each depth, ``[1, n_1, ..., n_T]``.
        log_probs: T tensors, ``log_probs[t]`` (N * n_{t+1},) edge log-probs (used by "softmax").
        num_trees: N.
        fusion: "mean" of descendant leaves or "softmax" over the children's log-probs.

    Returns:
        T + 1 tensors; entry d is (N * n_d,) in the leaf rewards' dtype (entry T = the leaves).

    Raises:
        ValueError: wrong leaf count, NaN/inf rewards or an unknown fusion.
    """
    if leaf_rewards.shape != (num_trees * widths[-1],):
        raise ValueError(
            f"leaf_rewards must be ({num_trees * widths[-1]},) for {num_trees} trees of {widths[-1]} leaves; "
            f"got {tuple(leaf_rewards.shape)}"
        )
    if not torch.isfinite(leaf_rewards).all():
        raise ValueError("tree rollouts need a finite reward for every leaf (a NaN reward has no defined fusion)")
    if fusion not in ("mean", "softmax"):
        raise ValueError(f"sampler.tree.fusion must be 'mean' or 'softmax'; got {fusion!r}")
    rewards: list[Tensor] = [leaf_rewards]
    for t in reversed(range(len(widths) - 1)):
        parents = num_trees * widths[t]
        if fusion == "mean":
            fused = leaf_rewards.reshape(parents, -1).mean(dim=1)
        else:
            children = rewards[0].reshape(parents, -1)
            weights = torch.softmax(log_probs[t].to(children.dtype).reshape(parents, -1), dim=1)
            fused = (weights * children).sum(dim=1)
        rewards.insert(0, fused)
    return rewards


def depthwise_advantages(node_rewards: Sequence[Tensor], num_trees: int, clip: float | None = None) -> list[Tensor]:
    """Normalise node rewards within each tree and depth.

    Args:
        node_rewards: T + 1 tensors from :func:`fuse_rewards`.
        num_trees: N.
        clip: optional advantage clip (BranchGRPO clips at 5).

    Returns:
        T tensors; entry t is (N * n_{t+1},) float32, the advantage of the children drawn at
        step t (depth t + 1).
    """
    out = []
    for rewards in node_rewards[1:]:
        r = rewards.double().reshape(num_trees, -1)
        if r.shape[1] < 2:
            out.append(torch.zeros(rewards.shape[0], dtype=torch.float32))
            continue
        std = r.std(dim=1, keepdim=True)
        adv = (r - r.mean(dim=1, keepdim=True)) / (std + 1e-8)
        adv = torch.where(std < 1e-6, torch.zeros_like(adv), adv)
        if clip is not None:
            adv = adv.clamp(-clip, clip)
        out.append(adv.reshape(-1).float())
    return out
