"""Reward fusion, depth-wise advantages and pruning masks of tree rollouts, by hand (float64)."""

import math

import pytest
import torch

from flowrl.samplers.tree import split_factors, tree_widths
from flowrl.tree.advantages import depthwise_advantages, fuse_rewards
from flowrl.tree.pruning import branch_prune_masks, depth_prune_window, train_masks, width_prune_masks

D = torch.float64


def _one_tree():
    factors = split_factors(3, [0, 2], [2])  # widths 1, 2, 2, 4
    log_probs = [
        torch.log(torch.tensor([1.0, 4.0], dtype=D)),
        torch.zeros(2, dtype=D),
        torch.log(torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=D)),
    ]
    return factors, log_probs


def test_mean_fusion_by_hand():
    factors, log_probs = _one_tree()
    rewards = fuse_rewards(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=D), tree_widths(factors), log_probs, 1, "mean")
    expected = [[2.75], [1.5, 4.0], [1.5, 4.0], [1.0, 2.0, 3.0, 5.0]]
    for got, want in zip(rewards, expected):
        torch.testing.assert_close(got, torch.tensor(want, dtype=D))


def test_softmax_fusion_by_hand():
    factors, log_probs = _one_tree()
    rewards = fuse_rewards(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=D), tree_widths(factors), log_probs, 1, "softmax")
    # children of node 0 at depth 2: softmax(log 1, log 3) = (1/4, 3/4); of node 1: (1/2, 1/2)
    d2 = [0.25 * 1 + 0.75 * 2, 0.5 * 3 + 0.5 * 5]
    # root: softmax(log 1, log 4) = (0.2, 0.8) over the depth-1 rewards (= depth 2: one child each)
    root = 0.2 * d2[0] + 0.8 * d2[1]
    for got, want in zip(rewards, [[root], d2, d2, [1.0, 2.0, 3.0, 5.0]]):
        torch.testing.assert_close(got, torch.tensor(want, dtype=D))


def test_depthwise_advantages_by_hand():
    factors, log_probs = _one_tree()
    two = [torch.cat([lp, lp]) for lp in log_probs]
    leaves = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0, 7.0, 7.0, 7.0], dtype=D)  # tree 1 has no signal
    nodes = fuse_rewards(leaves, tree_widths(factors), two, 2, "mean")
    adv = depthwise_advantages(nodes, 2)
    assert len(adv) == 3 and [a.shape[0] for a in adv] == [4, 4, 8]
    a1 = (1.5 - 2.75) / (math.sqrt(2 * 1.25**2) + 1e-8)  # unbiased std of (1.5, 4)
    torch.testing.assert_close(adv[0], torch.tensor([a1, -a1, 0, 0], dtype=torch.float32))
    torch.testing.assert_close(adv[1], adv[0])
    std = math.sqrt(sum((r - 2.75) ** 2 for r in (1, 2, 3, 5)) / 3)
    torch.testing.assert_close(
        adv[2], torch.tensor([(r - 2.75) / (std + 1e-8) for r in (1, 2, 3, 5)] + [0] * 4, dtype=torch.float32)
    )
    clipped = depthwise_advantages(nodes, 2, clip=0.5)
    assert float(clipped[2].abs().max()) == 0.5


def test_a_depth_with_one_node_gets_zero_and_bad_rewards_raise():
    factors = split_factors(3, [1], [2])  # depth 1 has one node per tree
    widths = tree_widths(factors)
    lps = [torch.zeros(w, dtype=D) for w in widths[1:]]
    adv = depthwise_advantages(fuse_rewards(torch.tensor([0.0, 1.0], dtype=D), widths, lps, 1), 1)
    assert torch.equal(adv[0], torch.zeros(1))
    with pytest.raises(ValueError, match="finite reward"):
        fuse_rewards(torch.tensor([0.0, float("nan")], dtype=D), widths, lps, 1)
    with pytest.raises(ValueError, match="leaf_rewards"):
        fuse_rewards(torch.zeros(3, dtype=D), widths, lps, 1)


