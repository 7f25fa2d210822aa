"""GDPO, median baseline, NaN handling and the stat tracker against hand-computed values."""

import math

import pytest
import torch

from flowrl.advantages import StatTracker, clip_advantages, compute_advantages, gdpo_advantages, group_advantages, median_advantages

F64 = torch.float64


def test_gdpo_by_hand():
    components = {"r1": torch.tensor([1.0, 3.0, 0.0, 0.0]), "r2": torch.tensor([2.0, 2.0, 1.0, 5.0])}
    weights = {"r1": 1.0, "r2": 0.5}
    groups = torch.tensor([0, 0, 1, 1])
    adv, keep, stats, per = gdpo_advantages(components, weights, groups, eps=0.0)
    # r1: group 0 -> (-1, 1), group 1 constant -> 0; r2: group 0 constant -> 0, group 1 -> (-1, 1)
    torch.testing.assert_close(per["r1"], torch.tensor([-1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(per["r2"], torch.tensor([0.0, 0.0, -1.0, 1.0]))
    # combined (-1, 1, -0.5, 0.5), renormalised by its population std sqrt(0.625)
    torch.testing.assert_close(adv, torch.tensor([-1.2649111, 1.2649111, -0.6324555, 0.6324555]))
    assert keep.all() and stats.zero_std_groups == 0
    raw, _, _, _ = gdpo_advantages(components, weights, groups, eps=0.0, renormalize=False)
    torch.testing.assert_close(raw, torch.tensor([-1.0, 1.0, -0.5, 0.5]))


def test_gdpo_needs_every_weight():
    with pytest.raises(ValueError, match="weight for every reward"):
        gdpo_advantages({"a": torch.zeros(2)}, {"b": 1.0}, torch.tensor([0, 0]))


def test_median_baseline_by_hand():
    r = torch.tensor([1.0, 2.0, 10.0, 4.0, 4.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, keep, _ = median_advantages(r, g, std="none", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 8.0, 0.0, 0.0, 1.0]))
    assert keep.all()


def test_nan_means_not_applicable():
    r = torch.tensor([1.0, math.nan, 3.0, 5.0, 5.0, math.nan, math.nan, math.nan])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    adv, keep, stats = group_advantages(r, g, std="none", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    assert keep.tolist() == [True, False, True, False, False, False, False, False]
    assert stats.num_groups == 3 and stats.zero_std_groups == 2  # constant group and all-NaN group


def test_compute_advantages_dispatch_and_nan_sum():
    comps = {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([math.nan, 1.0])}
    w = {"a": 1.0, "b": 2.0}
    g = torch.tensor([0, 0])
    adv, keep, _ = compute_advantages(comps, w, g, method="sum", std="none", eps=0.0)
    # totals: 1 + 0 (NaN counts 0) = 1 and 3 + 2 = 5 -> mean 3 -> (-2, 2)
    torch.testing.assert_close(adv, torch.tensor([-2.0, 2.0]))
    median, _, _ = compute_advantages(comps, w, g, method="median", std="none", eps=0.0)
    torch.testing.assert_close(median, torch.tensor([0.0, 4.0]))  # lower median of (1, 5) is 1
    with pytest.raises(ValueError, match="advantage.method"):
        compute_advantages(comps, w, g, method="mean")


def test_clip():
    torch.testing.assert_close(clip_advantages(torch.tensor([-9.0, 0.5, 9.0]), 5.0), torch.tensor([-5.0, 0.5, 5.0]))
    with pytest.raises(ValueError):
        clip_advantages(torch.zeros(1), 0.0)


def test_stat_tracker_history_and_state():
    tracker = StatTracker(buffer_size=4, min_count=2, eps=0.0)
    adv = tracker.update(["a", "a", "b"], torch.tensor([1.0, 3.0, 10.0]))
    # "a" has 2 rewards -> its own mean 2, std 1; "b" has 1 < min_count -> batch mean 14/3, std 3.8586
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 1.3821]), atol=1e-4, rtol=0)
    state = tracker.state_dict()
    twin = StatTracker()
    twin.load_state_dict(state)
    assert twin.history == {"a": [1.0, 3.0], "b": [10.0]}
    tracker.update(["a", "a", "a"], torch.tensor([5.0, 7.0, 9.0]))
    assert tracker.history["a"] == [3.0, 5.0, 7.0, 9.0]  # buffer keeps the last 4
    tracker.clear()
    assert tracker.history == {}
