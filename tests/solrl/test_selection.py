"""Sol-RL seed selection rules and ranking diagnostics against brute force and scipy (float64)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

from flowrl.solrl import SELECTION_RULES, extreme_overlap, kendall_tau, select_seeds, spearman_rho


def _rewards(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_best_worst_takes_the_top_half_and_the_bottom_rest():
    rewards = torch.tensor([0.5, 3.0, -1.0, 2.0, 0.0, -2.0, 1.0])
    assert select_seeds(rewards, 4).tolist() == [1, 2, 3, 5]  # top 2 (3.0, 2.0), bottom 2 (-1.0, -2.0)
    assert select_seeds(rewards, 3).tolist() == [1, 2, 5]  # top 1, bottom 2
    assert select_seeds(rewards, 7).tolist() == list(range(7))
    assert select_seeds(torch.zeros(5), 2).tolist() == [0, 4]  # ties: lower index ranks higher


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("n,k", [(8, 3), (9, 4), (10, 5), (7, 6)])
def test_max_variance_equals_brute_force(seed, n, k):
    rewards = _rewards(n, seed) ** 3  # skewed, so the best split is often not k/2
    got = select_seeds(rewards, k, "max_variance")
    best = max(float(rewards[list(c)].var(unbiased=False)) for c in itertools.combinations(range(n), k))
    assert float(rewards[got].var(unbiased=False)) == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert got.tolist() == sorted(set(got.tolist())) and len(got) == k


@pytest.mark.parametrize("seed", range(10))
def test_mean_deviation_keeps_the_largest_deviations(seed):
    rewards = _rewards(12, seed)
    got = select_seeds(rewards, 5, "mean_deviation")
    deviation = (rewards - rewards.mean()).abs()
    assert float(deviation[got].min()) >= float(deviation[[i for i in range(12) if i not in got]].max())


def test_random_is_reproducible_and_uniform():
    rewards = torch.arange(6.0)
    first = select_seeds(rewards, 3, "random", torch.Generator().manual_seed(1))
    assert torch.equal(first, select_seeds(rewards, 3, "random", torch.Generator().manual_seed(1)))
    counts = torch.zeros(6)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[select_seeds(rewards, 3, "random", gen)] += 1
    assert torch.allclose(counts / 1500, torch.ones(6), atol=0.08)  # each seed kept half the time


def test_every_rule_returns_k_distinct_sorted_indices():
    rewards = _rewards(16, 3)
    for rule in SELECTION_RULES:
        got = select_seeds(rewards, 6, rule, torch.Generator().manual_seed(0))
        assert got.dtype == torch.int64 and got.tolist() == sorted(set(got.tolist())) and len(got) == 6, rule


def test_bad_requests_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown Sol-RL selection rule 'best'; use one of best_worst"):
        select_seeds(torch.zeros(4), 2, "best")
    with pytest.raises(ValueError, match="cannot keep 5 of 4 explored seeds"):
        select_seeds(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="finite"):
        select_seeds(torch.tensor([0.0, float("nan")]), 1)


@pytest.mark.parametrize("seed", range(10))
def test_rank_statistics_match_scipy(seed):
    a = _rewards(24, seed)
    b = a + 0.7 * _rewards(24, seed + 100)
    b[3] = b[5]  # a tie
    assert kendall_tau(a, b) == pytest.approx(stats.kendalltau(a.numpy(), b.numpy()).statistic, abs=1e-12)
    assert spearman_rho(a, b) == pytest.approx(stats.spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-12)


def test_rank_statistics_extremes():
    a = torch.arange(10.0)
    assert kendall_tau(a, a) == 1.0 and spearman_rho(a, -a) == pytest.approx(-1.0)
    assert extreme_overlap(a, a, 3) == 1.0 and extreme_overlap(a, -a, 3) == 0.0
    b = a.clone()
    b[[0, 9]] = b[[9, 0]]  # the best and the worst swap places
    assert extreme_overlap(a, b, 2) == 0.5
    with pytest.raises(ValueError, match="k=6 must be between 1 and N // 2 = 5"):
        extreme_overlap(a, a, 6)


def test_max_variance_ties_prefer_the_split_closest_to_half():
    """(10, 0, 0, 0, 0, -10), K = 4: top 1, 2 or 3 give the same variance; the rule takes 2 top + 2 bottom."""
    rewards = torch.tensor([10.0, 0.0, 0.0, 0.0, 0.0, -10.0], dtype=torch.float64)
    assert select_seeds(rewards, 4, "max_variance").tolist() == [0, 1, 4, 5]


def test_rank_statistics_need_two_scores_and_are_nan_for_a_constant_vector():
    """One seed has no ranking (refused); a constant score vector has no correlation (NaN, not 0)."""
    one = torch.tensor([1.0])
    for statistic in (kendall_tau, spearman_rho):
        with pytest.raises(ValueError, match="N >= 2"):
            statistic(one, one)
        with pytest.raises(ValueError, match="N >= 2"):
            statistic(torch.zeros(2, 2), torch.zeros(2, 2))
        assert math.isnan(statistic(torch.ones(4), torch.arange(4.0)))
