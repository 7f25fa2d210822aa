"""GDPO, median baseline, NaN handling, clipping and the stat tracker against hand-computed values.

Inputs are float64; the library returns float32 advantages (the objectives' contract), so values
are compared after ``.double()`` with a float32-sized tolerance. Every expected number is derived
by hand in the comments (sqrt written out), never by calling the library.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowrl.advantages.group import (
    clip_advantages,
    compute_advantages,
    gdpo_advantages,
    group_advantages,
    group_stats,
    median_advantages,
    weighted_sum,
    weighted_sum_advantages,
)
from flowrl.advantages.tracker import StatTracker

NAN = math.nan


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-6)


# -- GDPO -------------------------------------------------------------------------------------------


def test_gdpo_by_hand():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = {"a": t(0, 1, 1, 2, 4, NAN), "b": t(1, 1, 4, 3, 3, 3)}
    weights = {"a": 1.0, "b": 0.5}
    adv, keep, stats, per = gdpo_advantages(rewards, weights, groups, eps=0.0, renormalize=False)
    # a, group 0: mean 2/3, var 2/9, std sqrt(2)/3 -> (-sqrt2, 1/sqrt2, 1/sqrt2); group 1: (2, 4) -> (-1, 1), NaN -> 0
    close(per["a"], [-1.4142136, 0.7071068, 0.7071068, -1.0, 1.0, 0.0])
    # b, group 0: mean 2, var 2, std sqrt2 -> (-1/sqrt2, -1/sqrt2, sqrt2); group 1 constant -> 0
    close(per["b"], [-0.7071068, -0.7071068, 1.4142136, 0.0, 0.0, 0.0])
    # a + b/2: (-5/4 sqrt2, sqrt2/4, sqrt2, -1, 1, 0); sample 5 has no signal in either reward
    close(adv, [-1.7677670, 0.3535534, 1.4142136, -1.0, 1.0, 0.0])
    assert keep.tolist() == [True, True, True, True, True, False]
    assert stats.num_groups == 2 and stats.zero_std_groups == 0 and stats.not_applicable == 0 and stats.kept == 5
    # renormalised: kept mean 0; population std sqrt((25/8 + 1/8 + 2 + 1 + 1) / 5) = sqrt(1.45) = 1.2041595
    adv, keep, stats, _ = gdpo_advantages(rewards, weights, groups, eps=0.0)
    close(adv, [-1.4680505, 0.2936101, 1.1744404, -0.8304548, 0.8304548, 0.0])
    assert math.isclose(stats.std, 1.2041595, abs_tol=1e-6)


def test_gdpo_keeps_combinations_that_the_sum_collapses():
    # binary rewards, groups of 2: group 0 has sums (0, 1), group 1 has sums (0, 2)
    groups = torch.tensor([0, 0, 1, 1])
    rewards = {"r1": t(0, 1, 0, 1), "r2": t(0, 0, 0, 1)}
    weights = {"r1": 1.0, "r2": 1.0}
    summed, _, _ = weighted_sum_advantages(rewards, weights, groups, std="group", eps=0.0)
    close(summed, [-1.0, 1.0, -1.0, 1.0])  # GRPO on the sum: both groups collapse to (-1, 1)
    raw, _, _, _ = gdpo_advantages(rewards, weights, groups, eps=0.0, renormalize=False)
    close(raw, [-1.0, 1.0, -2.0, 2.0])  # r1 gives (-1, 1) in both; r2 is constant in group 0, (-1, 1) in group 1
    # population std of (-1, 1, -2, 2) is sqrt(10/4) = 1.5811388
    adv, _, _, _ = gdpo_advantages(rewards, weights, groups, eps=0.0)
    close(adv, [-0.6324555, 0.6324555, -1.2649111, 1.2649111])


def test_gdpo_needs_every_weight():
    with pytest.raises(ValueError, match="weight for every reward"):
        gdpo_advantages({"a": t(0, 1)}, {"b": 1.0}, torch.tensor([0, 0]))


# -- median baseline --------------------------------------------------------------------------------


def test_median_baseline_by_hand():
    r = t(1, 2, NAN, 10, 4, 6, 5, 9)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, keep, stats = median_advantages(r, g, std="none", eps=0.0)
    # group 0 valid (1, 2, 10): median 2, pivot = sample 1; group 1 (4, 5, 6, 9): midpoint 5.5
    close(adv, [-1.0, 0.0, 0.0, 8.0, -1.5, 0.5, -0.5, 3.5])
    assert keep.tolist() == [True, False, False, True, True, True, True, True]
    assert stats.kept == 6 and stats.not_applicable == 1
    adv, _, _ = median_advantages(r, g, std="group", eps=0.0)
    # group 0: mean 13/3, var 438/27, std 4.0276819; group 1: mean 6, var 3.5, std 1.8708287
    close(adv, [-0.2482818, 0.0, 0.0, 1.9862541, -0.8017837, 0.2672612, -0.2672612, 1.8708287])


def test_median_of_two_is_symmetric():
    adv, keep, _ = median_advantages(t(0, 1), torch.tensor([3, 3]), std="none", eps=0.0)
    close(adv, [-0.5, 0.5])
    assert keep.all()


# -- NaN and zero variance ---------------------------------------------------------------------------


def test_nan_means_not_applicable():
    r = t(1, NAN, 3, 5, NAN, NAN, NAN)
    g = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    stats = group_stats(r, g)
    close(stats.count, [2, 1, 0])
    close(stats.mean, [2, 5, 0])
    close(stats.var, [1, 0, 0])
    adv, keep, s = group_advantages(r, g, std="none", eps=0.0)
    close(adv, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert keep.tolist() == [True, False, True, False, False, False, False]
    # one-valid-reward group and all-NaN group are zero-variance
    assert (s.num_groups, s.zero_std_groups, s.num_samples, s.kept, s.not_applicable) == (3, 2, 7, 2, 4)
    # global std over the finite rewards (1, 3, 5) only: sqrt(8/3) = 1.6329932
    adv, _, s = group_advantages(r, g, std="global", eps=0.0)
    close(adv, [-0.6123724, 0.0, 0.6123724, 0.0, 0.0, 0.0, 0.0])
    assert math.isclose(s.std, 1.6329932, abs_tol=1e-6)


def test_zero_variance_counting():
    r = t(2, 2, 2, 0, 1, 5, 0.3, 0.1 + 0.2)
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    adv, keep, stats = group_advantages(r, g, std="none", eps=0.0)
    assert (stats.num_groups, stats.zero_std_groups, stats.kept) == (3, 2, 3)
    assert math.isclose(stats.zero_std_ratio, 2 / 3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 2
    close(adv, [0, 0, 0, -2, -1, 3, 0, 0])


def test_infinite_reward_raises():
    with pytest.raises(ValueError, match="inf"):
        group_advantages(t(0, math.inf), torch.tensor([0, 0]))


# -- clipping ---------------------------------------------------------------------------------------


def test_clip():
    close(clip_advantages(t(-9, 0.5, 9), 5.0), [-5.0, 0.5, 5.0])
    assert clip_advantages(t(1.0), 5.0).dtype == torch.float64
    for bad in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match="clip"):
            clip_advantages(t(1.0), bad)
    adv, _, stats = group_advantages(t(0, 10, 0, 1), torch.tensor([0, 0, 1, 1]), std="none", eps=0.0, clip=2.0)
    close(adv, [-2.0, 2.0, -0.5, 0.5])  # raw (-5, 5, -0.5, 0.5)
    assert stats.clipped == 2


# -- weighted sum and dispatch ----------------------------------------------------------------------


def test_weighted_sum_counts_nan_as_zero():
    total = weighted_sum({"a": t(1, NAN, NAN), "b": t(2, 3, NAN)}, {"a": 1.0, "b": -0.5})
    assert total[:2].tolist() == [0.0, -1.5] and math.isnan(total[2])


def test_compute_advantages_dispatch():
    g = torch.tensor([0, 0, 0, 1])
    comps = {"a": t(1, 3, NAN, 0), "b": t(NAN, 1, 4, 2)}
    w = {"a": 1.0, "b": 2.0}
    # totals (1, 5, 8, 4); group 1 has a single sample -> dropped
    adv, keep, _ = compute_advantages(comps, w, g, method="sum", std="none", eps=0.0)
    close(adv, [1 - 14 / 3, 5 - 14 / 3, 8 - 14 / 3, 0.0])
    assert keep.tolist() == [True, True, True, False]
    direct, _, _ = weighted_sum_advantages(comps, w, g, std="none", eps=0.0)
    close(direct, adv.double().tolist())
    adv, keep, _ = compute_advantages(comps, w, g, method="median", std="none", eps=0.0)
    close(adv, [-4.0, 0.0, 3.0, 0.0])  # median 5, its sample is the pivot
    assert keep.tolist() == [True, False, True, False]
    # gdpo: a (1, 3, -) -> (-1, 1, 0); b (-, 1, 4) -> (0, -1, 1); a + 2b = (-1, -1, 2); batch std sqrt2
    adv, keep, _ = compute_advantages(comps, w, g, method="gdpo", eps=0.0)
    close(adv, [-0.7071068, -0.7071068, 1.4142136, 0.0])
    assert keep.tolist() == [True, True, True, False]


def test_compute_advantages_rejects_unknown_method_and_std():
    comps, w, g = {"a": t(0, 1)}, {"a": 1.0}, torch.tensor([0, 0])
    with pytest.raises(ValueError, match="advantage.method") as err:
        compute_advantages(comps, w, g, method="mean")  # type: ignore[arg-type]
    assert "\n" not in str(err.value) and "'mean'" in str(err.value)
    with pytest.raises(ValueError, match="advantage.std"):
        compute_advantages(comps, w, g, std="batch")  # type: ignore[arg-type]


# -- stat tracker -----------------------------------------------------------------------------------


def test_stat_tracker_history_and_min_count_fallback():
    tracker = StatTracker(buffer_size=3, min_count=2, eps=0.0)
    adv = tracker.update(["a", "a", "b", "c"], t(1, 3, 10, NAN))
    # a: own history (1, 3) -> mean 2, std 1; b: 1 < min_count -> batch (1, 3, 10): mean 14/3, std sqrt(134/9)
    close(adv, [-1.0, 1.0, 1.3821895, 0.0])
    assert tracker.history == {"a": [1.0, 3.0], "b": [10.0]}  # NaN is not recorded
    adv = tracker.update(["b", "b", "a"], t(20, 30, 5))
    # b: (10, 20, 30) mean 20 std sqrt(200/3); a: (1, 3, 5) mean 3 std sqrt(8/3)
    close(adv, [0.0, 1.2247449, 1.2247449])
    adv = tracker.update(["a"], t(7))
    assert tracker.history["a"] == [3.0, 5.0, 7.0]  # the buffer keeps the last 3
    close(adv, [1.2247449])  # (7 - 5) / sqrt(8/3)
    tracker.clear()
    assert tracker.history == {}


def test_stat_tracker_state_round_trip():
    tracker = StatTracker(buffer_size=4, min_count=2, eps=1e-6)
    tracker.update(["x", "y", "x"], t(0.5, 2.0, 1.5))
    state = json.loads(json.dumps(tracker.state_dict()))
    twin = StatTracker()
    twin.load_state_dict(state)
    assert (twin.buffer_size, twin.min_count, twin.eps) == (4, 2, 1e-6)
    assert twin.history == {"x": [0.5, 1.5], "y": [2.0]}
    batch = (["y", "x", "y"], t(3, 4, 5))
    torch.testing.assert_close(twin.update(*batch), tracker.update(*batch))
    assert twin.history == tracker.history
    with pytest.raises(ValueError, match="missing"):
        twin.load_state_dict({"history": {}})
    with pytest.raises(ValueError, match="min_count"):
        StatTracker(buffer_size=2, min_count=3)


# -- mutation-audit pins ----------------------------------------------------------------------------


def test_zero_variance_threshold_is_relative_to_the_mean():
    """A spread of 1e-5 is noise on rewards near 1000 (dropped) but signal near 0 (kept).

    Pins the ``1 + mean**2`` scale of the zero-variance test, and that ``clipped`` counts only kept samples.
    """
    r = t(1000, 1000 + 1e-5, 0, 1e-5)
    g = torch.tensor([0, 0, 1, 1])
    # both groups: var 2.5e-11; threshold 1e-12 * (1 + 1e6) for group 0, 1e-12 * (1 + 2.5e-11) for group 1
    adv, keep, stats = group_advantages(r, g, std="none", eps=0.0, clip=1e-6)
    assert keep.tolist() == [False, False, True, True]
    assert (stats.zero_std_groups, stats.kept) == (1, 2)
    close(adv, [0.0, 0.0, -1e-6, 1e-6])  # raw +-5e-6 in both groups, clipped to 1e-6
    assert stats.clipped == 2  # the dropped group's raw +-5e-6 also exceeds the clip but is not counted


def test_clip_count_excludes_advantages_exactly_at_the_bound():
    """``clipped`` counts advantages the clip changed: |A| == clip is not clipped."""
    adv, _, stats = group_advantages(t(0, 2, 0, 6), torch.tensor([0, 0, 1, 1]), std="none", eps=0.0, clip=1.0)
    close(adv, [-1.0, 1.0, -1.0, 1.0])  # raw (-1, 1, -3, 3)
    assert stats.clipped == 2


def test_weighted_sum_rejects_non_vector_rewards():
    """Rewards must be (B,): a (B, 1) column of the same shape for every reward is refused."""
    with pytest.raises(ValueError, match=r"\(B,\)"):
        weighted_sum({"a": torch.zeros(3, 1), "b": torch.zeros(3, 1)}, {"a": 1.0, "b": 1.0})


def test_compute_advantages_clips_every_method():
    """``clip`` reaches the median and GDPO paths of :func:`compute_advantages`, not only the sum."""
    g = torch.tensor([0, 0, 0, 1])
    comps = {"a": t(1, 3, NAN, 0), "b": t(NAN, 1, 4, 2)}
    w = {"a": 1.0, "b": 2.0}
    adv, _, stats = compute_advantages(comps, w, g, method="median", std="none", eps=0.0, clip=2.0)
    close(adv, [-2.0, 0.0, 2.0, 0.0])  # raw (-4, 0, 3, 0), see test_compute_advantages_dispatch
    assert stats.clipped == 2
    adv, _, stats = compute_advantages(comps, w, g, method="gdpo", eps=0.0, clip=1.0)
    close(adv, [-0.7071068, -0.7071068, 1.0, 0.0])  # raw (-1, -1, 2) / sqrt2
    assert stats.clipped == 1


def test_stat_tracker_refuses_bad_input_and_bad_state():
    """``update`` refuses +-inf and a reward count that differs from the prompt count; ``load_state_dict``
    refuses settings that violate 1 <= min_count <= buffer_size."""
    tracker = StatTracker(buffer_size=2, min_count=1)
    with pytest.raises(ValueError, match="inf"):
        tracker.update(["a", "b"], t(0, math.inf))
    with pytest.raises(ValueError, match="len\\(prompts\\)"):
        tracker.update(["a", "b"], t(0, 1, 2))
    assert tracker.history == {}
    for min_count, buffer_size in ((0, 2), (3, 2)):
        with pytest.raises(ValueError, match="min_count <= buffer_size"):
            tracker.load_state_dict({"buffer_size": buffer_size, "min_count": min_count, "eps": 0.0, "history": {}})


def test_stat_tracker_state_restores_eps():
    """A loaded state brings its own eps (here 1, not the default 1e-6) into the advantages."""
    twin = StatTracker()
    twin.load_state_dict({"buffer_size": 4, "min_count": 2, "eps": 1.0, "history": {"x": [0.0, 2.0]}})
    assert twin.eps == 1.0
    # x: (0, 2, 4) mean 2, population std sqrt(8/3) = 1.6329932 -> (4 - 2) / (1.6329932 + 1)
    close(twin.update(["x"], t(4)), [0.7595918])
