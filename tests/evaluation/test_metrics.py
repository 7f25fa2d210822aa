"""Diversity, drift and confidence intervals against hand-computed values."""

import math

import pytest
import torch

from flowrl.evaluation import mean_ci, prompt_diversity, sample_drift


def test_diversity_matches_pairwise_loop():
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(7, 3, 4, 4, generator=gen)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    out = prompt_diversity(images, ids)
    for g, value in zip((0, 1), out.tolist()):
        rows = images[ids == g].double().reshape(-1, 48)
        n = len(rows)
        pairs = [(rows[i] - rows[j]).norm() / math.sqrt(48) for i in range(n) for j in range(n) if i != j]
        assert value == pytest.approx(float(sum(pairs) / len(pairs)), abs=1e-12)


def test_diversity_is_zero_for_collapsed_prompt_and_resolution_free():
    same = torch.full((4, 3, 8, 8), 0.3)
    assert prompt_diversity(same, [0, 0, 0, 0]).item() == pytest.approx(0.0, abs=1e-12)
    black_white = torch.stack([torch.zeros(3, 16, 16), torch.ones(3, 16, 16)])
    assert prompt_diversity(black_white, [5, 5]).item() == pytest.approx(1.0)


def test_diversity_refuses_single_sample_group():
    with pytest.raises(ValueError, match="group 1 has 1 sample"):
        prompt_diversity(torch.rand(3, 3, 4, 4), [0, 0, 1])


def test_drift():
    a = torch.zeros(2, 3, 4, 4)
    b = torch.zeros(2, 3, 4, 4)
    b[1] = 0.5
    assert sample_drift(a, b).tolist() == pytest.approx([0.0, 0.5])
    with pytest.raises(ValueError, match="must match"):
        sample_drift(a, b[:1])


def test_mean_ci_student_t_quantile_and_nan():
    values = [1.0, 2.0, 3.0, 4.0, float("nan")]
    ci = mean_ci(values)
    half = 3.182446305284263 * math.sqrt(5.0 / 3.0) / 2.0  # t(0.975, 3 degrees of freedom), by hand: s^2 = 5/3
    assert (ci.mean, ci.n) == (2.5, 4)
    assert ci.low == pytest.approx(2.5 - half, abs=1e-9) and ci.high == pytest.approx(2.5 + half, abs=1e-9)
    assert mean_ci([7.0]).low == 7.0
    assert math.isnan(mean_ci([]).mean)
    with pytest.raises(ValueError, match="level"):
        mean_ci([1.0], level=1.0)


def test_mean_ci_covers_its_level_at_small_n():
    """A 95 % interval over 3 normal draws covers the mean 95 % of the time (a z quantile gives ~80 %)."""
    gen = torch.Generator().manual_seed(0)
    draws = torch.randn(20_000, 3, generator=gen, dtype=torch.float64)
    covered = sum(ci.low <= 0.0 <= ci.high for ci in map(mean_ci, draws))
    assert 0.94 < covered / len(draws) < 0.96


def test_mean_ci_half_width_and_infinite_values_left_out():
    """``half_width`` is half the interval (the ``±`` of eval/reward_ci95); an inf is left out like a NaN (the mean of
    finite values), not averaged into an infinite mean.
    """
    ci = mean_ci([1.0, 2.0, 3.0, 4.0])
    assert ci.half_width == pytest.approx(3.182446305284263 * math.sqrt(5.0 / 3.0) / 2.0, abs=1e-9)
    assert ci.half_width == pytest.approx(ci.high - ci.mean, abs=1e-12)
    with_inf = mean_ci(torch.tensor([1.0, 2.0, 3.0, 4.0, float("inf"), -float("inf")], dtype=torch.float64))
    assert (with_inf.mean, with_inf.n) == (2.5, 4) and with_inf.low == pytest.approx(ci.low, abs=1e-12)


def test_diversity_refuses_flat_images_and_mismatched_group_ids():
    """A (B,) tensor is not a batch of images, and group ids must be one per sample (one ValueError line each)."""
    with pytest.raises(ValueError, match=r"images must be \(B, \.\.\.\) images; got shape \(4,\)"):
        prompt_diversity(torch.rand(4), [0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"group_ids must be \(4,\) to match images; got \(3,\)"):
        prompt_diversity(torch.rand(4, 3, 2, 2), [0, 0, 1])
    with pytest.raises(ValueError, match=r"group_ids must be \(4,\) to match images; got \(2, 2\)"):
        prompt_diversity(torch.rand(4, 3, 2, 2), [[0, 0], [1, 1]])
