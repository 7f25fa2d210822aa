"""Advantages: group-relative normalisers (GRPO, GDPO, MC-GRPO) and the per-prompt tracker (DDPO).

:class:`AdvantageEstimator` is the ``advantage`` config section as the one callable the trainer uses.
"""

from .estimator import ADVANTAGE_METHODS, AdvantageEstimator
from .group import AdvantageStats, compute_advantages
from .tracker import StatTracker, per_prompt_advantages

__all__ = [
    "ADVANTAGE_METHODS",
    "AdvantageEstimator",
    "AdvantageStats",
    "StatTracker",
    "compute_advantages",
    "per_prompt_advantages",
]
