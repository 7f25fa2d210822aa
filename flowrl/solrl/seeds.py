"""The candidate seeds of Sol-RL's explore stage: a pure function of (base seed, iteration, prompt, candidate).

Stage 1 keeps only ``(seed, reward)``; stage 2 regenerates the kept seeds from exactly the same
initial noise (:func:`flowrl.runtime.seeded_noise`: each sample's noise depends only on its own
seed). The seeds are derived, not drawn from the run's generator, so every rank of a launch and
a resumed run compute the same ones with no extra state to checkpoint.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

SEED_BITS = 62  # below torch.Generator.manual_seed's signed 64-bit limit


def derived_seed(*parts: int | str) -> int:
    """A 62-bit integer from sha256 of the parts (stable across processes, machines and Python versions)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)


def candidate_seeds(base: int, iteration: int, prompts: int, candidates: int) -> Tensor:
    """Seeds of the explored candidates of one iteration: (prompts, candidates) int64.

    Args:
        base: ``solrl.seed`` (``train.seed`` when unset).
        iteration: the iteration being collected (0-based).
        prompts: distinct prompts of the iteration, P.
        candidates: seeds per prompt, N.

    Returns:
        (P, N) int64; entry ``[p, n]`` depends only on ``(base, iteration, N, p, n)``, not on P.
    """
    generator = torch.Generator().manual_seed(derived_seed("solrl-candidates", base, iteration))
    return torch.randint(0, 2**SEED_BITS, (prompts, candidates), generator=generator, dtype=torch.int64)


def selection_generator(base: int, iteration: int) -> torch.Generator:
    """The generator of the ``random`` selection rule for one iteration (the same on every rank)."""
    return torch.Generator().manual_seed(derived_seed("solrl-selection", base, iteration))
