"""Process-level settings: torch threads and seeding."""

from __future__ import annotations

import os

import torch


def default_threads() -> int:
    """1 thread on machines with <= 2 cores (steadier under host contention), else half the cores.

    Under a launch the half is shared by this machine's processes (``LOCAL_WORLD_SIZE``), at least one each.
    """
    from .distributed import local_world_size

    cores = os.cpu_count() or 1
    total = 1 if cores <= 2 else max(1, cores // 2)
    return max(1, total // local_world_size())


THREADS_PER_CORE = 4
"""``train.threads`` (and ``pretrain-digits --threads``) may oversubscribe the cores at most this many times over."""


def max_threads() -> int:
    """The most torch threads a flowrl process may ask for on this machine: :data:`THREADS_PER_CORE` x the cores."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def check_threads(threads: int | None) -> int:
    """The thread count ``train.threads`` asks for on this machine (None = :func:`default_threads`).

    Raises:
        ValueError: a non-positive count, or more than :data:`THREADS_PER_CORE` x the cores (torch
            would start that many threads per operation until the host's limits are hit).
    """
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"train.threads must be >= 1 (or null for the default); got {threads}")
    if n > max_threads():
        raise ValueError(
            f"train.threads={threads} but this machine has {os.cpu_count() or 1} CPU cores; "
            f"use at most {max_threads()}, or train.threads=null for the default ({default_threads()})"
        )
    return n


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count and return it.

    Raises:
        ValueError: for a non-positive count or one far above the machine's cores (:func:`check_threads`).
    """
    n = check_threads(threads)
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