def test_depth_window_slides_rootward_and_stops():
    assert depth_prune_window([8, 9], iteration=0, slide_every=10, stop_depth=5) == {8, 9}
    assert depth_prune_window([8, 9], iteration=25, slide_every=10, stop_depth=5) == {6, 7}
    assert depth_prune_window([8, 9], iteration=1000, slide_every=10, stop_depth=5) == {5, 6}
    assert depth_prune_window([8, 9], iteration=1000, slide_every=0, stop_depth=5) == {8, 9}
    assert depth_prune_window([], iteration=3) == set()


def test_width_pruning_keeps_best_and_worst_of_the_last_segment():
    adv = [torch.tensor([0.1, 0.5, 0.3, -0.2, 0.0, 0.9, -1.0, 0.2])]  # one tree, 8 last-segment edges
    (mask,) = width_prune_masks(adv, [0], 1, 0.5)  # keep 4: the 2 best (0.9, 0.5) and 2 worst (-1.0, -0.2)
    assert mask.tolist() == [False, True, False, True, False, True, True, False]
    (few,) = width_prune_masks(adv, [0], 1, 0.01)  # at least one best and one worst
    assert few.tolist() == [False] * 5 + [True, True, False]


def test_train_masks_combine_depth_width_and_ode_steps():
    factors = split_factors(5, [0, 1], [2])  # widths 1, 2, 4, 4, 4, 4; last segment = steps 2..4
    levels = torch.tensor([0.7, 0.7, 0.7, 0.0, 0.7], dtype=D)  # step 3 is an ODE step
    adv = [torch.arange(w, dtype=torch.float32) for w in tree_widths(factors)[1:]]
    masks = train_masks(adv, factors, levels, 1, depth_prune=[2], width_keep=0.5)
    assert masks[0].all() and not masks[1].any()  # child depth 2 pruned
    assert not masks[3].any()  # ODE step: no density, never trained
    kept = torch.cat([masks[2], masks[4]])  # 3 segment steps x 4 edges = 12, keep 6 = 3 best + 3 worst of the segment
    assert int(kept.sum()) + int(masks[3].sum()) <= 6
    free = train_masks(adv, factors, levels, 1, iteration=7, depth_prune=[2], width_keep=0.5, prune_until=5)
    assert all(m.all() for t, m in enumerate(free) if t != 3)  # pruning switched off after prune_until


def test_per_branch_width_pruning_keeps_the_best_children_of_each_last_split_node():
    # 2 trees x 4 leaves after a last split of factor 2: parents (0, 1), (2, 3), (4, 5), (6, 7) per edge index
    seg = [
        torch.tensor([0.1, 0.5, 0.3, -0.2, 0.0, 0.9, -1.0, 0.2]),
        torch.tensor([0.2, 0.1, 0.3, 0.1, 0.0, 0.0, -1.0, 0.0]),
    ]
    masks = branch_prune_masks(seg, [0, 1], 2, 0.5)  # summed: 0.3 0.6 | 0.6 -0.1 | 0.0 0.9 | -2.0 0.2
    assert [m.tolist() for m in masks] == [[False, True, True, False, False, True, False, True]] * 2
    assert all(m.all() for m in branch_prune_masks(seg, [0, 1], 2, 1.0))
    factors = split_factors(5, [0, 1], [2])  # last split at step 1 (factor 2); segment = steps 2..4, 4 edges each
    levels = torch.full((5,), 0.7, dtype=D)
    adv = [
        torch.arange(w, dtype=torch.float32) * (-1) ** torch.arange(w) for w in tree_widths(factors)[1:]
    ]  # 0, -1, 2, -3
    masks = train_masks(adv, factors, levels, 1, width_keep=0.5, width_mode="per_branch")
    assert masks[0].all() and masks[1].all()  # the splits themselves are not width-pruned
    assert all(m.tolist() == [True, False, True, False] for m in masks[2:])  # child 0 beats 1, child 2 beats 3
    with pytest.raises(ValueError, match="width_mode"):
        train_masks(adv, factors, levels, 1, width_keep=0.5, width_mode="middle")


# -- mutation-audit pins ----------------------------------------------------------------------------


def test_an_unknown_fusion_is_refused():
    """A misspelt fusion raises instead of silently falling through to the softmax fusion."""
    factors, log_probs = _one_tree()
    with pytest.raises(ValueError, match="sampler.tree.fusion"):
        fuse_rewards(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=D), tree_widths(factors), log_probs, 1, "max")


