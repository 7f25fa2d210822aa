"""Training objectives: the algorithm-specific part of the single training loop."""

from .base import Microbatch, Objective, RolloutBatch, chunk_indices, split_even
from .flow_grpo import FlowGRPO, clipped_policy_loss, gaussian_mean_kl

OBJECTIVES = {"flow_grpo": FlowGRPO}

__all__ = [
    "FlowGRPO",
    "Microbatch",
    "OBJECTIVES",
    "Objective",
    "RolloutBatch",
    "chunk_indices",
    "clipped_policy_loss",
    "gaussian_mean_kl",
    "split_even",
]
