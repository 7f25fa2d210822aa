"""One iteration's rollouts: the rollout kinds in one table, and one path that builds the batch.

An objective names what it trains on (``Objective.rollout``); :func:`rollout_kind` maps that
(and ``sampler.solver: tree`` for solver objectives) to an entry of :data:`ROLLOUTS`, which says
how to sample and how to turn rewards into advantages. :func:`collect_rollouts` is the single
path for every kind: draw the initial noise, sample with the objective's sampling adapter while
finished chunks are decoded and scored, compute advantages and build the
:class:`~flowrl.objectives.base.RolloutBatch`.

Random draws from the run's generator happen in a fixed order (initial noise, then a random SDE
window, then the step noises), so a seed reproduces a run exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ..advantages.group import AdvantageStats
from ..config import SamplerConfig
from ..models.adapter import Cond, ModelAdapter, select_cond
from ..objectives.base import RankRows, RolloutBatch
from ..policy.lora import use_adapter
from ..prompts.batch import PromptBatch
from ..rewards import RewardOutput
from ..samplers.rollout import sde_noise_levels
from ..samplers.tree import TreeRollout, select_trees
from ..samplers.types import Trajectory
from ..samplers.windows import progressive_window_start, random_window_start, window_noise_levels
from ..tree.rollouts import TreeBatch, TreeSpec, chunked_tree_rollout, edge_advantages, tree_levels
from .chunked import ChunkHook, chunked_rollout, chunked_solve
from .owned import OwnedRows, gathered_rewards, owned_prompts, row_cond
from .scoring import RolloutScorer

AdvantageFn = Callable[[dict[str, Tensor], Tensor, list[str]], tuple[Tensor, Tensor, AdvantageStats]]
"""``(reward components {name: (B,)}, group_ids (B,), prompts) -> (advantages (B,), keep (B,), stats)``."""


@dataclass(frozen=True)
class RolloutContext:
    """What one iteration's rollout needs from the training loop, passed explicitly.

    Attributes:
        model: the policy (adapter stack) that samples.
        sampling_adapter: the LoRA adapter that samples ("default", or e.g. DiffusionNFT's "old").
        sampler: the ``sampler`` config section (steps, SDE, windows, chunk size, tree).
        sigmas: (T + 1,) the rollout's sigma grid.
        latent_shape: latent shape without the batch dimension.
        device: where latents live (noise is drawn on the CPU generator and moved).
        generator: the run's CPU generator.
        iteration: the iteration being collected (windows and pruning schedules depend on it).
        scorer: ``prompts -> RolloutScorer`` for this iteration (inline, thread or process).
        advantages: the group advantage function (:data:`AdvantageFn`).
        advantage_clip: ``advantage.clip``, for a tree's depth-wise advantages.
        tree: the validated tree geometry; None when the run has no tree rollouts.
        solver_levels: (T,) Flow-SDE levels of ``sampler.solver: sde_window``
            (:func:`~flowrl.rollouts.chunked.sigma_window_levels`); None for other solvers.
        owners: (B,) int64, the rank that owns each row of the global batch (several processes,
            :mod:`flowrl.rollouts.owned`); None = one process, every row is this one's.
        rank: this process's rank (with ``owners``).
        gather_rows: all-gather of every rank's owned rows into global order, (b, ...) -> (B, ...);
            needed with ``owners``.
        initial_noise: (B, *latent_shape) initial noise to use instead of drawing it from the run's
            generator (Sol-RL regenerates explored seeds, :mod:`flowrl.solrl.pipeline`); None = draw.
    """

    model: ModelAdapter
    sampling_adapter: str
    sampler: SamplerConfig
    sigmas: Tensor
    latent_shape: tuple[int, ...]
    device: torch.device
    generator: torch.Generator
    iteration: int
    scorer: Callable[[PromptBatch], RolloutScorer]
    advantages: AdvantageFn
    advantage_clip: float
    tree: TreeSpec | None = None
    solver_levels: Tensor | None = None
    owners: Tensor | None = None
    rank: int = 0
    gather_rows: Callable[[Tensor], Tensor] | None = None
    initial_noise: Tensor | None = None

    @property
    def owned(self) -> Tensor | None:
        """(B,) bool: the rows this rank samples, scores, trains and holds in memory; None on one process."""
        return None if self.owners is None else self.owners == self.rank

    def noise(self, rows: int) -> Tensor:
        """(rows, *latent_shape) initial noise: ``initial_noise`` when given, else from the run's generator.

        Raises:
            ValueError: ``initial_noise`` holds another number of rows.
        """
        if self.initial_noise is None:
            return torch.randn((rows, *self.latent_shape), generator=self.generator).to(self.device)
        shape = (rows, *self.latent_shape)
        if self.initial_noise.shape != shape:
            raise ValueError(f"initial_noise has shape {tuple(self.initial_noise.shape)}; the rollout needs {shape}")
        return self.initial_noise.to(self.device)


class Rollout(NamedTuple):
    """What a rollout kind sampled.

    Attributes:
        samples: (B, ...) clean final latents (a tree's leaves).
        trajectory: stored SDE transitions (kind "sde"), else None.
        tree: the sampled trees (kinds "tree" and "tree_leaves"), else None.
    """

    samples: Tensor
    trajectory: Trajectory | None = None
    tree: TreeRollout | None = None


class Scored(NamedTuple):
    """Advantages of one iteration's samples.

    Attributes:
        advantages: (B,) on the model's device.
        keep: (B,) bool, False for samples of dropped groups.
        tree: the :class:`~flowrl.tree.rollouts.TreeBatch` for edge-trained objectives, else None.
        info: tensors to log (``zero_std_groups``, tree edge counts).
        plan_tree: on one rank of several, the global trees' :class:`TreeBatch` without node latents
            (``tree`` is then the rank's); None otherwise.
    """

    advantages: Tensor
    keep: Tensor
    tree: TreeBatch | None
    info: dict[str, Tensor]
    plan_tree: TreeBatch | None = None


def iteration_levels(ctx: RolloutContext) -> Tensor:
    """Per-step noise levels (T,) of this iteration's SDE rollout.

    Noise on every step but the last, or only in an SDE window (random, progressive or fixed; MixGRPO /
    Flow-GRPO-Fast).
    """
    s = ctx.sampler
    if s.window == "none":
        return sde_noise_levels(s.num_steps, s.noise_level)
    if s.window == "fixed":
        start = s.window_start
    elif s.window == "random":
        start = random_window_start(s.num_steps, s.window_size, *s.window_range, generator=ctx.generator)
    else:
        start = progressive_window_start(ctx.iteration, s.num_steps, s.window_size, s.window_shift_every)
    return window_noise_levels(s.num_steps, s.noise_level, start, s.window_size)


def sample_sde(ctx: RolloutContext, cond: Cond, rows: int, on_chunk: ChunkHook) -> Rollout:
    """Stored SDE transitions with log-probs (``sampler.sde``), chunk by chunk."""
    s = ctx.sampler
    x_init = ctx.noise(rows)
    traj = chunked_rollout(
        ctx.model,
        cond,
        x_init,
        ctx.sigmas,
        iteration_levels(ctx),
        chunk_size=s.chunk_size,
        generator=ctx.generator,
        sde=s.sde,
        on_chunk=on_chunk,
        store=ctx.owned,
    )
    return Rollout(traj.latents[:, -1], trajectory=traj)


def sample_solver(ctx: RolloutContext, cond: Cond, rows: int, on_chunk: ChunkHook) -> Rollout:
    """Clean samples from ``sampler.solver`` (Euler, Heun, DPM-Solver++ or an SDE window)."""
    s = ctx.sampler
    x_init = ctx.noise(rows)
    samples = chunked_solve(
        ctx.model,
        cond,
        x_init,
        ctx.sigmas,
        solver=s.solver,
        chunk_size=s.chunk_size,
        noise_levels=ctx.solver_levels,
        generator=ctx.generator,
        on_chunk=on_chunk,
        store=ctx.owned,
    )
    return Rollout(samples)


def sample_tree(ctx: RolloutContext, cond: Cond, rows: int, on_chunk: ChunkHook) -> Rollout:
    """One tree per prompt (``rows`` = trees x leaves).

    The leaves are reported chunk by chunk at the end, so async scoring modes split their scoring with
    the worker. On one rank of several only its trees are kept (``ctx.owned``: a rank owns whole trees),
    and the chunks reported are rows of its leaves, as the chunked samplers report their stored rows.
    """
    s, spec = ctx.sampler, ctx.tree
    num_trees = rows // spec.leaves
    store = None if ctx.owned is None else ctx.owned.reshape(num_trees, -1)[:, 0]
    roots = ctx.noise(num_trees)
    levels = tree_levels(spec, None if s.window == "none" else iteration_levels(ctx), s.noise_level)
    tree = chunked_tree_rollout(
        ctx.model,
        tree_cond(cond, spec, num_trees),
        roots,
        ctx.sigmas,
        levels,
        spec.factors,
        chunk_size=s.chunk_size,
        split_noise_scale=s.tree.split_noise_scale,
        sde=s.sde,
        generator=ctx.generator,
        store=store,
    )
    leaves = tree.leaves
    for start in range(0, leaves.shape[0], s.chunk_size):
        on_chunk(slice(start, min(start + s.chunk_size, leaves.shape[0])), leaves[start : start + s.chunk_size])
    return Rollout(leaves, tree=tree)


def tree_cond(cond: Cond, spec: TreeSpec, num_trees: int) -> Cond:
    """Conditioning of the trees (one row per tree) from the samples' (consecutive leaves per tree)."""
    return select_cond(cond, torch.arange(num_trees) * spec.leaves)


def group_advantages(
    ctx: RolloutContext, rollout: Rollout, prompts: PromptBatch, cond: Cond, scored: RewardOutput
) -> Scored:
    """Per-prompt-group advantages of the samples (``advantage`` config)."""
    adv, keep, stats = ctx.advantages(scored.components, prompts.group_ids, prompts.texts)
    return Scored(adv, keep, None, {"zero_std_groups": torch.tensor(float(stats.zero_std_groups))})


def tree_edge_advantages(
    ctx: RolloutContext, rollout: Rollout, prompts: PromptBatch, cond: Cond, scored: RewardOutput
) -> Scored:
    """Depth-wise advantages of every tree edge and the pruning masks (BranchGRPO).

    The per-sample advantages are the leaves' (for logging), every leaf kept. On one rank of several
    the rollout holds the rank's trees: the edge log-probs of every tree are all-gathered (reward
    fusion reads them), the advantages and masks computed for every tree, and the rank's
    :class:`TreeBatch` cut from them; the global one (without node latents) is ``Scored.plan_tree``.
    """
    leaves, spec, tree = rollout.samples, ctx.tree, rollout.tree
    num_trees = len(prompts.texts) // spec.leaves
    if ctx.owners is not None:
        log_probs = [ctx.gather_rows(lp).to(lp.device) for lp in tree.log_probs]
        tree = tree._replace(nodes=[], log_probs=log_probs, num_trees=num_trees)
    tb = edge_advantages(
        tree,
        scored.total.to(leaves.device),
        tree_cond(cond, spec, leaves.shape[0] // spec.leaves),
        spec,
        ctx.sampler.tree,
        clip=ctx.advantage_clip,
        iteration=ctx.iteration,
        chunk_size=ctx.sampler.chunk_size,
    )
    info = {
        "zero_std_groups": torch.tensor(float((tb.advantages[-1].reshape(num_trees, -1) == 0).all(1).sum())),
        "tree/edges": torch.tensor(float(sum(m.numel() for m in tb.train))),
        "tree/trained_edges": torch.tensor(float(sum(int(m.sum()) for m in tb.train))),
    }
    keep = torch.ones(len(prompts.texts), dtype=torch.bool, device=leaves.device)
    if ctx.owners is None:
        return Scored(tb.advantages[-1], keep, tb, info)
    return Scored(tb.advantages[-1], keep, rank_trees(tb, rollout.tree, ctx.owned), info, plan_tree=tb)


def rank_trees(tb: TreeBatch, tree: TreeRollout, owned: Tensor) -> TreeBatch:
    """The rank's trees of the global :class:`TreeBatch` ``tb``: its ``tree`` (nodes, edge log-probs), its edges' rest.

    Args:
        tb: the trees of the global batch (advantages, masks, node rewards of every tree).
        tree: the rank's sampled trees.
        owned: (B,) bool, the rank's rows (whole trees).
    """
    trees = owned.reshape(tb.rollout.num_trees, -1)[:, 0]
    return tb._replace(
        rollout=tree,
        advantages=[select_trees(a, trees) for a in tb.advantages],
        train=[select_trees(m, trees) for m in tb.train],
        node_rewards=[select_trees(r, trees) for r in tb.node_rewards],
    )


class RolloutKind(NamedTuple):
    """How one kind of rollout samples and how its rewards become advantages."""

    sample: Callable[[RolloutContext, Cond, int, ChunkHook], Rollout]
    advantages: Callable[[RolloutContext, Rollout, PromptBatch, Cond, RewardOutput], Scored]


ROLLOUTS: dict[str, RolloutKind] = {
    "sde": RolloutKind(sample_sde, group_advantages),  # Flow-GRPO, SAGE-GRPO
    "solver": RolloutKind(sample_solver, group_advantages),  # DiffusionNFT, AWM
    "tree": RolloutKind(sample_tree, tree_edge_advantages),  # BranchGRPO, SAGE-GRPO with objective.tree
    "tree_leaves": RolloutKind(sample_tree, group_advantages),  # solver objectives with sampler.solver: tree
}


def rollout_kind(objective_rollout: str, solver: str) -> str:
    """The :data:`ROLLOUTS` key for an objective's ``rollout`` and ``sampler.solver``.

    Raises:
        ValueError: an objective rollout kind the loop does not know.
    """
    if objective_rollout == "solver" and solver == "tree":
        return "tree_leaves"
    if objective_rollout not in ("sde", "solver", "tree"):
        raise ValueError(f"objective rollout {objective_rollout!r} is not one of 'sde', 'solver', 'tree'")
    return objective_rollout


def collect_rollouts(
    ctx: RolloutContext, kind: str, prompts: PromptBatch, cond: Cond
) -> tuple[RolloutBatch, dict[str, Tensor]]:
    """Sample, decode + score, compute advantages and build the batch, for every rollout kind.

    On one rank of several (``ctx.owners``), the model runs and the rewards are computed only on
    the owned rows; the rewards of every rank are all-gathered before the advantages, so every
    rank computes the global advantages and ``keep`` (:mod:`flowrl.rollouts.owned`). The batch then
    holds only the rank's rows (whole trees for tree rollouts), with the global rewards, advantages,
    ``keep`` and trees in ``batch.rows`` (:class:`~flowrl.objectives.base.RankRows`).

    Args:
        ctx: this iteration's rollout context.
        kind: a :data:`ROLLOUTS` key (:func:`rollout_kind`).
        prompts: the iteration's prompts (each repeated ``prompts.group_size`` times), all B rows.
        cond: conditioning of the rows the rank holds: the B samples on one process, the owned rows
            (``ctx.owned``) on one rank of several.

    Returns:
        (the :class:`RolloutBatch`, tensors to log: ``zero_std_groups``, ``reward/<name>``, tree counts,
        ``rollout/held_mb`` (:func:`held_megabytes`), ``rollout/placeholder_calls`` under a sharded model).
    """
    entry = ROLLOUTS[kind]
    logged: dict[str, Tensor] = {}
    if ctx.owners is None:
        rollout, images, scored = _sample_and_score(ctx, entry, prompts, cond, ctx.scorer(prompts))
    else:
        rollout, images, scored, view = _sample_and_score_owned(ctx, entry, prompts, cond)
        if view.lockstep:
            logged["rollout/placeholder_calls"] = torch.tensor(float(view.placeholders))
    adv = entry.advantages(ctx, rollout, prompts, cond, scored)
    batch = RolloutBatch(
        prompts.texts,
        prompts.group_ids,
        cond,
        rollout.samples,
        rollout.trajectory,
        ctx.sigmas,
        images.cpu(),
        scored.total.cpu(),
        adv.advantages,
        adv.keep,
        ctx.sampler.chunk_size,
        tree=adv.tree,
    )
    if ctx.owners is not None:
        batch = _rank_batch(batch, ctx.owned, prompts, adv.plan_tree)
    logged["rollout/held_mb"] = torch.tensor(held_megabytes(batch))
    return batch, {**adv.info, **logged, **{f"reward/{k}": v for k, v in scored.components.items()}}


def held_megabytes(batch: RolloutBatch) -> float:
    """MiB this rank's batch holds in per-row tensors: conditioning, samples, trajectories, images, tree nodes.

    Counted by storage, so a view (a trajectory's last latents as the samples) counts once.
    """
    tensors = [*batch.cond.values(), batch.samples, batch.images]
    if batch.trajectory is not None:
        tensors += [batch.trajectory.latents, batch.trajectory.log_probs]
    if batch.tree is not None:
        tensors += [*batch.tree.rollout.nodes, *batch.tree.rollout.log_probs]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / 2**20


def _rank_batch(batch: RolloutBatch, owned: Tensor, prompts: PromptBatch, plan_tree: TreeBatch | None) -> RolloutBatch:
    """A batch's per-row fields cut to the rank's rows (the rollout's are already); the global ones in ``rows``."""
    mine = owned.to(batch.advantages.device)
    local = owned_prompts(prompts, owned)
    return batch._replace(
        prompts=local.texts,
        group_ids=local.group_ids,
        rewards=batch.rewards[owned],
        advantages=batch.advantages[mine],
        keep=batch.keep[mine],
        rows=RankRows(owned, batch.keep, batch.rewards, batch.advantages, plan_tree),
    )


def _sample_and_score(
    ctx: RolloutContext, entry: RolloutKind, prompts: PromptBatch, cond: Cond, scorer: RolloutScorer
) -> tuple[Rollout, Tensor, RewardOutput]:
    """Sample every row while finished chunks are scored: (rollout, images (B, ...), rewards)."""
    with scorer:
        with use_adapter(ctx.model.transformer, ctx.sampling_adapter):
            rollout = entry.sample(ctx, cond, len(prompts.texts), scorer.submit)  # chunk k scored while k + 1 samples
        images, scored = scorer.result(rollout.samples)
    return rollout, images, scored


def _sample_and_score_owned(
    ctx: RolloutContext, entry: RolloutKind, prompts: PromptBatch, cond: Cond
) -> tuple[Rollout, Tensor, RewardOutput, OwnedRows]:
    """:func:`_sample_and_score` on one rank: the model and the rewards see only the owned rows.

    The samplers run over the global batch with the index conditioning of :func:`row_cond` and keep
    the rank's rows (``ctx.owned``). Returns the rollout and the images of the rank's rows
    (whole trees), the global rewards (all-gathered) and the model view, which counted the calls.
    Under a sharded model the rank ends with placeholder calls up to the busiest rank's count
    (:meth:`OwnedRows.finish`).
    """
    owned, owners = ctx.owned, ctx.owners
    view = OwnedRows(ctx.model, cond, ctx.rank, int(owners.max()) + 1)
    with ctx.scorer(owned_prompts(prompts, owned)) as scorer:
        with use_adapter(ctx.model.transformer, ctx.sampling_adapter):
            rollout = entry.sample(
                replace(ctx, model=view), row_cond(owners, ctx.rank, ctx.device), len(prompts.texts), scorer.submit
            )
            view.finish()
        images, scored = scorer.result(rollout.samples)
    return rollout, images, gathered_rewards(scored, ctx.gather_rows), view
