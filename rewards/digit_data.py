"""One fixed, stratified partition of scikit-learn's 1,797 real digits into disjoint parts.

- ``reward``: what the ``digit_correctness`` reward classifier (and any other reward model) may
  train on (50 %);
- ``reader``: what the independent evaluator (``flowrl.models.digits.reader``) trains on (35 %);
  no reward model ever sees it;
- ``test``: held out from both (15 %), for reporting either one's accuracy on real digits.

The partition depends only on this module (stratified by class, ``random_state`` fixed), so every
model that uses it agrees on which image is where.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import numpy as np

Part = Literal["reward", "reader", "test"]
PARTS: tuple[Part, ...] = ("reward", "reader", "test")
_FRACTIONS = {"reward": 0.50, "reader": 0.35, "test": 0.15}
_SEED = 14


@lru_cache(maxsize=1)
def _partition() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits

    target = load_digits().target
    rng = np.random.default_rng(_SEED)
    parts: dict[str, list[int]] = {p: [] for p in PARTS}
    for digit in range(10):
        idx = np.flatnonzero(target == digit)
        idx = idx[rng.permutation(len(idx))]
        n_reward = int(round(_FRACTIONS["reward"] * len(idx)))
        n_reader = int(round(_FRACTIONS["reader"] * len(idx)))
        parts["reward"] += idx[:n_reward].tolist()
        parts["reader"] += idx[n_reward : n_reward + n_reader].tolist()
        parts["test"] += idx[n_reward + n_reader :].tolist()
    return {p: np.sort(np.asarray(v, dtype=np.int64)) for p, v in parts.items()}


def digit_part(part: Part) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The images of one part.

    Args:
        part: "reward", "reader" or "test".

    Returns:
        ``(indices (N,) int64 into load_digits(), images (N, 8, 8) float32 in [0, 1], labels (N,) int64)``.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}; got {part!r}")
    from sklearn.datasets import load_digits

    data = load_digits()
    idx = _partition()[part]
    return idx, (data.images[idx] / 16.0).astype(np.float32), data.target[idx].astype(np.int64)
