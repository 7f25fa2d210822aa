"""The reward / reader / test partition of the real digits is disjoint, complete and stratified."""

import numpy as np
import pytest

from flowrl.rewards.digit_data import PARTS, digit_part


def test_parts_are_disjoint_complete_and_stratified():
    found = {p: digit_part(p) for p in PARTS}
    idx = np.concatenate([found[p][0] for p in PARTS])
    assert len(idx) == 1797 and len(np.unique(idx)) == 1797
    for part, share in (("reward", 0.50), ("reader", 0.35), ("test", 0.15)):
        _, images, labels = found[part]
        assert images.shape[1:] == (8, 8) and 0.0 <= images.min() and images.max() <= 1.0
        counts = np.bincount(labels, minlength=10)
        assert abs(len(labels) / 1797 - share) < 0.01
        assert counts.min() >= 0.8 * counts.max() * (0.9 if part == "test" else 1.0) - 3
    assert digit_part("reader")[0].tolist() == digit_part("reader")[0].tolist()


def test_unknown_part():
    with pytest.raises(ValueError, match="part must be one of"):
        digit_part("train")
