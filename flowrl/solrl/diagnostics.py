"""How well the explore model ranks seeds: stage-1 vs stage-2 rank agreement, as pure functions.

Sol-RL reports Kendall's tau and Spearman's rho between the low-precision (stage 1) and the
full-precision (stage 2) rewards of the same seeds, and the agreement of the top-K and bottom-K
sets. All three are computed in float64.

References:
    Li et al., Sol-RL, arXiv 2604.06916, 2026, ranking-fidelity table (tau 0.798, rho 0.927 for
    NVFP4 vs BF16). Kendall, "The treatment of ties in ranking problems", Biometrika, 1945 (tau-b).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.shape != b.shape or a.ndim != 1 or a.numel() < 2:
        raise ValueError(f"need two (N,) reward tensors with N >= 2; got {tuple(a.shape)} and {tuple(b.shape)}")
    return a.double(), b.double()


def kendall_tau(a: Tensor, b: Tensor) -> float:
    """Kendall's tau-b of two (N,) score vectors (ties handled; NaN when one of them is constant)."""
    a, b = _check(a, b)
    da = torch.sign(a[:, None] - a[None, :])
    db = torch.sign(b[:, None] - b[None, :])
    upper = torch.triu(torch.ones_like(da, dtype=torch.bool), diagonal=1)
    s = float((da * db)[upper].sum())
    pairs_a, pairs_b = float((da[upper] != 0).sum()), float((db[upper] != 0).sum())
    return s / (pairs_a * pairs_b) ** 0.5 if pairs_a and pairs_b else float("nan")


def _ranks(x: Tensor) -> Tensor:
    """Average ranks (1-based) of a float64 (N,) vector: tied values share the mean of their ranks."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, x.numel() + 1, dtype=x.dtype)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman_rho(a: Tensor, b: Tensor) -> float:
    """Spearman's rho: the Pearson correlation of the average ranks (NaN when one vector is constant)."""
    a, b = _check(a, b)
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float((ra.square().sum() * rb.square().sum()).sqrt())
    return float((ra * rb).sum()) / denominator if denominator else float("nan")


def extreme_overlap(a: Tensor, b: Tensor, k: int) -> float:
    """Share of the top-k and bottom-k seeds by ``a`` that are also top-k / bottom-k by ``b``, in [0, 1].

    Ties are broken by the lower index, as in :mod:`flowrl.solrl.selection`.
    """
    a, b = _check(a, b)
    if not 1 <= k <= a.numel() // 2:
        raise ValueError(f"k={k} must be between 1 and N // 2 = {a.numel() // 2}")
    ta, tb = (torch.sort(x, descending=True, stable=True).indices for x in (a, b))
    top = len(set(ta[:k].tolist()) & set(tb[:k].tolist()))
    bottom = len(set(ta[-k:].tolist()) & set(tb[-k:].tolist()))
    return (top + bottom) / (2 * k)
