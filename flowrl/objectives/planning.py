"""Planning shared by the objectives: which micro-batches form each optimizer step.

Plain functions of the rollout batch, so any objective can plan like Flow-GRPO (every stored
transition once) or like BranchGRPO (every trained tree edge once) without borrowing another
objective's object.

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025.
    Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
    Models", arXiv 2509.06040, 2025.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..samplers.sde_steps import has_density
from .base import Microbatch, RolloutBatch, chunk_indices, split_even

if TYPE_CHECKING:  # the tree batch type only, as in .base
    from ..tree.rollouts import TreeBatch


class EdgeMicrobatch(NamedTuple):
    """Parents (b,) of one tree frontier chunk at one step, and the loss weight ``n_mb / E``.

    ``noise`` is unused (kept for the trainer's micro-batch shape).
    """

    index: Tensor
    step: int
    noise: Tensor | None = None
    weight: float = 1.0


def chunk_children(parents: Tensor, factor: int, train: Tensor) -> tuple[Tensor, Tensor]:
    """Trained children of ``parents`` at a step with ``factor`` children per node.

    Args:
        parents: (b,) parent indices into the step's nodes.
        factor: children per node at the step.
        train: (b_all * factor,) bool, False for pruned edges.

    Returns:
        (children (c,) index into the step's edges, local (c,) row of each child's parent in
        ``parents``).
    """
    children = (parents[:, None] * factor + torch.arange(factor)).reshape(-1)
    local = torch.arange(len(parents)).repeat_interleave(factor)
    keep = train[children]
    return children[keep], local[keep]


def trained_parents(tb: TreeBatch, step: int) -> Tensor:
    """(N * n_t,) bool: the parent nodes at ``step`` with at least one trained (unpruned) child edge."""
    return tb.train[step].reshape(-1, int(tb.rollout.factors[step])).any(dim=1)


def kept_chunks(batch: RolloutBatch) -> list[Tensor]:
    """The global batch's rollout chunks (row indices) that hold at least one kept row.

    Global on every rank of several (``batch.size``, ``batch.global_keep``), so all plan alike.
    """
    keep = batch.global_keep
    return [c for c in chunk_indices(batch.size, batch.chunk_size) if keep[c].any()]


def chunk_noise(batch: RolloutBatch, idx: Tensor, generator: torch.Generator) -> Tensor:
    """Fresh noise (n, ...) for the rows ``idx`` of the global batch that ``batch`` holds, on the samples' device.

    The noise of all ``len(idx)`` rows is drawn, so the generator advances as on one process; a rank's
    batch (``batch.rows``) keeps only its own rows' (n of them, in global order), so the plan holds
    the fresh noise of ``B / W`` rows on each of W ranks (see :class:`~flowrl.objectives.base.Microbatch`).
    """
    noise = torch.randn((len(idx), *batch.samples.shape[1:]), generator=generator)
    if batch.rows is not None:
        noise = noise[batch.rows.owned[idx]]
    return noise.to(batch.samples.device)


def plan_megabytes(plan: list[list[Microbatch]]) -> float:
    """MiB of fresh noise a plan's micro-batches hold (0 for plans that draw none)."""
    return sum(mb.noise.nbytes for group in plan for mb in group if mb.noise is not None) / 2**20


def weigh_by_kept(groups: list[list[Microbatch]], keep: Tensor) -> list[list[Microbatch]]:
    """Weigh each micro-batch ``n * kept_mb / kept_step`` so an optimizer step's loss is the mean over its kept rows.

    A flat objective's micro-batch loss is the mean over its chunk's kept rows and the loop divides it by
    the step's ``n`` micro-batches; without these weights a chunk with fewer kept rows (the batch's tail
    when ``sampler.chunk_size`` does not divide it, or one holding dropped rows) would weigh as much as a
    full one, and the update would depend on the chunk size. With them every chunk size gives the update
    of one chunk holding the whole batch.

    Args:
        groups: the micro-batches of each optimizer step (every one holds a kept row: :func:`kept_chunks`).
        keep: (B,) ``keep`` of the global batch (``batch.global_keep``), so every rank weighs alike.

    Returns:
        The same micro-batches with ``weight`` set.
    """
    weighed = []
    for group in groups:
        kept = [int(keep[mb.index].sum()) for mb in group]
        total = max(sum(kept), 1)
        weighed.append([mb._replace(weight=len(group) * k / total) for mb, k in zip(group, kept)])
    return weighed


def plan_transitions(batch: RolloutBatch, generator: torch.Generator, updates: int) -> list[list[Microbatch]]:
    """Every (chunk, stochastic step) pair of the stored trajectories once (Flow-GRPO).

    A stochastic step is one with a density (:func:`~flowrl.samplers.sde_steps.has_density`): noise
    level above 0 and a transition std above 0 (CPS's step to sigma 0 has none).

    Chunks and steps are in random order, split evenly into ``updates`` optimizer steps.
    Chunks whose samples are all dropped (``keep`` False) are skipped; the others are weighed by
    their kept rows (:func:`weigh_by_kept`).
    """
    traj = batch.trajectory
    steps = torch.nonzero(has_density(traj.sde, traj.sigmas, traj.noise_levels)).flatten().tolist()
    chunks = kept_chunks(batch)
    order = torch.randperm(len(chunks), generator=generator).tolist()
    mbs = []
    for c in order:
        for k in torch.randperm(len(steps), generator=generator).tolist():
            mbs.append(Microbatch(chunks[c], steps[k]))
    return weigh_by_kept(split_even(mbs, updates), batch.global_keep) if mbs else []


def plan_tree_edges(batch: RolloutBatch, generator: torch.Generator, updates: int) -> list[list[EdgeMicrobatch]]:
    """Every (step, frontier chunk) with a trained edge once, in random order (BranchGRPO).

    The micro-batches are split evenly into ``updates`` optimizer steps; each micro-batch weighs
    ``n_mb / E`` so a step's loss is the mean over its E trained edges. A micro-batch holds every parent of
    its chunk, also those whose children are all pruned: the model sees the rows the rollout evaluated
    together (the first ratio is exactly 1); only trained children enter the loss. A chunk with no trained
    edge is left out.

    Raises:
        ValueError: the batch holds no tree (the objective's rollout is not a tree).
    """
    tb = batch.global_tree
    if tb is None:
        raise ValueError(
            "tree-edge planning needs tree rollouts (batch.tree is None); set the objective's rollout to 'tree'"
        )
    tr, mbs, edges = tb.rollout, [], []
    for t in range(len(tb.train)):
        f, parents_n = int(tr.factors[t]), tr.num_trees * tr.width(t)
        has_child = trained_parents(tb, t)
        for chunk in chunk_indices(parents_n, tb.chunk_size):
            if bool(has_child[chunk].any()):
                mbs.append(EdgeMicrobatch(chunk, t))
                edges.append(len(chunk_children(chunk, f, tb.train[t])[0]))
    if not mbs:
        return []
    order = torch.randperm(len(mbs), generator=generator).tolist()
    groups = split_even(order, updates)
    return [[mbs[i]._replace(weight=len(g) / sum(edges[j] for j in g)) for i in g] for g in groups]


def owned_microbatch(
    mb: Microbatch | EdgeMicrobatch, batch: RolloutBatch, owned: Tensor | None
) -> Microbatch | EdgeMicrobatch | None:
    """The part of a planned micro-batch on this rank's rows; None when it has none.

    Several processes plan over the global batch with the same draws (every rank the same plan),
    and each rank runs only the micro-batches, or the parts of a tree frontier chunk, it owns. A
    batch that holds only the rank's rows (``batch.rows``) gets indices into those rows (the owned
    rows, or a tree step's owned parent nodes, in global order); a global-shaped batch keeps global
    indices. A tree edge micro-batch keeps its weight ``n_mb / E``, so the parts' losses add up to the whole
    micro-batch's.

    Args:
        mb: a micro-batch of ``objective.plan`` (sample rows, or a tree's parents at one step).
        batch: the iteration's batch.
        owned: (B,) bool rows of the rank (this one's, or another's to count its micro-batches);
            None = one process (everything owned). A rank's batch (``batch.rows``) planned only its
            own rows' noise, which the part keeps as it is.
    """
    if owned is None:
        return mb
    tree = batch.global_tree
    if tree is not None:  # the rows are the step's parent nodes; a rank owns whole trees
        tr = tree.rollout
        held = owned.reshape(tr.num_trees, -1)[:, 0][tr.trees(mb.step)]
    else:
        held = owned
    mask = held[mb.index]
    if not bool(mask.any()):
        return None
    whole = bool(mask.all())
    if whole and batch.rows is None:
        return mb
    index = mb.index if whole else mb.index[mask]
    if batch.rows is not None:  # the plan's noise is already the rank's rows' (chunk_noise)
        return mb._replace(index=(held.long().cumsum(0) - 1)[index])  # the rank's rows, numbered in global order
    return mb._replace(index=index, noise=None if mb.noise is None else mb.noise[mask.to(mb.noise.device)])