def test_softmax_fusion_weights_are_float64_for_float32_log_probs():
    """The sampler's float32 edge log-probs are cast to the rewards' float64 before the softmax."""
    widths = tree_widths(split_factors(1, [0], [2]))  # 1, 2
    log_probs = [torch.tensor([0.1, 0.7], dtype=torch.float32)]
    leaves = torch.tensor([1.0, 2.0], dtype=D)
    root = fuse_rewards(leaves, widths, log_probs, 1, "softmax")[0]
    expected = (torch.softmax(log_probs[0].double(), dim=0) * leaves).sum()
    torch.testing.assert_close(root, expected.reshape(1), rtol=0, atol=1e-15)


def test_a_depth_with_a_tiny_spread_gets_zero_advantage():
    """Depth rewards (0, 1e-7): unbiased std 7.1e-8 < 1e-6 counts as no signal (not +-0.6 of noise)."""
    widths = tree_widths(split_factors(1, [0], [2]))
    lps = [torch.zeros(2, dtype=D)]
    (adv,) = depthwise_advantages(fuse_rewards(torch.tensor([0.0, 1e-7], dtype=D), widths, lps, 1), 1)
    assert torch.equal(adv, torch.zeros(2))


def test_width_pruning_gives_the_odd_edge_to_the_worst_half():
    """keep = int(3/8 * 8) = 3 edges: the best one (0.9) and the two worst (-1.0, -0.2)."""
    adv = [torch.tensor([0.1, 0.5, 0.3, -0.2, 0.0, 0.9, -1.0, 0.2])]
    (mask,) = width_prune_masks(adv, [0], 1, 0.375)
    assert mask.tolist() == [False, False, False, True, False, True, True, False]


def test_per_branch_keep_count_rounds_down():
    """fraction 0.6 of 3 children keeps int(1.8) = 1 child per branch, the best."""
    (mask,) = branch_prune_masks([torch.tensor([0.2, 0.9, 0.5, 0.4, -0.1, 0.3])], [0], 3, 0.6)
    assert mask.tolist() == [False, True, False, True, False, False]


def test_prune_until_is_exclusive_and_stop_depth_is_honoured():
    """Pruning stops at iteration == prune_until; an explicit stop_depth replaces the last split as the
    sliding window's stop."""
    factors = split_factors(5, [0, 1], [2])  # last split at step 1
    levels = torch.full((5,), 0.7, dtype=D)
    adv = [torch.arange(w, dtype=torch.float32) for w in tree_widths(factors)[1:]]
    still = train_masks(adv, factors, levels, 1, iteration=4, depth_prune=[2], prune_until=5)
    assert not still[1].any()
    free = train_masks(adv, factors, levels, 1, iteration=5, depth_prune=[2], prune_until=5)
    assert all(m.all() for m in free)
    # window {4}, one depth per iteration: stops at depth 3 (stop_depth) instead of depth 1 (the last split)
    masks = train_masks(adv, factors, levels, 1, iteration=10, depth_prune=[4], slide_every=1, stop_depth=3)
    assert [bool(m.any()) for m in masks] == [True, True, False, True, True]
    default = train_masks(adv, factors, levels, 1, iteration=10, depth_prune=[4], slide_every=1)
    assert [bool(m.any()) for m in default] == [False, True, True, True, True]


def test_chunked_tree_rollout_uses_the_split_noise_scale():
    """``split_noise_scale`` reaches the tree sampler: split steps record it, other steps record 1."""
    from flowrl.tree.rollouts import chunked_tree_rollout

    class Zero:
        def velocity(self, x, sigma, cond):
            return torch.zeros_like(x)

    factors = split_factors(3, [1], [2])
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0], dtype=D)
    tree = chunked_tree_rollout(
        Zero(),
        {"c": torch.zeros(1, 2)},
        torch.randn(1, 4, generator=torch.Generator().manual_seed(0)),
        sigmas,
        torch.full((3,), 0.7, dtype=D),
        factors,
        chunk_size=2,
        split_noise_scale=0.5,
        generator=torch.Generator().manual_seed(1),
    )
    assert tree.noise_scales.tolist() == [1.0, 0.5, 1.0]
