"""Training objectives: the algorithm-specific part of the single training loop."""

from .awm import AWM
from .base import Microbatch, Objective, RolloutBatch, chunk_indices, split_even
from .branch_grpo import BranchGRPO
from .diffusion_nft import DiffusionNFT
from .flow_grpo import FlowGRPO, clipped_policy_loss, gaussian_mean_kl
from .sage_grpo import SageGRPO

OBJECTIVES = {
    "flow_grpo": FlowGRPO,
    "diffusion_nft": DiffusionNFT,
    "awm": AWM,
    "branch_grpo": BranchGRPO,
    "sage_grpo": SageGRPO,
}

__all__ = [
    "AWM",
    "BranchGRPO",
    "DiffusionNFT",
    "FlowGRPO",
    "Microbatch",
    "OBJECTIVES",
    "Objective",
    "RolloutBatch",
    "SageGRPO",
    "chunk_indices",
    "clipped_policy_loss",
    "gaussian_mean_kl",
    "split_even",
]
