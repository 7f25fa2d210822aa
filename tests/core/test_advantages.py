"""Group advantages against hand-computed values (float64)."""

import torch

from flowrl.advantages.group import group_advantages


def test_group_mean_with_global_std():
    r = torch.tensor([1.0, 3.0, 10.0, 14.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    adv, keep, stats = group_advantages(r, g, std="global", eps=0.0)
    global_std = r.std(unbiased=False)
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0], dtype=torch.float64) / global_std
    torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-7)
    assert keep.all() and stats.zero_std_groups == 0 and stats.num_groups == 2


def test_group_std():
    r = torch.tensor([1.0, 3.0, 10.0, 14.0])
    adv, _, _ = group_advantages(r, torch.tensor([0, 0, 1, 1]), std="group", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_zero_variance_groups_are_counted_and_dropped():
    r = torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0, 5.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, keep, stats = group_advantages(r, g)
    assert stats.zero_std_groups == 1
    assert keep.tolist() == [False, False, False, True, True, True]
    assert (adv[:3] == 0).all()
    assert abs(float(adv[3:].sum())) < 1e-5


def test_clip_and_shape_error():
    r = torch.tensor([0.0, 100.0])
    adv, _, _ = group_advantages(r, torch.tensor([0, 0]), std="group", eps=0.0, clip=0.5)
    assert adv.abs().max() == 0.5
    try:
        group_advantages(r, torch.tensor([0]))
    except ValueError as err:
        assert "(B,)" in str(err)
    else:
        raise AssertionError("expected ValueError")
