"""Process-level settings: torch threads and seeding."""

from __future__ import annotations

import os

import torch


def default_threads() -> int:
    """1 thread on machines with <= 2 cores (steadier under host contention), else half the cores."""
    cores = os.cpu_count() or 1
    return 1 if cores <= 2 else max(1, cores // 2)


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count and return it.

    Raises:
        ValueError: for a non-positive count.
    """
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"train.threads must be >= 1 (or null for the default); got {threads}")
    torch.set_num_threads(n)
    return n


def seeded_noise(shape: tuple[int, ...], seeds: list[int]) -> torch.Tensor:
    """One standard-normal tensor per seed, stacked: (len(seeds), *shape).

    Each sample's noise depends only on its own seed, not on the batch it is drawn in.
    """
    out = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        out.append(torch.randn(shape, generator=gen))
    return torch.stack(out)
