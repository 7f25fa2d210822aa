"""Process-level settings (flowrl/runtime.py): the default thread count, its bounds and per-seed noise."""

from __future__ import annotations

import os

import pytest
import torch

from flowrl.runtime import THREADS_PER_CORE, check_threads, default_threads, seeded_noise


@pytest.mark.parametrize(
    ("cores", "local", "expected"),
    [(1, "1", 1), (2, "1", 1), (3, "1", 1), (4, "1", 2), (8, "1", 4), (8, "2", 2), (8, "3", 1), (8, "8", 1)],
)
def test_default_threads_follow_the_cores_and_the_local_processes(
    monkeypatch: pytest.MonkeyPatch, cores: int, local: str, expected: int
) -> None:
    """1 thread up to 2 cores, else half the cores, shared by LOCAL_WORLD_SIZE processes (at least 1 each)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert default_threads() == expected


def test_thread_counts_are_bounded_by_one_and_the_oversubscription_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 and negative counts are refused; THREADS_PER_CORE x cores is the largest count accepted."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=">= 1"):
            check_threads(bad)
    assert check_threads(1) == 1
    assert check_threads(THREADS_PER_CORE * 2) == THREADS_PER_CORE * 2
    with pytest.raises(ValueError, match=f"use at most {THREADS_PER_CORE * 2}"):
        check_threads(THREADS_PER_CORE * 2 + 1)


def test_seeded_noise_is_one_generator_per_seed() -> None:
    """Row i is torch.randn from a generator seeded with seeds[i] alone, whatever the batch around it."""
    shape = (2, 3)
    noise = seeded_noise(shape, [5, 7, 5])
    assert noise.shape == (3, *shape)
    for row, seed in zip(noise, [5, 7, 5]):
        assert torch.equal(row, torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    assert torch.equal(seeded_noise(shape, [7])[0], noise[1])
