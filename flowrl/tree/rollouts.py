"""Tree rollouts with a model adapter, and their collection for the training loop.

The pure tree sampler is :func:`flowrl.samplers.tree.tree_rollout`; this module feeds it the
model (the frontier of each depth in ``sampler.chunk_size`` chunks, each node with its tree's
conditioning), decodes and scores the leaves and builds the :class:`RolloutBatch`:

- objectives with ``rollout = "tree"`` (BranchGRPO) get fused node rewards, depth-wise edge
  advantages and the pruning masks in ``batch.tree``;
- solver objectives (DiffusionNFT, AWM) with ``sampler.solver: tree`` get the leaves as their
  clean ``samples``, one tree per prompt = one group, with the usual group advantages.

Group = one tree per prompt: ``prompts.group_size`` must equal the number of leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..config import Config, ConfigError
from ..policy.lora import use_adapter
from ..models.adapter import Cond, ModelAdapter, select_cond
from ..objectives.base import RolloutBatch
from ..samplers.tree import TreeRollout, split_factors, tree_rollout, tree_widths
from .advantages import depthwise_advantages, fuse_rewards
from .pruning import train_masks


class TreeBatch(NamedTuple):
    """What an edge-trained objective needs from one iteration's trees.

    Attributes:
        rollout: the sampled trees (nodes per depth, edge log-probs).
        advantages: T tensors, ``advantages[t]`` (N * n_{t+1},) of the edges drawn at step t.
        train: T bool tensors, False for pruned edges (and ODE steps).
        node_rewards: T + 1 tensors of fused node rewards (for logging).
        cond: conditioning of the N trees (one row per tree).
        chunk_size: the frontier chunk the rollout used (training reuses it: ratio exactly 1).
    """

    rollout: TreeRollout
    advantages: list[Tensor]
    train: list[Tensor]
    node_rewards: list[Tensor]
    cond: Cond
    chunk_size: int


def uses_tree(cfg: Config, objective: Any) -> bool:
    """True when this run collects tree rollouts."""
    return objective.rollout == "tree" or (objective.rollout == "solver" and cfg.sampler.solver == "tree")


@torch.no_grad()
def chunked_tree_rollout(
    model: ModelAdapter,
    cond: Cond,
    roots: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    factors: Tensor,
    *,
    chunk_size: int,
    split_noise_scale: float = 1.0,
    sde: str = "flow",
    generator: torch.Generator | None = None,
) -> TreeRollout:
    """:func:`~flowrl.samplers.tree.tree_rollout` with the model, frontier chunk by chunk.

    Args:
        model: the sampling policy.
        cond: conditioning of the N trees (one row per tree).
        roots: (N, ...) initial noise.
        sigmas, noise_levels, factors: the grid, (T,) levels and (T,) children per step.
        chunk_size: nodes per model call.
        split_noise_scale: std multiplier at split steps.
        sde: SDE step name.
        generator: RNG for the step noises.

    Returns:
        :class:`TreeRollout`.
    """

    def velocity(x: Tensor, sigma: Tensor, trees: Tensor) -> Tensor:
        parts = []
        for start in range(0, x.shape[0], chunk_size):
            idx = slice(start, start + chunk_size)
            parts.append(model.velocity(x[idx], sigma[idx], select_cond(cond, trees[idx])).float())
        return torch.cat(parts)

    return tree_rollout(
        velocity, roots, sigmas, noise_levels, factors, split_noise_scale=split_noise_scale, sde=sde, generator=generator
    )


class TreeCollector:
    """Collects one iteration of tree rollouts for the trainer.

    Args:
        cfg: the run config (``sampler.tree`` and ``sampler.sde`` / ``noise_level``).
        edge_trained: True for ``rollout = "tree"`` objectives (fusion, depth-wise advantages,
            pruning); False for solver objectives that only take the leaves.

    Raises:
        ConfigError: a bad split schedule, or ``prompts.group_size`` != leaves per tree.
    """

    def __init__(self, cfg: Config, edge_trained: bool):
        s, t = cfg.sampler, cfg.sampler.tree
        try:
            self.factors = split_factors(s.num_steps, t.split_steps, t.factors)
        except ValueError as err:
            raise ConfigError(f"config: {err}") from None
        self.leaves = tree_widths(self.factors)[-1]
        if cfg.prompts.group_size != self.leaves:
            raise ConfigError(
                f"config: prompts.group_size ({cfg.prompts.group_size}) must equal the leaves per tree ({self.leaves} from "
                f"sampler.tree.split_steps/factors); set prompts.group_size={self.leaves}"
            )
        self.noise_levels = torch.full((s.num_steps,), float(s.noise_level), dtype=torch.float64)
        if s.noise_level <= 0:
            raise ConfigError("config: sampler.noise_level must be > 0 for tree rollouts (split steps need noise)")
        self.cfg, self.edge_trained = cfg, edge_trained

    def levels(self, trainer: Any) -> Tensor:
        """This iteration's (T,) noise levels: SDE on every step, or with ``sampler.window`` the
        mixed ODE/SDE tree (BranchGRPO): SDE inside the iteration's window and at every split
        step, Euler ODE elsewhere (those edges have no density and are not trained)."""
        if self.cfg.sampler.window == "none":
            return self.noise_levels
        levels = trainer.sde_levels().clone()
        levels[self.factors > 1] = float(self.cfg.sampler.noise_level)
        return levels

    def collect(self, trainer: Any, prompts: Any, cond: Cond) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Grow one tree per prompt, score the leaves, compute advantages.

        Args:
            trainer: the :class:`~flowrl.trainer.Trainer` (model, reward, generator, iteration).
            prompts: the iteration's :class:`~flowrl.prompts.sets.PromptBatch` (K consecutive copies
                of each prompt, K = leaves per tree).
            cond: conditioning of the B = N * K samples.

        Returns:
            (RolloutBatch with ``samples`` = leaves and ``tree`` set for edge-trained
            objectives, info tensors for logging).
        """
        cfg, s = self.cfg, self.cfg.sampler
        num_trees = len(prompts.texts) // self.leaves
        tree_cond = select_cond(cond, torch.arange(num_trees) * self.leaves)
        shape = getattr(trainer, "latent_shape", None) or trainer.model.latent_shape(*trainer.resolution)
        roots = torch.randn((num_trees, *shape), generator=trainer.generator).to(getattr(trainer, "device", "cpu"))
        with use_adapter(trainer.model.transformer, trainer.objective.sampling_adapter):
            tree = chunked_tree_rollout(
                trainer.model, tree_cond, roots, trainer.sigmas, self.levels(trainer), self.factors, chunk_size=s.chunk_size,
                split_noise_scale=s.tree.split_noise_scale, sde=s.sde, generator=trainer.generator,
            )
        leaves = tree.leaves
        with trainer.scorer(prompts) as scorer:  # leaves come at the end: async modes split their scoring with the worker
            for start in range(0, leaves.shape[0], s.chunk_size):  # decode + score the leaves chunk by chunk
                scorer.submit(slice(start, min(start + s.chunk_size, leaves.shape[0])), leaves[start : start + s.chunk_size])
            images, scored = scorer.result(leaves)
        info = {f"reward/{k}": v for k, v in scored.components.items()}
        tree_batch = None
        if self.edge_trained:
            tree_batch, adv, keep = self._edge_advantages(tree, scored.total.to(leaves.device), tree_cond, trainer.iteration)
            trained = sum(int(m.sum()) for m in tree_batch.train)
            info.update({
                "zero_std_groups": torch.tensor(float((tree_batch.advantages[-1].reshape(num_trees, -1) == 0).all(1).sum())),
                "tree/edges": torch.tensor(float(sum(m.numel() for m in tree_batch.train))),
                "tree/trained_edges": torch.tensor(float(trained)),
            })
        else:
            adv, keep, stats = trainer.advantages(scored.components, prompts.group_ids)
            info["zero_std_groups"] = torch.tensor(float(stats.zero_std_groups))
        batch = RolloutBatch(
            prompts.texts, prompts.group_ids, cond, leaves, None, trainer.sigmas, images.cpu(), scored.total.cpu(), adv, keep, s.chunk_size,
            tree=tree_batch,
        )
        return batch, info

    def _edge_advantages(self, tree: TreeRollout, rewards: Tensor, cond: Cond, iteration: int) -> tuple[TreeBatch, Tensor, Tensor]:
        """Fusion, depth-wise advantages and pruning masks; leaf advantages for logging."""
        t, n = self.cfg.sampler.tree, tree.num_trees
        node_rewards = fuse_rewards(rewards.double(), tree_widths(self.factors), tree.log_probs, n, t.fusion)
        advantages = depthwise_advantages(node_rewards, n, clip=self.cfg.advantage.clip)
        masks = train_masks(
            advantages, self.factors, tree.noise_levels, n, iteration=iteration, depth_prune=t.depth_prune,
            slide_every=t.depth_prune_slide_every, stop_depth=t.depth_prune_stop, width_keep=t.width_keep,
            width_mode=t.width_mode, prune_until=t.prune_until,
        )
        masks = [m.cpu() for m in masks]  # index bookkeeping stays on the CPU (CUDA tensors take CPU indices)
        batch = TreeBatch(tree, advantages, masks, node_rewards, cond, self.cfg.sampler.chunk_size)
        return batch, advantages[-1], torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
