"""Tree rollouts with a model adapter: the tree geometry, growth and edge advantages.

The pure tree sampler is :func:`flowrl.samplers.tree.tree_rollout`; this module feeds it the
model (the frontier of each depth in ``sampler.chunk_size`` chunks, each node with its tree's
conditioning), validates the geometry (:func:`tree_spec`) and turns leaf rewards into the
:class:`TreeBatch` an edge-trained objective (BranchGRPO) needs: fused node rewards, depth-wise
edge advantages and the pruning masks. :mod:`flowrl.rollouts.collect` calls it for the "tree"
rollout kinds (edge-trained objectives, and solver objectives on tree leaves).

Group = one tree per prompt: ``prompts.group_size`` must equal the number of leaves.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..config import Config, ConfigError, TreeConfig
from ..models.adapter import Cond, ModelAdapter, select_cond
from ..samplers.sde_steps import has_density
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
    store: Tensor | None = None,
) -> TreeRollout:
    """:func:`~flowrl.samplers.tree.tree_rollout` with the model, frontier chunk by chunk.

    Args:
        model: the sampling policy.
        cond: conditioning of the N trees (one row per tree).
        roots: (N, ...) initial noise.
        sigmas: (T + 1,) the sigma grid.
        noise_levels: (T,) noise level per step.
        factors: (T,) children per node at each step.
        chunk_size: nodes per model call.
        split_noise_scale: std multiplier at split steps.
        sde: SDE step name.
        generator: RNG for the step noises.
        store: (N,) bool, the trees to keep (one rank's of several); None = every tree.

    Returns:
        :class:`TreeRollout` of the stored trees.
    """

    def velocity(x: Tensor, sigma: Tensor, trees: Tensor) -> Tensor:
        parts = []
        for start in range(0, x.shape[0], chunk_size):
            idx = slice(start, start + chunk_size)
            parts.append(model.velocity(x[idx], sigma[idx], select_cond(cond, trees[idx])).float())
        return torch.cat(parts)

    return tree_rollout(
        velocity,
        roots,
        sigmas,
        noise_levels,
        factors,
        split_noise_scale=split_noise_scale,
        sde=sde,
        generator=generator,
        store=store,
    )


class TreeSpec(NamedTuple):
    """The validated tree geometry of a run.

    Attributes:
        factors: (T,) children per node at each step (1 = no split).
        leaves: leaves per tree (= ``prompts.group_size``).
        noise_levels: (T,) float64 ``sampler.noise_level`` on every step (trees without a window).
    """

    factors: Tensor
    leaves: int
    noise_levels: Tensor


def tree_spec(cfg: Config, *, edges: bool = False) -> TreeSpec:
    """The tree geometry from ``sampler.tree``, ``sampler.num_steps`` and ``sampler.noise_level``.

    Args:
        cfg: the run's config.
        edges: the objective trains the tree edges (BranchGRPO's depth-wise advantages), not the leaves.

    Raises:
        ConfigError: a bad split schedule, ``prompts.group_size`` != leaves per tree, no noise, width
            pruning with no step after the last split (nothing it could prune), or, for edges, an
            ``advantage.method`` other than the weighted sum (depth-wise advantages replace it).
    """
    s, t = cfg.sampler, cfg.sampler.tree
    if edges and cfg.advantage.method != "sum":
        raise ConfigError(
            f"config: advantage.method={cfg.advantage.method} does not apply to tree edges, whose advantages are "
            "depth-wise over the fused weighted reward (docs/trees.md); set advantage.method=sum"
        )
    try:
        factors = split_factors(s.num_steps, t.split_steps, t.factors)
    except ValueError as err:
        raise ConfigError(f"config: {err}") from None
    _check_depth_prune(t, s.num_steps)
    if t.width_keep < 1 and t.split_steps and max(t.split_steps) == s.num_steps - 1:
        raise ConfigError(
            f"config: sampler.tree.width_keep={t.width_keep:g} prunes the edges drawn after the last split, but the "
            f"last split (step {s.num_steps - 1}) is the last of sampler.num_steps={s.num_steps}, so nothing would be "
            "pruned; split earlier, raise sampler.num_steps, or set sampler.tree.width_keep=1"
        )
    leaves = tree_widths(factors)[-1]
    if cfg.prompts.group_size != leaves:
        raise ConfigError(
            f"config: prompts.group_size ({cfg.prompts.group_size}) must equal the leaves per tree ({leaves} from "
            f"sampler.tree.split_steps/factors); set prompts.group_size={leaves}"
        )
    if s.noise_level <= 0:
        raise ConfigError("config: sampler.noise_level must be > 0 for tree rollouts (split steps need noise)")
    return TreeSpec(factors, leaves, torch.full((s.num_steps,), float(s.noise_level), dtype=torch.float64))


def _check_depth_prune(tree_cfg: TreeConfig, num_steps: int) -> None:
    """Child depths run 1..T: a pruned depth outside them (that no slide brings in) would prune nothing.

    Raises:
        ConfigError: a depth of 0, or a depth above T without ``depth_prune_slide_every``.
    """
    top = num_steps if tree_cfg.depth_prune_slide_every == 0 else None
    bad = [d for d in tree_cfg.depth_prune if d < 1 or (top is not None and d > top)]
    if bad:
        hint = "" if top is None else " (or slide deeper depths in with sampler.tree.depth_prune_slide_every)"
        raise ConfigError(
            f"config: sampler.tree.depth_prune {bad} are not child depths, which run 1..{num_steps} (depth d = the "
            f"edges drawn at step d - 1), so they would prune nothing; use depths in 1..{num_steps}{hint}"
        )


def tree_levels(spec: TreeSpec, window_levels: Tensor | None, noise_level: float) -> Tensor:
    """This iteration's (T,) noise levels of a tree.

    Without a window (``window_levels`` None) every step is SDE. With ``sampler.window`` the tree
    is mixed ODE/SDE (BranchGRPO): SDE inside the iteration's window and at every split step,
    Euler ODE elsewhere (those edges have no density and are not trained).
    """
    if window_levels is None:
        return spec.noise_levels
    levels = window_levels.clone()
    levels[spec.factors > 1] = float(noise_level)
    return levels


def pruning_options(tree_cfg: TreeConfig) -> dict[str, Any]:
    """The pruning keywords of :func:`~flowrl.tree.pruning.train_masks` from the ``sampler.tree`` section."""
    return {
        "depth_prune": tree_cfg.depth_prune,
        "slide_every": tree_cfg.depth_prune_slide_every,
        "stop_depth": tree_cfg.depth_prune_stop,
        "width_keep": tree_cfg.width_keep,
        "width_mode": tree_cfg.width_mode,
        "prune_until": tree_cfg.prune_until,
    }


def edge_advantages(
    tree: TreeRollout,
    rewards: Tensor,
    cond: Cond,
    spec: TreeSpec,
    tree_cfg: TreeConfig,
    *,
    clip: float,
    iteration: int,
    chunk_size: int,
) -> TreeBatch:
    """Fused node rewards, depth-wise edge advantages and pruning masks of one iteration's trees.

    Args:
        tree: the sampled trees.
        rewards: (N * leaves,) leaf rewards, on the leaves' device.
        cond: conditioning of the N trees (one row per tree).
        spec: the tree geometry.
        tree_cfg: ``sampler.tree`` (fusion, pruning settings).
        clip: ``advantage.clip``.
        iteration: the iteration (sliding depth pruning).
        chunk_size: the frontier chunk the rollout used.

    A non-finite leaf reward (a weighted total that overflowed) gives NaN advantages instead of an error, so
    the update guards skip the iteration as they do for flat rollouts (``train.max_abs_reward``).
    """
    n = tree.num_trees
    finite = bool(torch.isfinite(rewards).all())
    leaf_rewards = rewards.double() if finite else torch.zeros_like(rewards, dtype=torch.float64)
    node_rewards = fuse_rewards(leaf_rewards, tree_widths(spec.factors), tree.log_probs, n, tree_cfg.fusion)
    advantages = depthwise_advantages(node_rewards, n, clip=clip)
    trained_levels = torch.where(has_density(tree.sde, tree.sigmas, tree.noise_levels), tree.noise_levels, 0.0)
    masks = train_masks(advantages, spec.factors, trained_levels, n, iteration=iteration, **pruning_options(tree_cfg))
    masks = [m.cpu() for m in masks]  # index bookkeeping stays on the CPU (CUDA tensors take CPU indices)
    if not finite:  # nothing to train on: the guards see the rewards and these advantages and skip the update
        advantages = [torch.full_like(a, float("nan")) for a in advantages]
    return TreeBatch(tree, advantages, masks, node_rewards, cond, chunk_size)
