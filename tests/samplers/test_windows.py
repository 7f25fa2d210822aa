"""Tests for flowrl.samplers.windows: SDE windows for Flow-GRPO-Fast and MixGRPO."""

from __future__ import annotations

import pytest
import torch

from flowrl.samplers import (
    progressive_window_start,
    random_window_start,
    rollout,
    sde_noise_levels,
    window_noise_levels,
)

torch.set_num_threads(1)


def test_window_noise_levels_by_hand() -> None:
    levels = window_noise_levels(10, 0.7, 3, 2)
    expected = torch.tensor([0, 0, 0, 0.7, 0.7, 0, 0, 0, 0, 0], dtype=torch.float64)
    assert levels.dtype == torch.float64 and torch.equal(levels, expected)
    assert torch.equal(window_noise_levels(4, 0.5, 0, 4), torch.full((4,), 0.5, dtype=torch.float64))
    assert torch.equal(window_noise_levels(6, 0.9, 2, 3), sde_noise_levels(6, 0.9, [2, 3, 4]))


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 0.7, 9, 2), "start"),
        ((10, 0.7, -1, 2), "start"),
        ((10, 0.7, 0, 0), "size"),
        ((10, 0.7, 0, 11), "size"),
        ((0, 0.7, 0, 1), "num_steps"),
    ],
)
def test_window_noise_levels_bounds(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        window_noise_levels(*args)
    assert "\n" not in str(info.value)


def test_window_levels_drive_rollout() -> None:
    levels = window_noise_levels(5, 0.7, 1, 2)
    traj = rollout(
        lambda x, s: -x,
        torch.ones(2, 3),
        torch.linspace(1, 0, 6, dtype=torch.float64),
        levels,
        generator=torch.Generator().manual_seed(0),
    )
    assert torch.equal(traj.log_probs[:, [0, 3, 4]], torch.zeros(2, 3))
    assert bool((traj.log_probs[:, 1:3] != 0).all())


def test_random_window_start_range_and_determinism() -> None:
    g = torch.Generator().manual_seed(0)
    starts = [random_window_start(10, 3, 0, 5, g) for _ in range(400)]
    assert set(starts) == {0, 1, 2}  # uniform over lo .. hi - size
    assert abs(starts.count(0) - 400 / 3) < 50
    again = [random_window_start(10, 3, 0, 5, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert again == [again[0]] * 3
    assert {random_window_start(10, 2, 4, 6, g) for _ in range(20)} == {4}


@pytest.mark.parametrize("args", [(10, 3, 0, 2), (10, 3, 5, 4), (10, 3, -1, 5), (10, 3, 8, 11), (10, 0, 0, 5)])
def test_random_window_start_bounds(args: tuple) -> None:
    with pytest.raises(ValueError) as info:
        random_window_start(*args)
    assert "\n" not in str(info.value)


def test_progressive_schedule_by_hand() -> None:
    # T = 6, size 3: valid starts 0..3; move every 2 iterations; wrap to 0 after start 3.
    starts = [progressive_window_start(it, 6, 3, 2) for it in range(12)]
    assert starts == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1]
    # stride 2: starts 0, 2 (4 would not fit 6 - 3 = 3), then wrap.
    assert [progressive_window_start(it, 6, 3, 1, stride=2) for it in range(5)] == [0, 2, 0, 2, 0]
    # MixGRPO-like: 25 steps, window 4, 25 iterations per position.
    assert progressive_window_start(0, 25, 4, 25) == 0
    assert progressive_window_start(24, 25, 4, 25) == 0
    assert progressive_window_start(25, 25, 4, 25) == 1
    assert progressive_window_start(21 * 25 + 3, 25, 4, 25) == 21
    assert progressive_window_start(22 * 25, 25, 4, 25) == 0
    assert progressive_window_start(5, 4, 4, 1) == 0  # a window covering every step never moves


@pytest.mark.parametrize(
    "kwargs", [dict(iteration=-1), dict(shift_every=0), dict(stride=0), dict(size=7), dict(size=0)]
)
def test_progressive_bounds(kwargs: dict) -> None:
    args = dict(iteration=0, num_steps=6, size=3, shift_every=2, stride=1) | kwargs
    with pytest.raises(ValueError) as info:
        progressive_window_start(**args)
    assert "\n" not in str(info.value)
