"""Group-relative advantages as pure functions: GRPO, GDPO, the MC-GRPO median baseline.

A NaN reward means "not applicable to this sample": group statistics ignore it and the sample
gets advantage 0 and ``keep`` False (for several rewards: when none applies to it). A group
whose valid rewards are all equal, or that has fewer than two, carries no signal: it is counted
as zero-variance and its samples are dropped (advantage 0, ``keep`` False). ``+-inf`` rewards
are a bug in the reward and raise. The stateful DDPO per-prompt tracker lives in
:mod:`flowrl.advantages.tracker`.

References:
    Shao et al., "DeepSeekMath" (GRPO), 2024. Liu et al., "Flow-GRPO", 2025 (per-prompt mean,
    global std, adv clip 5). Liu et al., "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization", arXiv 2601.05242, 2026 (normalise each
    reward within its group, combine, renormalise over the batch). Kim, "MC-GRPO:
    Median-Centered Group Relative Policy Optimization for Small-Rollout RL", arXiv 2601.22582,
    2026 (median baseline, odd groups, the zero-advantage pivot is not trained).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

Std = Literal["global", "group", "none"]
Method = Literal["sum", "gdpo", "median"]
METHODS: tuple[str, ...] = ("sum", "gdpo", "median")
STDS: tuple[str, ...] = ("global", "group", "none")


class AdvantageStats(NamedTuple):
    """Bookkeeping for logs.

    Attributes:
        num_groups: prompt groups in the batch.
        zero_std_groups: groups dropped for carrying no signal (constant or < 2 valid rewards;
            for GDPO: no signal in any reward).
        std: the std used for logging: std of the finite (combined) rewards of the batch; for
            GDPO the batch std of the combined advantage that the renormalisation divides by.
        num_samples: B.
        kept: samples with ``keep`` True.
        not_applicable: samples with no applicable (finite) reward.
        clipped: kept samples whose advantage hit the clip.
    """

    num_groups: int
    zero_std_groups: int
    std: float
    num_samples: int = 0
    kept: int = 0
    not_applicable: int = 0
    clipped: int = 0

    @property
    def zero_std_ratio(self) -> float:
        """Fraction of groups without signal (Flow-GRPO logs it as ``zero_std_ratio``)."""
        return self.zero_std_groups / max(self.num_groups, 1)


class GroupStats(NamedTuple):
    """Per-group statistics over the finite entries of a (B,) tensor.

    Attributes:
        inverse: (B,) group index of each sample (0..G-1, in sorted order of the group ids).
        count: (G,) number of finite values per group.
        mean: (G,) mean of the finite values (0 where none).
        var: (G,) population variance of the finite values (0 where none).
    """

    inverse: Tensor
    count: Tensor
    mean: Tensor
    var: Tensor


def _check(values: Tensor, group_ids: Tensor) -> None:
    """Raise ValueError on shape mismatch or infinite values."""
    if values.shape != group_ids.shape or values.ndim != 1:
        shapes = f"{tuple(values.shape)}, {tuple(group_ids.shape)}"
        raise ValueError(f"rewards and group_ids must both be (B,); got {shapes}")
    if torch.isinf(values).any():
        raise ValueError("rewards contain +-inf; return NaN for 'not applicable' and finite values otherwise")


def group_stats(values: Tensor, group_ids: Tensor) -> GroupStats:
    """NaN-aware group count, mean and population variance (float64).

    Args:
        values: (B,) values, NaN = not applicable.
        group_ids: (B,) integer group index per sample (any labels; groups are their unique values).

    Returns:
        :class:`GroupStats` with (B,) ``inverse`` and (G,) float64 ``count``, ``mean``, ``var``.

    Raises:
        ValueError: shapes are not both (B,), or a value is infinite.
    """
    _check(values, group_ids)
    v = values.double()
    valid = ~torch.isnan(v)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(groups, dtype=torch.float64, device=v.device)
    filled = torch.where(valid, v, torch.zeros_like(v))
    count = zeros.index_add(0, inverse, valid.double())
    mean = zeros.index_add(0, inverse, filled) / count.clamp(min=1)
    centred = torch.where(valid, v - mean[inverse], torch.zeros_like(v))
    var = zeros.index_add(0, inverse, centred**2) / count.clamp(min=1)
    return GroupStats(inverse, count, mean, var)


def zero_variance_groups(stats: GroupStats) -> Tensor:
    """(G,) bool: groups with fewer than 2 valid values or (numerically) constant values."""
    return (stats.count < 2) | (stats.var <= 1e-12 * (1 + stats.mean**2))


def group_medians(values: Tensor, stats: GroupStats) -> tuple[Tensor, Tensor]:
    """Median of the finite values of each group, and the pivot sample of odd-sized groups.

    Even valid counts take the midpoint of the two middle values (a lower median would make
    G = 2 push only upwards); odd counts take the middle value, whose sample is the pivot.

    Args:
        values: (B,) values, NaN = not applicable.
        stats: :func:`group_stats` of ``values``.

    Returns:
        (medians (G,) float64, 0 where a group has no valid value; pivot (B,) bool, True for
        one sample per group with an odd valid count, the first in sorted order among ties).
    """
    v = values.double()
    if not len(v):
        return torch.zeros(0, dtype=torch.float64, device=v.device), torch.zeros(0, dtype=torch.bool, device=v.device)
    key = torch.where(torch.isnan(v), torch.full_like(v, float("inf")), v)
    order = torch.sort(key, stable=True).indices
    order = order[torch.sort(stats.inverse[order], stable=True).indices]  # by group, ascending, NaN last
    size = torch.bincount(stats.inverse, minlength=len(stats.count))
    start = torch.cumsum(size, 0) - size
    n = stats.count.long()
    lo, hi = start + (n - 1).clamp(min=0) // 2, start + n // 2
    medians = torch.where(n > 0, (v[order[lo]] + v[order[hi]]) / 2, torch.zeros_like(stats.mean))
    pivot = torch.zeros(len(v), dtype=torch.bool, device=v.device)
    pivot[order[lo[n % 2 == 1]]] = True
    return medians, pivot


def _scale(values: Tensor, stats: GroupStats, std: str) -> Tensor:
    """(B,) divisor: the std of all finite values ("global"), the group std ("group"), or 1."""
    if std == "global":
        return _finite_std(values).expand(len(values))
    if std == "group":
        return stats.var.sqrt()[stats.inverse]
    if std == "none":
        return torch.ones(len(values), dtype=torch.float64, device=values.device)
    raise ValueError(f"advantage std must be one of {STDS}; got {std!r}")


def _finite_std(values: Tensor) -> Tensor:
    """() float64 population std of the finite entries (0 when there are none)."""
    finite = values.double()[torch.isfinite(values)]
    return finite.std(unbiased=False) if finite.numel() else torch.zeros((), dtype=torch.float64, device=values.device)


def clip_advantages(advantages: Tensor, clip: float) -> Tensor:
    """Clip advantages to ``[-clip, clip]`` (Flow-GRPO/DDPO use 5).

    Args:
        advantages: (B,) advantages.
        clip: positive bound.

    Returns:
        (B,) clipped advantages, same dtype.

    Raises:
        ValueError: ``clip <= 0``.
    """
    if not clip > 0:
        raise ValueError(f"advantage clip must be > 0; got {clip}")
    return advantages.clamp(-clip, clip)


def _finish(
    adv: Tensor, keep: Tensor, not_applicable: Tensor, zero: Tensor, std: float, clip: float | None
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """Clip, zero the dropped samples, cast to float32 and count."""
    clipped = 0
    if clip is not None:
        clipped = int(((adv.abs() > clip) & keep).sum())
        adv = clip_advantages(adv, clip)
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    stats = AdvantageStats(
        len(zero), int(zero.sum()), std, len(adv), int(keep.sum()), int(not_applicable.sum()), clipped
    )
    return adv.float(), keep, stats


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: Std = "global", eps: float = 1e-4, clip: float | None = None
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """GRPO / Flow-GRPO per-prompt advantages ``A_i = (r_i - mean_group(r)) / (std + eps)``.

    Args:
        rewards: (B,) rewards (NaN = not applicable).
        group_ids: (B,) integer prompt-group index per sample.
        std: "global" (std of all finite rewards of the batch, as Flow-GRPO), "group"
            (per-prompt std, as DanceGRPO) or "none" (mean-centred only, as Dr. GRPO).
        eps: added to the std.
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats). Dropped samples (NaN reward,
        zero-variance group) have advantage 0 and keep False.
    """
    stats = group_stats(rewards, group_ids)
    adv = (rewards.double() - stats.mean[stats.inverse]) / (_scale(rewards, stats, std) + eps)
    zero = zero_variance_groups(stats)
    nan = torch.isnan(rewards)
    return _finish(adv, ~zero[stats.inverse] & ~nan, nan, zero, float(_finite_std(rewards)), clip)


def median_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: Std = "global", eps: float = 1e-4, clip: float | None = None
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """MC-GRPO: ``A_i = (r_i - median_group(r)) / (std + eps)``, robust for small groups.

    The median is far less sensitive than the mean to one outlier reward, which avoids advantage
    sign flips at G = 2..8. Use an odd group size (G + 1 rollouts): the median sample is then the
    zero-advantage pivot and gets ``keep`` False, so the update costs G samples as in the paper.
    Even groups use the midpoint of the two middle rewards and keep every sample. The paper
    divides by the group MAD; here ``std`` picks the same divisors as :func:`group_advantages`.

    Args:
        rewards: (B,) rewards (NaN = not applicable).
        group_ids: (B,) integer prompt-group index per sample.
        std: "global", "group" (the group's population std) or "none".
        eps: added to the std.
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats).
    """
    stats = group_stats(rewards, group_ids)
    medians, pivot = group_medians(rewards, stats)
    adv = (rewards.double() - medians[stats.inverse]) / (_scale(rewards, stats, std) + eps)
    zero = zero_variance_groups(stats)
    nan = torch.isnan(rewards)
    return _finish(adv, ~zero[stats.inverse] & ~nan & ~pivot, nan, zero, float(_finite_std(rewards)), clip)


def _check_weights(rewards: dict[str, Tensor], weights: dict[str, float]) -> None:
    """Raise ValueError unless every reward has a weight and vice versa."""
    if not rewards:
        raise ValueError("advantages need at least one reward; got an empty dict")
    if set(rewards) != set(weights):
        raise ValueError(f"need a weight for every reward; rewards {sorted(rewards)} vs weights {sorted(weights)}")


def weighted_sum(rewards: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """``total = sum_k w_k r_k`` with NaN components counted as 0 (as ``flowrl.rewards.combine``).

    Args:
        rewards: reward name -> (B,) values (NaN = not applicable).
        weights: reward name -> weight (same names).

    Returns:
        (B,) float64 total; NaN where no reward applies to the sample.
    """
    _check_weights(rewards, weights)
    shapes = {name: tuple(v.shape) for name, v in rewards.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"every reward must be the same (B,) shape; got {shapes}")
    values = torch.stack([v.double() for v in rewards.values()])
    w = torch.tensor([weights[k] for k in rewards], dtype=torch.float64, device=values.device)
    total = (w[:, None] * torch.nan_to_num(values, nan=0.0)).sum(dim=0)
    return torch.where(torch.isnan(values).all(dim=0), torch.full_like(total, float("nan")), total)


def weighted_sum_advantages(
    rewards: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    *,
    std: Std = "global",
    eps: float = 1e-4,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """The default multi-reward path (Flow-GRPO, DiffusionNFT): weighted sum, then GRPO.

    Args:
        rewards: reward name -> (B,) values (NaN = not applicable, counts 0 in the sum).
        weights: reward name -> weight.
        group_ids: (B,) integer prompt-group index per sample.
        std: "global", "group" or "none", as :func:`group_advantages`.
        eps: added to the std, as :func:`group_advantages`.
        clip: if given, advantages are clipped to [-clip, clip], as :func:`group_advantages`.

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats).
    """
    return group_advantages(weighted_sum(rewards, weights), group_ids, std=std, eps=eps, clip=clip)


def gdpo_advantages(
    rewards: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    *,
    eps: float = 1e-4,
    renormalize: bool = True,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats, dict[str, Tensor]]:
    """GDPO: z-score each reward within its group, weight and sum, then renormalise over the batch.

    ``A_k,i = (r_k,i - mean_group(r_k)) / (std_group(r_k) + eps)`` (0 where r_k is NaN or its
    group has no signal in r_k), ``A_i = sum_k w_k A_k,i``, and with ``renormalize``
    ``A_i <- (A_i - mean_kept(A)) / (std_kept(A) + eps)`` over the kept samples of the batch, so
    the scale does not grow with the number of rewards (the kept mean is already 0 up to rounding,
    since each per-reward advantage sums to 0 within its group). Unlike the weighted sum, distinct reward
    combinations keep distinct advantages.

    Args:
        rewards: reward name -> (B,) values (NaN = not applicable).
        weights: reward name -> weight.
        group_ids: (B,) integer prompt-group index per sample.
        eps: added to each std.
        renormalize: apply the batch-wise normalisation of the combined advantage.
        clip: if given, the final advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats, per-reward group-normalised
        advantages {name: (B,) float32} for logging). A sample is kept when at least one reward
        gives it signal.
    """
    _check_weights(rewards, weights)
    b = len(group_ids)
    total = torch.zeros(b, dtype=torch.float64, device=group_ids.device)
    keep = torch.zeros(b, dtype=torch.bool, device=group_ids.device)
    nan = torch.ones(b, dtype=torch.bool, device=group_ids.device)
    per_reward: dict[str, Tensor] = {}
    zero_all: Tensor | None = None
    for name, values in rewards.items():
        stats = group_stats(values, group_ids)
        zero = zero_variance_groups(stats)
        live = ~zero[stats.inverse] & ~torch.isnan(values)
        adv = (values.double() - stats.mean[stats.inverse]) / (stats.var.sqrt()[stats.inverse] + eps)
        adv = torch.where(live, adv, torch.zeros_like(adv))
        per_reward[name] = adv.float()
        total = total + weights[name] * adv
        keep |= live
        nan &= torch.isnan(values)
        zero_all = zero if zero_all is None else zero_all & zero
    spread = float(total[keep].std(unbiased=False)) if keep.any() else 0.0
    if renormalize and keep.any():
        total = (total - total[keep].mean()) / (spread + eps)
    adv, keep, stats = _finish(total, keep, nan, zero_all, spread, clip)
    return adv, keep, stats, per_reward


def compute_advantages(
    components: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    *,
    method: Method = "sum",
    std: Std = "global",
    eps: float = 1e-4,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """The trainer's entry point: combine the rewards and normalise by the configured method.

    "sum": :func:`weighted_sum_advantages`. "median": weighted sum, then
    :func:`median_advantages`. "gdpo": :func:`gdpo_advantages` (per-reward group std, so
    ``std`` is not used).

    Args:
        components: reward name -> (B,) values (NaN = not applicable).
        weights: reward name -> weight.
        group_ids: (B,) integer prompt-group index per sample.
        method: "sum", "gdpo" or "median".
        std: "global", "group" or "none" (sum and median).
        eps: added to the std(s).
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats).

    Raises:
        ValueError: unknown method or std, missing weights, bad shapes, infinite rewards.
    """
    if method not in METHODS:
        raise ValueError(f"advantage.method must be one of {METHODS}; got {method!r}")
    if std not in STDS:
        raise ValueError(f"advantage.std must be one of {STDS}; got {std!r}")
    if method == "gdpo":
        adv, keep, stats, _ = gdpo_advantages(components, weights, group_ids, eps=eps, clip=clip)
        return adv, keep, stats
    if method == "median":
        return median_advantages(weighted_sum(components, weights), group_ids, std=std, eps=eps, clip=clip)
    return weighted_sum_advantages(components, weights, group_ids, std=std, eps=eps, clip=clip)
