"""Sol-RL's two-stage rollouts: seed selection rules and stage-1 vs stage-2 ranking diagnostics."""

from .diagnostics import extreme_overlap, kendall_tau, spearman_rho
from .selection import SELECTION_RULES, select_seeds

__all__ = ["SELECTION_RULES", "extreme_overlap", "kendall_tau", "select_seeds", "spearman_rho"]
