"""Group-relative advantages (GRPO) as pure functions.

References:
    Shao et al., "DeepSeekMath" (GRPO), 2024; Liu et al., "Flow-GRPO", 2025 (per-prompt stats,
    global std).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor


class AdvantageStats(NamedTuple):
    """Bookkeeping for logs: groups seen, zero-variance groups dropped, std used."""

    num_groups: int
    zero_std_groups: int
    std: float


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std: Literal["global", "group"] = "global",
    eps: float = 1e-4,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """Per-prompt advantages ``A_i = (r_i - mean_group(r)) / (std + eps)``.

    Groups whose rewards are all equal carry no signal; they are counted and dropped
    (``keep`` is False for their samples).

    Args:
        rewards: (B,) float rewards.
        group_ids: (B,) int64 prompt-group index per sample.
        std: "global" (std of all rewards in the batch, as Flow-GRPO) or "group" (per-prompt std).
        eps: added to the std.
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats).
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards and group_ids must both be (B,); got {tuple(rewards.shape)}, {tuple(group_ids.shape)}")
    r = rewards.double()
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(len(groups), dtype=r.dtype).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(len(groups), dtype=r.dtype).index_add_(0, inverse, r) / count
    centred = r - mean[inverse]
    var = torch.zeros(len(groups), dtype=r.dtype).index_add_(0, inverse, centred**2) / count
    zero = var <= 1e-12 * (1 + mean**2)
    if std == "global":
        scale = r.std(unbiased=False).expand_as(r)
    elif std == "group":
        scale = var.sqrt()[inverse]
    else:
        raise ValueError(f"advantage std must be 'global' or 'group'; got {std!r}")
    adv = centred / (scale + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    keep = ~zero[inverse]
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    stats = AdvantageStats(len(groups), int(zero.sum()), float(r.std(unbiased=False)))
    return adv.float(), keep, stats
