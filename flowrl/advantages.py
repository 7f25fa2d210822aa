"""Group-relative advantages as pure functions: GRPO, GDPO, the MC-GRPO median baseline.

A NaN reward means "not applicable to this sample": group statistics ignore it and the sample
gets advantage 0 (and ``keep`` False when no reward applies to it). A group whose valid rewards
are all equal (or that has fewer than two) carries no signal: it is counted and dropped.

References:
    Shao et al., "DeepSeekMath" (GRPO), 2024. Liu et al., "Flow-GRPO", 2025 (per-prompt mean,
    global std). "GDPO: Group reward-Decoupled Normalization Policy Optimization", 2026 (normalise
    each reward separately, then combine). "MC-GRPO: Median-Centered GRPO for Small-Rollout RL",
    2026 (median baseline).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

Std = Literal["global", "group", "none"]
Method = Literal["sum", "gdpo", "median"]


class AdvantageStats(NamedTuple):
    """Bookkeeping for logs: groups seen, zero-variance groups dropped, std used."""

    num_groups: int
    zero_std_groups: int
    std: float


class GroupStats(NamedTuple):
    """Per-group statistics over the finite entries of a (B,) tensor.

    Attributes:
        inverse: (B,) group index of each sample (0..G-1).
        count: (G,) number of finite values per group.
        mean: (G,) mean of the finite values (0 where none).
        var: (G,) population variance of the finite values (0 where none).
    """

    inverse: Tensor
    count: Tensor
    mean: Tensor
    var: Tensor


def group_stats(values: Tensor, group_ids: Tensor) -> GroupStats:
    """NaN-aware group count, mean and variance (float64).

    Args:
        values: (B,) values, NaN = not applicable.
        group_ids: (B,) int64 group index per sample.
    """
    if values.shape != group_ids.shape or values.ndim != 1:
        raise ValueError(f"rewards and group_ids must both be (B,); got {tuple(values.shape)}, {tuple(group_ids.shape)}")
    v = values.double()
    valid = torch.isfinite(v)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    filled = torch.where(valid, v, torch.zeros_like(v))
    count = torch.zeros(groups, dtype=v.dtype).index_add_(0, inverse, valid.double())
    mean = torch.zeros(groups, dtype=v.dtype).index_add_(0, inverse, filled) / count.clamp(min=1)
    centred = torch.where(valid, v - mean[inverse], torch.zeros_like(v))
    var = torch.zeros(groups, dtype=v.dtype).index_add_(0, inverse, centred**2) / count.clamp(min=1)
    return GroupStats(inverse, count, mean, var)


def _zero_groups(stats: GroupStats) -> Tensor:
    """(G,) True for groups with < 2 valid values or (numerically) constant values."""
    return (stats.count < 2) | (stats.var <= 1e-12 * (1 + stats.mean**2))


def _scale(values: Tensor, stats: GroupStats, std: Std) -> Tensor:
    """(B,) divisor: the std of all finite values, the group std, or 1."""
    if std == "global":
        finite = values.double()[torch.isfinite(values)]
        return (finite.std(unbiased=False) if finite.numel() else torch.tensor(0.0, dtype=torch.float64)).expand(len(values))
    if std == "group":
        return stats.var.sqrt()[stats.inverse]
    if std == "none":
        return torch.ones(len(values), dtype=torch.float64)
    raise ValueError(f"advantage std must be 'global', 'group' or 'none'; got {std!r}")


def _finish(adv: Tensor, values: Tensor, stats: GroupStats, clip: float | None) -> tuple[Tensor, Tensor, AdvantageStats]:
    zero = _zero_groups(stats)
    keep = ~zero[stats.inverse] & torch.isfinite(values)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    finite = values.double()[torch.isfinite(values)]
    spread = float(finite.std(unbiased=False)) if finite.numel() else 0.0
    return adv.float(), keep, AdvantageStats(len(stats.count), int(zero.sum()), spread)


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: Std = "global", eps: float = 1e-4, clip: float | None = None
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """Per-prompt advantages ``A_i = (r_i - mean_group(r)) / (std + eps)``.

    Args:
        rewards: (B,) rewards (NaN = not applicable).
        group_ids: (B,) int64 prompt-group index per sample.
        std: "global" (all rewards of the batch, as Flow-GRPO), "group" or "none".
        eps: added to the std.
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats).
    """
    stats = group_stats(rewards, group_ids)
    adv = (rewards.double() - stats.mean[stats.inverse]) / (_scale(rewards, stats, std) + eps)
    return _finish(adv, rewards, stats, clip)


def group_medians(values: Tensor, stats: GroupStats) -> Tensor:
    """(G,) lower median of the finite values of each group (0 where none)."""
    medians = torch.zeros(len(stats.count), dtype=torch.float64)
    for g in range(len(stats.count)):
        vals = values.double()[(stats.inverse == g) & torch.isfinite(values)]
        if vals.numel():
            medians[g] = vals.median()
    return medians


def median_advantages(
    rewards: Tensor, group_ids: Tensor, *, std: Std = "global", eps: float = 1e-4, clip: float | None = None
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """MC-GRPO: ``A_i = (r_i - median_group(r)) / (std + eps)``, robust for small groups.

    With an odd group size the median sample is the zero-advantage pivot.
    """
    stats = group_stats(rewards, group_ids)
    adv = (rewards.double() - group_medians(rewards, stats)[stats.inverse]) / (_scale(rewards, stats, std) + eps)
    return _finish(adv, rewards, stats, clip)


def gdpo_advantages(
    components: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    *,
    eps: float = 1e-4,
    renormalize: bool = True,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats, dict[str, Tensor]]:
    """GDPO: z-score each reward within its group, weight and sum, then renormalise over the batch.

    Args:
        components: reward name -> (B,) values (NaN = not applicable).
        weights: reward name -> weight.
        group_ids: (B,) group index.
        eps: added to each std.
        renormalize: divide the combined advantage by its batch std (+ eps).
        clip: optional final clip.

    Returns:
        (advantages (B,), keep (B,), AdvantageStats, per-reward advantages {name: (B,)}).
    """
    if set(components) != set(weights):
        raise ValueError(f"GDPO needs a weight for every reward; rewards {sorted(components)} vs weights {sorted(weights)}")
    total = torch.zeros(len(group_ids), dtype=torch.float64)
    applicable = torch.zeros(len(group_ids), dtype=torch.bool)
    per_reward, zero_all = {}, None
    for name, values in components.items():
        stats = group_stats(values, group_ids)
        adv = (values.double() - stats.mean[stats.inverse]) / (stats.var.sqrt()[stats.inverse] + eps)
        live = ~_zero_groups(stats)[stats.inverse] & torch.isfinite(values)
        adv = torch.where(live, adv, torch.zeros_like(adv))
        per_reward[name] = adv.float()
        total += weights[name] * adv
        applicable |= live
        zero = _zero_groups(stats)
        zero_all = zero if zero_all is None else zero_all & zero
    if renormalize and applicable.any():
        total = total / (total[applicable].std(unbiased=False) + eps)
    if clip is not None:
        total = total.clamp(-clip, clip)
    total = torch.where(applicable, total, torch.zeros_like(total))
    stats = AdvantageStats(len(zero_all), int(zero_all.sum()), float(total.std(unbiased=False)))
    return total.float(), applicable, stats, per_reward


def clip_advantages(advantages: Tensor, clip: float) -> Tensor:
    """Clip to [-clip, clip]."""
    if clip <= 0:
        raise ValueError(f"advantage clip must be > 0; got {clip}")
    return advantages.clamp(-clip, clip)


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
    """The trainer's entry point: combine rewards and normalise by the configured method.

    "sum": weighted sum of the rewards (NaN counts 0), then :func:`group_advantages`.
    "median": weighted sum, then :func:`median_advantages`. "gdpo": :func:`gdpo_advantages`.
    """
    if method == "gdpo":
        adv, keep, stats, _ = gdpo_advantages(components, weights, group_ids, eps=eps, clip=clip)
        return adv, keep, stats
    stacked = torch.stack([weights[n] * torch.nan_to_num(v.double(), nan=0.0) for n, v in components.items()])
    all_nan = torch.stack([torch.isnan(v) for v in components.values()]).all(dim=0)
    total = torch.where(all_nan, torch.full_like(stacked[0], float("nan")), stacked.sum(dim=0))
    if method == "sum":
        return group_advantages(total, group_ids, std=std, eps=eps, clip=clip)
    if method == "median":
        return median_advantages(total, group_ids, std=std, eps=eps, clip=clip)
    raise ValueError(f"advantage.method must be 'sum', 'gdpo' or 'median'; got {method!r}")


class StatTracker:
    """DDPO-style per-prompt reward history (for recipes that normalise against past rewards).

    Args:
        buffer_size: rewards kept per prompt.
        min_count: below this many rewards for a prompt, the batch mean/std is used instead.
        eps: added to the std.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16, eps: float = 1e-6):
        if buffer_size < 1 or min_count < 1:
            raise ValueError(f"buffer_size and min_count must be >= 1; got {buffer_size}, {min_count}")
        self.buffer_size, self.min_count, self.eps = buffer_size, min_count, eps
        self.history: dict[str, list[float]] = {}

    def update(self, prompts: list[str], rewards: Tensor) -> Tensor:
        """Add this batch to the history and return advantages (B,) float32."""
        r = rewards.double()
        batch_mean, batch_std = r.mean(), r.std(unbiased=False)
        adv = torch.empty_like(r)
        for prompt in dict.fromkeys(prompts):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            buf = (self.history.get(prompt, []) + r[idx].tolist())[-self.buffer_size :]
            self.history[prompt] = buf
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                hist = torch.tensor(buf, dtype=torch.float64)
                mean, std = hist.mean(), hist.std(unbiased=False)
            adv[idx] = (r[idx] - mean) / (std + self.eps)
        return adv.float()

    def clear(self) -> None:
        """Forget all history."""
        self.history.clear()

    def state_dict(self) -> dict:
        """JSON-able state."""
        return {"buffer_size": self.buffer_size, "min_count": self.min_count, "eps": self.eps, "history": dict(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.buffer_size, self.min_count, self.eps = state["buffer_size"], state["min_count"], state["eps"]
        self.history = {k: list(v) for k, v in state["history"].items()}
