"""BranchGRPO's pruning: which tree edges are trained. Rollouts and rewards never change.

Pruning only removes edges from the backward pass (the training set of an iteration):

- **Depth pruning**: edges whose child depth is in a window ``D`` are not trained. With a
  slide interval ``k``, the window moves ``floor(iteration / k)`` depths toward the root, but
  its shallowest depth never goes above ``stop`` (default: the last split step).
- **Width pruning** on the last segment (edges drawn after the last split step), two modes:
  ``best_worst`` (BranchGRPO's mode 2): per tree, keep ``max(2, int(fraction * count))`` edges,
  half with the best and half with the worst advantages (the worst half gets the odd one);
  ``per_branch`` (mode 1): inside each last-split branch (the children of one node at the last
  split), keep the top ``max(1, int(fraction * factor))`` children by advantage (summed over the
  segment), with all their segment edges.
- Edges of ODE steps (noise level 0) carry no density and are never trained.

References:
    Li et al., "BranchGRPO", arXiv 2509.06040, 2025 (depth and width pruning).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def depth_prune_window(depths: Sequence[int], iteration: int, slide_every: int = 0, stop_depth: int = 0) -> set[int]:
    """Child depths excluded from training at ``iteration``.

    Args:
        depths: the base window (child depths, 1..T).
        iteration: training iterations done so far.
        slide_every: slide one depth toward the root every this many iterations (0 = fixed).
        stop_depth: the window's shallowest depth stops sliding here.
    """
    base = sorted(int(d) for d in depths)
    if not base:
        return set()
    if slide_every > 0:
        shift = min(iteration // slide_every, max(0, base[0] - stop_depth))
        base = [d - shift for d in base]
    return set(base)


def width_prune_masks(
    advantages: Sequence[Tensor], steps: Sequence[int], num_trees: int, fraction: float
) -> list[Tensor]:
    """Best/worst selection among the edges of ``steps`` (the last segment), per tree.

    Args:
        advantages: T tensors, ``advantages[t]`` (N * n_{t+1},) edge advantages.
        steps: the step indices of the last segment.
        num_trees: N.
        fraction: share of the segment's edges kept (1 keeps all).

    Returns:
        One bool mask per entry of ``steps`` (same shapes as ``advantages[t]``).
    """
    if not steps or fraction >= 1.0:
        return [torch.ones_like(advantages[t], dtype=torch.bool) for t in steps]
    per_tree = torch.cat([advantages[t].reshape(num_trees, -1) for t in steps], dim=1)  # (N, M)
    count = per_tree.shape[1]
    keep = min(count, max(2, int(fraction * count)))
    best = keep // 2
    order = torch.argsort(per_tree, dim=1, descending=True, stable=True)
    chosen = torch.zeros_like(per_tree, dtype=torch.bool)
    chosen.scatter_(1, order[:, :best], True)
    chosen.scatter_(1, order[:, count - (keep - best) :], True)
    masks, start = [], 0
    for t in steps:
        width = advantages[t].shape[0] // num_trees
        masks.append(chosen[:, start : start + width].reshape(-1))
        start += width
    return masks


def branch_prune_masks(
    advantages: Sequence[Tensor], steps: Sequence[int], factor: int, fraction: float
) -> list[Tensor]:
    """Mode 1: the best children of every last-split branch keep their segment edges.

    Args:
        advantages: T tensors, ``advantages[t]`` (N * n_{t+1},) edge advantages; after the last
            split, edge j of every step continues the path of child j, whose parent is ``j // factor``.
        steps: the step indices of the last segment.
        factor: children per node at the last split.
        fraction: share of each branch's children kept (1 keeps all).

    Returns:
        One bool mask per entry of ``steps``.
    """
    if not steps or fraction >= 1.0:
        return [torch.ones_like(advantages[t], dtype=torch.bool) for t in steps]
    score = torch.stack([advantages[t] for t in steps]).sum(dim=0).reshape(-1, factor)  # (parents, factor)
    order = torch.argsort(score, dim=1, descending=True, stable=True)
    chosen = torch.zeros_like(score, dtype=torch.bool)
    chosen.scatter_(1, order[:, : max(1, int(fraction * factor))], True)
    return [chosen.reshape(-1).clone() for _ in steps]


def train_masks(
    advantages: Sequence[Tensor],
    factors: Tensor,
    noise_levels: Tensor,
    num_trees: int,
    *,
    iteration: int = 0,
    depth_prune: Sequence[int] = (),
    slide_every: int = 0,
    stop_depth: int | None = None,
    width_keep: float = 1.0,
    width_mode: str = "best_worst",
    prune_until: int | None = None,
) -> list[Tensor]:
    """Which edges are trained this iteration.

    Args:
        advantages: T tensors (N * n_{t+1},) edge advantages.
        factors: (T,) children per node (splits have > 1).
        noise_levels: (T,) SDE level per step (0 = ODE step, never trained).
        num_trees: N.
        iteration: training iterations done so far.
        depth_prune: base window of child depths not trained.
        slide_every: depth-window slide interval (0 = fixed).
        stop_depth: where the window stops sliding (None = the last split step).
        width_keep: fraction of last-segment edges kept.
        width_mode: "best_worst" (per tree, best and worst halves) or "per_branch" (the best
            children of each last-split node).
        prune_until: prune only while ``iteration < prune_until`` (None = always).

    Returns:
        T bool tensors, True = the edge is trained.
    """
    masks = [torch.full_like(a, bool(noise_levels[t] > 0), dtype=torch.bool) for t, a in enumerate(advantages)]
    if prune_until is not None and iteration >= prune_until:
        return masks
    splits = [t for t in range(len(factors)) if int(factors[t]) > 1]
    last = splits[-1] if splits else -1
    stop = last if stop_depth is None else stop_depth
    pruned_depths = depth_prune_window(depth_prune, iteration, slide_every, max(stop, 0))
    for t in range(len(masks)):
        if t + 1 in pruned_depths:
            masks[t] = torch.zeros_like(masks[t])
    segment = [t for t in range(last + 1, len(masks))]
    if width_mode not in ("best_worst", "per_branch"):
        raise ValueError(f"sampler.tree.width_mode must be 'best_worst' or 'per_branch'; got {width_mode!r}")
    if width_mode == "per_branch" and last >= 0:
        kept = branch_prune_masks(advantages, segment, int(factors[last]), width_keep)
    else:
        kept = width_prune_masks(advantages, segment, num_trees, width_keep)
    for t, keep in zip(segment, kept):
        masks[t] = masks[t] & keep
    return masks
