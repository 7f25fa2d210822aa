"""bench.scaling's cost model: split placement, tree NFE and model calls against the real rollouts."""

from __future__ import annotations

import pytest
import torch

from bench.scaling import (
    CallCounter,
    Cost,
    fit_calls_nfe,
    flat_cost,
    slope,
    spread_splits,
    tree_cost,
    tree_nfe_closed_form,
)
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.tree import split_factors, tree_nfe, tree_widths
from flowrl.tree.rollouts import chunked_tree_rollout

torch.set_num_threads(1)


def test_spread_splits_gives_the_shipped_schedule_and_stays_in_range():
    assert spread_splits(10, 4) == [0, 3, 6, 9]  # configs/branch/digits.yaml
    assert spread_splits(10, 1) == [0]
    assert spread_splits(10, 5) == [0, 2, 5, 7, 9]
    for steps in (3, 10, 20):
        for k in range(2, steps + 1):
            s = spread_splits(steps, k)
            assert s[0] == 0 and s[-1] == steps - 1 and s == sorted(set(s)) and len(s) == k
    with pytest.raises(ValueError, match="splits must be in 1..10"):
        spread_splits(10, 11)


@pytest.mark.parametrize("factor", [2, 3])
def test_closed_form_nfe_matches_the_tree_widths(factor):
    for steps in (5, 10, 20):
        for k in range(1, min(steps, 6) + 1):
            splits = spread_splits(steps, k)
            factors = split_factors(steps, splits, [factor])
            assert tree_nfe_closed_form(steps, splits, factor) == tree_nfe(factors)
            assert tree_widths(factors)[-1] == factor**k
    assert tree_nfe_closed_form(10, [0, 3, 6, 9]) == 43  # docs/trees.md


def test_costs_match_the_calls_and_evaluations_of_the_real_rollouts(tiny_sd3):
    model = CallCounter(tiny_sd3)
    shape = model.latent_shape(*model.default_resolution)
    gen = torch.Generator().manual_seed(0)
    steps, trees, chunk = 6, 3, 4
    factors = split_factors(steps, [0, 2, 5], [2])  # frontier 3, 6, 6, 12, 12, 12
    cond = model.encode_prompt(["a bold handwritten 1", "a thin 2", "a 3"])
    chunked_tree_rollout(
        model,
        cond,
        torch.randn(trees, *shape, generator=gen),
        linear_sigmas(steps),
        torch.full((steps,), 0.3, dtype=torch.float64),
        factors,
        chunk_size=chunk,
        sde="dance",
        generator=gen,
    )
    assert tree_cost(factors, trees, chunk) == Cost(model.calls, model.nfe) == Cost(14, 51)
    model.calls = model.nfe = 0
    samples = 5
    chunked_rollout(
        model,
        model.encode_prompt(["a 7"] * samples),
        torch.randn(samples, *shape, generator=gen),
        linear_sigmas(3),
        sde_noise_levels(3, 0.7),
        chunk_size=2,
        generator=gen,
    )
    assert flat_cost(samples, 3, 2) == Cost(model.calls, model.nfe) == Cost(9, 15)


def test_slope_and_call_fit_recover_known_laws():
    xs = [1.0, 2.0, 5.0, 40.0]
    assert slope(xs, [3 * x**1.5 for x in xs]) == pytest.approx(1.5)
    costs = [Cost(5, 25), Cost(10, 400), Cost(13, 430), Cost(2, 40)]
    a, b = fit_calls_nfe(costs, [0.02 * c.calls + 0.003 * c.nfe for c in costs])
    assert (a, b) == (pytest.approx(0.02), pytest.approx(0.003))
