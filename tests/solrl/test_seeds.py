"""Sol-RL's derived seeds: range, stability and the independence of the selection stream (pure functions, CPU)."""

from __future__ import annotations

import torch

from flowrl.solrl.seeds import SEED_BITS, candidate_seeds, derived_seed, selection_generator


def test_derived_seed_is_a_stable_62_bit_value():
    """sha256-derived, so a fixed value across machines and versions, and below 2**62 (torch's seed limit)."""
    assert derived_seed("solrl-selection", 7, 3) == 2524927655054374026
    seeds = [derived_seed("x", i) for i in range(200)]
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert max(seeds) >= 2 ** (SEED_BITS - 2)  # the top bits are used, not a narrower range


def test_selection_generator_depends_on_the_iteration_and_not_on_the_candidate_stream():
    """Each iteration's ``random`` rule draws differently, and not from the candidate seeds' stream."""
    first = selection_generator(7, 3).initial_seed()
    assert first == selection_generator(7, 3).initial_seed()
    assert first != selection_generator(7, 4).initial_seed()
    assert first != selection_generator(8, 3).initial_seed()
    assert first != derived_seed("solrl-candidates", 7, 3)
    draw = torch.randperm(16, generator=selection_generator(7, 3))
    assert not torch.equal(draw, torch.randperm(16, generator=selection_generator(7, 4)))
    assert candidate_seeds(7, 3, 1, 4).shape == (1, 4)
