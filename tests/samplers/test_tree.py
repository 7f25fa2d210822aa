"""Tree rollouts (flowrl.samplers.tree): flat reproduction, NFE formula, split densities (float64 math)."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.samplers import SDE_STEPS, get_sde_step, linear_sigmas, rollout
from flowrl.samplers.tree import branch_step, split_factors, tree_edges, tree_nfe, tree_rollout, tree_widths

torch.set_num_threads(1)


def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A non-trivial field of x and sigma."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    return 0.4 * x * (1 + s) - torch.sin(3 * x) * s + 0.1


def _tree_velocity(calls: list[int] | None = None):
    def fn(x, sigma, trees):
        if calls is not None:
            calls.append(x.shape[0])
        return _velocity(x, sigma)

    return fn


@pytest.mark.parametrize("sde", list(SDE_STEPS))
def test_factor_one_tree_reproduces_a_flat_trajectory(sde):
    n, steps, shape = 3, 6, (4, 4, 4)
    sigmas = linear_sigmas(steps)
    levels = torch.full((steps,), 0.6, dtype=torch.float64)
    roots = torch.randn((n, *shape), generator=torch.Generator().manual_seed(0))
    noises = torch.randn((n, steps, *shape), generator=torch.Generator().manual_seed(1))
    flat = rollout(_velocity, roots, sigmas, levels, noises=noises, sde=sde)
    factors = split_factors(steps, [1, 3], [1])  # "splits" with one child each
    tree = tree_rollout(
        _tree_velocity(),
        roots,
        sigmas,
        levels,
        factors,
        split_noise_scale=4.0,
        sde=sde,
        noises=[noises[:, t] for t in range(steps)],
    )
    for t in range(steps + 1):
        assert torch.equal(tree.nodes[t], flat.latents[:, t])
    for t in range(steps):
        assert torch.equal(tree.log_probs[t], flat.log_probs[:, t])
    # the same generator state gives the same draws as the (unchunked) flat rollout
    a = rollout(_velocity, roots, sigmas, levels, generator=torch.Generator().manual_seed(5), sde=sde)
    b = tree_rollout(
        _tree_velocity(), roots, sigmas, levels, factors, sde=sde, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a.latents[:, -1], b.leaves) and torch.equal(a.log_probs[:, -1], b.log_probs[-1])


def _closed_form_nfe(splits: list[int], steps: int) -> int:
    """Four factor-2 splits s1 < s2 < s3 < s4: (s1+1) + 2(s2-s1) + 4(s3-s2) + 8(s4-s3) + 16(T-1-s4)."""
    s1, s2, s3, s4 = splits
    return (s1 + 1) + 2 * (s2 - s1) + 4 * (s3 - s2) + 8 * (s4 - s3) + 16 * (steps - 1 - s4)


@pytest.mark.parametrize("splits", [[0, 3, 6, 9], [0, 1, 3, 4], [1, 3, 5, 7], [2, 4, 6, 8], [6, 7, 8, 9]])
def test_nfe_count_matches_the_formula(splits):
    steps, n = 10, 2
    factors = split_factors(steps, splits, [2])
    calls: list[int] = []
    tree = tree_rollout(
        _tree_velocity(calls),
        torch.randn(n, 2, 4, 4),
        linear_sigmas(steps),
        torch.full((steps,), 0.5, dtype=torch.float64),
        factors,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(calls) == steps  # the frontier of each depth is one batch
    assert sum(calls) == n * tree_nfe(factors) == n * _closed_form_nfe(splits, steps)
    assert sum(lp.numel() for lp in tree.log_probs) == n * tree_edges(factors)
    assert tree.leaves.shape[0] == n * 16 == n * tree_widths(factors)[-1]
    assert tree_nfe(split_factors(10, [0, 3, 6, 9], [2])) == 43  # 2.69 per leaf vs 10 flat


def test_uneven_factors_and_bad_schedules():
    f = split_factors(5, [1, 3], [3, 2])
    assert f.tolist() == [1, 3, 1, 2, 1] and tree_widths(f) == [1, 1, 3, 3, 6, 6]
    assert tree_nfe(f) == 1 + 1 + 3 + 3 + 6 and tree_edges(f) == 1 + 3 + 3 + 6 + 6
    for splits, factors in [([3, 1], [2]), ([1, 1], [2]), ([10], [2]), ([1, 2], [2, 2, 2]), ([1], [0]), ([1], [2.5])]:
        with pytest.raises(ValueError, match="sampler.tree"):
            split_factors(10, splits, factors)
    with pytest.raises(ValueError, match="noise level 0"):
        tree_rollout(
            _tree_velocity(),
            torch.randn(1, 2, 4, 4),
            linear_sigmas(3),
            torch.zeros(3, dtype=torch.float64),
            split_factors(3, [1], [2]),
        )

    def cps_tree(split: int):
        levels = torch.full((3,), 0.5, dtype=torch.float64)
        factors = split_factors(3, [split], [2])
        return tree_rollout(_tree_velocity(), torch.randn(1, 2, 4, 4), linear_sigmas(3), levels, factors, sde="cps")

    with pytest.raises(ValueError, match="split at step 2 has transition std 0 under sampler.sde=cps"):
        cps_tree(2)  # CPS's std is sigma_next sin(a pi / 2): 0 on the step to sigma 0 whatever its level
    tree = cps_tree(1)
    assert not torch.equal(tree.leaves[0], tree.leaves[1])
    for bad in (0.0, -1.0):  # a split whose children carry no noise (or a negative std) is refused
        with pytest.raises(ValueError, match="split_noise_scale must be > 0"):
            tree_rollout(
                _tree_velocity(),
                torch.randn(1, 2, 4, 4),
                linear_sigmas(3),
                torch.full((3,), 0.5, dtype=torch.float64),
                split_factors(3, [1], [2]),
                split_noise_scale=bad,
            )


@pytest.mark.parametrize("sde", list(SDE_STEPS))
def test_split_density_is_the_density_of_the_noise_actually_used(sde):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=gen, dtype=torch.float64)
    v = _velocity(x, torch.full((3,), 0.7, dtype=torch.float64))
    z = torch.randn(3, 4, 8, 8, generator=gen, dtype=torch.float64)
    sigma, sigma_next = torch.full((3,), 0.7, dtype=torch.float64), torch.full((3,), 0.6, dtype=torch.float64)
    step_fn, scale = get_sde_step(sde), 4.0
    base = step_fn(x, v, sigma, sigma_next, 0.5, noise=z)
    split = branch_step(step_fn, x, v, sigma, sigma_next, 0.5, scale, noise=z)
    torch.testing.assert_close(split.sample, base.mean + scale * base.std * z)  # the child used 4x the noise
    torch.testing.assert_close(split.std, scale * base.std)
    normal = torch.distributions.Normal(base.mean, scale * base.std)  # ... and its log-prob is THAT Gaussian
    torch.testing.assert_close(split.log_prob, normal.log_prob(split.sample).mean(dim=(1, 2, 3)))
    expected = (-0.5 * z**2 - torch.log(scale * base.std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(split.log_prob, expected)
    unscaled = torch.distributions.Normal(base.mean, base.std).log_prob(split.sample).mean(dim=(1, 2, 3))
    assert (split.log_prob - unscaled).abs().min() > 0.1  # the public code's (unscaled) value differs
    rescored = branch_step(
        step_fn, x, v, sigma, sigma_next, 0.5, scale, prev_sample=split.sample
    )  # training recomputation
    torch.testing.assert_close(rescored.log_prob, split.log_prob)


def test_split_children_in_a_rollout_spread_with_the_scaled_std():
    steps, scale = 4, 4.0
    sigmas, levels = linear_sigmas(steps), torch.full((steps,), 0.7, dtype=torch.float64)
    factors = split_factors(steps, [1], [64])
    tree = tree_rollout(
        _tree_velocity(),
        torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)),
        sigmas,
        levels,
        factors,
        split_noise_scale=scale,
        sde="dance",
        generator=torch.Generator().manual_seed(1),
    )
    parent = tree.nodes[1].repeat_interleave(64, 0)
    s, s_next = sigmas[1].float().expand(128), sigmas[2].float().expand(128)
    base = get_sde_step("dance")(parent, _velocity(parent, s), s, s_next, 0.7, prev_sample=tree.nodes[2])
    z = (tree.nodes[2] - base.mean) / base.std
    assert abs(float(z.std()) / scale - 1) < 0.02  # the children really carry 4x the std
    normal = torch.distributions.Normal(base.mean.double(), scale * base.std.double())
    torch.testing.assert_close(
        tree.log_probs[1].double(), normal.log_prob(tree.nodes[2].double()).mean(dim=(1, 2, 3)), atol=1e-5, rtol=1e-5
    )
    assert tree.noise_scales.tolist() == [1.0, scale, 1.0, 1.0]
    assert torch.equal(tree.parents(1), torch.arange(128) // 64) and torch.equal(tree.trees(2), torch.arange(128) // 64)


def test_ode_steps_in_a_tree_are_euler_steps_with_zero_log_prob():
    """Mixed ODE/SDE tree (BranchGRPO): level 0 outside the window = exact Euler, no density."""
    d = torch.float64
    sigmas = linear_sigmas(4).to(d)
    factors = split_factors(4, [0, 2], [2])
    levels = torch.tensor([0.7, 0.0, 0.7, 0.0], dtype=d)  # steps 1 and 3 deterministic; splits 0 and 2 stay SDE
    a = torch.tensor([[0.5, -1.0]], dtype=d)
    velocity = lambda x, s, trees: a.expand(x.shape[0], -1) * x  # noqa: E731 - a linear field
    roots = torch.randn(1, 2, dtype=d, generator=torch.Generator().manual_seed(0))
    tree = tree_rollout(velocity, roots, sigmas, levels, factors, generator=torch.Generator().manual_seed(1))
    for t in (1, 3):
        x = tree.nodes[t].double()
        euler = x + (sigmas[t + 1] - sigmas[t]) * a * x
        torch.testing.assert_close(tree.nodes[t + 1].double(), euler, rtol=0, atol=1e-6)  # nodes are stored in fp32
        assert torch.equal(tree.log_probs[t], torch.zeros_like(tree.log_probs[t]))
    assert all(torch.isfinite(lp).all() and (lp != 0).all() for lp in (tree.log_probs[0], tree.log_probs[2]))


def test_widths_trees_and_parents_of_a_stored_tree_by_hand():
    """``width(d)`` is ``n_d`` (the product of the factors of steps before d), ``trees(d)`` the tree of each node
    at depth d and ``parents(t)`` each child's row in ``nodes[t]``, for splits at consecutive steps.

    factors (2, 3, 1, 2) give widths 1, 2, 6, 6, 12; for N = 2 trees, depth 2 holds rows 0..11 (tree j // 6) and
    the children of step 1 have parents j // 3 among the 4 nodes of depth 1.
    """
    from flowrl.samplers.tree import TreeRollout

    factors = torch.tensor([2, 3, 1, 2])
    tree = TreeRollout([], [], factors, torch.ones(4, dtype=torch.float64), linear_sigmas(4), torch.ones(4), "flow", 2)
    assert [tree.width(d) for d in range(5)] == tree_widths(factors) == [1, 2, 6, 6, 12]
    for d, w in enumerate([1, 2, 6, 6, 12]):
        assert torch.equal(tree.trees(d), torch.arange(2 * w) // w)
    assert torch.equal(tree.parents(0), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(tree.parents(1), torch.arange(12) // 3)
    assert torch.equal(tree.parents(2), torch.arange(12))
    assert torch.equal(tree.parents(3), torch.arange(24) // 2)


def test_velocity_sees_each_rows_tree_and_store_keeps_the_chosen_trees_rows():
    """``velocity_fn`` gets each frontier row's tree (``row // n_t``, trees are contiguous), and ``store`` keeps
    exactly the rows of the chosen trees at every depth (the roots too), the same values as the full rollout.
    """
    roots, sigmas = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(5)), linear_sigmas(4)
    levels, factors = torch.full((4,), 0.5, dtype=torch.float64), split_factors(4, [0, 2], [2, 3])
    seen = []

    def fn(x, sigma, trees):
        seen.append(trees.clone())
        return _velocity(x, sigma) * (1 + trees.view(-1, 1, 1, 1))  # a field that differs per tree

    full = tree_rollout(fn, roots, sigmas, levels, factors, generator=torch.Generator().manual_seed(6))
    assert [t.tolist() for t in seen] == [
        [0, 1, 2],
        [0, 0, 1, 1, 2, 2],
        [0, 0, 1, 1, 2, 2],
        [i // 6 for i in range(18)],
    ]
    store = torch.tensor([True, False, True])
    kept = tree_rollout(fn, roots, sigmas, levels, factors, generator=torch.Generator().manual_seed(6), store=store)
    assert kept.num_trees == 2 and full.num_trees == 3
    for d, width in enumerate(tree_widths(factors)):
        rows = torch.cat([torch.arange(width), torch.arange(2 * width, 3 * width)])  # trees 0 and 2
        assert torch.equal(kept.nodes[d], full.nodes[d][rows])
        if d:
            assert torch.equal(kept.log_probs[d - 1], full.log_probs[d - 1][rows])


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_branch_step_sums_when_asked(scale):
    """``reduce="sum"`` reaches the density with and without a noise scale: the sum of the element log-probs."""
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, 4, generator=gen)
    sigma, sigma_next = torch.full((2,), 0.7, dtype=torch.float64), torch.full((2,), 0.6, dtype=torch.float64)
    v = _velocity(x, sigma)
    step = branch_step(get_sde_step("flow"), x, v, sigma, sigma_next, 0.5, scale, noise=z, reduce="sum")
    normal = torch.distributions.Normal(step.mean, step.std.expand_as(step.mean))
    torch.testing.assert_close(step.log_prob, normal.log_prob(step.sample).sum(dim=(1, 2, 3)))
