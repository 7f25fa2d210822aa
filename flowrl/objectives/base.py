"""The objective contract: the algorithm-specific part of the one training loop.

The loop (``flowrl.trainer``) samples, scores and computes advantages; an objective says which
micro-batches make up each optimizer step (``plan``) and what the loss of one micro-batch is
(``loss``). Flow-GRPO trains on stored SDE transitions; forward-process objectives (DiffusionNFT,
AWM) can plug in by planning over clean samples instead.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import torch
from torch import Tensor

from .. import kernels  # noqa: F401 - registers the fused Flow-SDE step for CUDA latents
from ..models.adapter import Cond, ModelAdapter, select_cond
from ..policy.lora import adapters_disabled, use_adapter
from ..samplers.broadcast import batch_view
from ..samplers.types import Trajectory

if TYPE_CHECKING:  # the tree batch type only; objectives do not import the tree package at run time
    from ..tree.rollouts import TreeBatch


class RankRows(NamedTuple):
    """Where one rank's rows sit in the iteration's global batch (several processes).

    A rank keeps only its own rows (samples, trajectories, a tree's nodes, images, conditioning), so
    its memory is that of ``B / W`` rows whatever the number of ranks; the objectives plan over the
    global batch (every rank the same plan, :func:`~flowrl.objectives.planning.owned_microbatch`),
    and the loop logs and checks the global rewards, which every rank holds.

    Attributes:
        owned: (B,) bool, the global rows the batch holds, in global order.
        keep: (B,) bool, ``keep`` of every row of the global batch.
        rewards: (B,) the combined reward of every row.
        advantages: (B,) the advantage of every row.
        tree: the global trees' :class:`~flowrl.tree.rollouts.TreeBatch` without node latents (edge
            log-probs, advantages and pruning masks of every tree, what a plan reads); None for flat
            rollouts.
    """

    owned: Tensor
    keep: Tensor
    rewards: Tensor
    advantages: Tensor
    tree: TreeBatch | None = None


class RolloutBatch(NamedTuple):
    """Everything one iteration collected.

    Attributes:
        prompts: B prompt strings.
        group_ids: (B,) prompt-group index per sample.
        cond: conditioning for the B samples.
        samples: (B, ...) clean final latents (all a forward-process objective needs).
        trajectory: latents (B, T + 1, ...) and log_probs (B, T) for SDE rollouts; None when
            the rollout used a black-box solver.
        sigmas: (T + 1,) the rollout's sigma grid (forward-process objectives draw their
            training sigmas from it).
        images: decoded final samples in [0, 1]: images (B, 3, H, W) or videos (B, F, 3, H, W).
        rewards: (B,) combined reward.
        advantages: (B,) float32.
        keep: (B,) bool, False for samples of zero-variance groups.
        chunk_size: the rollout micro-batch size; training reuses the same chunks so the
            forward pass sees the same batch geometry as sampling (ratio exactly 1).
        tree: for tree rollouts of edge-trained objectives (BranchGRPO), the
            :class:`~flowrl.tree.rollouts.TreeBatch` (nodes, edge log-probs, advantages, pruning
            masks); ``samples`` are then the leaves. None otherwise.
        rows: on one rank of several, where its rows sit in the global batch (:class:`RankRows`):
            every per-row field above (and ``tree``) then holds only the rank's ``b = B / W`` rows
            (whole trees). None on one process.
    """

    prompts: list[str]
    group_ids: Tensor
    cond: Cond
    samples: Tensor
    trajectory: Trajectory | None
    sigmas: Tensor
    images: Tensor
    rewards: Tensor
    advantages: Tensor
    keep: Tensor
    chunk_size: int
    tree: TreeBatch | None = None
    rows: RankRows | None = None

    @property
    def size(self) -> int:
        """``B``: the rows of the global batch (the plan's row indices are below it)."""
        return len(self.prompts) if self.rows is None else len(self.rows.owned)

    @property
    def global_keep(self) -> Tensor:
        """(B,) ``keep`` of every row of the global batch (what a plan reads)."""
        return self.keep if self.rows is None else self.rows.keep

    @property
    def global_tree(self) -> TreeBatch | None:
        """The global trees' :class:`~flowrl.tree.rollouts.TreeBatch` (what a plan reads; no node latents on a rank)."""
        return self.tree if self.rows is None else self.rows.tree

    @property
    def global_rewards(self) -> Tensor:
        """(B,) the combined reward of every row of the global batch, the same on every rank."""
        return self.rewards if self.rows is None else self.rows.rewards

    @property
    def global_advantages(self) -> Tensor:
        """(B,) the advantage of every row of the global batch, the same on every rank."""
        return self.advantages if self.rows is None else self.rows.advantages


class Microbatch(NamedTuple):
    """Sample indices (b,), the step of the sigma grid to train at, optional fresh noise, and the loss weight.

    ``noise`` (n, ...) is drawn in ``plan`` by forward-process objectives, so ``loss`` stays a
    pure function of its inputs. It holds the rows of ``index`` the batch holds: all b of them on
    one process; on a rank of several (``RolloutBatch.rows``) only the rank's own, in global order
    (:func:`~flowrl.objectives.planning.chunk_noise`), so no rank holds the global batch's noise.
    ``weight`` multiplies the micro-batch's loss (a mean over its kept rows):
    :func:`~flowrl.objectives.planning.weigh_by_kept` sets it so that an optimizer step's loss is the
    mean over the step's kept rows whatever ``sampler.chunk_size``.
    """

    index: Tensor
    step: int
    noise: Tensor | None = None
    weight: float = 1.0


ROLLOUT_KINDS = ("sde", "solver", "tree")
"""What an objective trains on: stored SDE transitions with log-probs ("sde"), clean samples of a
black-box solver ("solver") or the edges of branching tree rollouts ("tree"); the loop dispatches
on it through :data:`flowrl.rollouts.collect.ROLLOUTS`."""


class Objective(Protocol):
    """An RL objective plugged into the training loop: everything the loop relies on.

    An objective class subclasses this Protocol explicitly and so inherits the no-op defaults of
    the hooks it does not need, and the trainable "default" adapter for sampling and evaluation;
    the loop calls every hook unconditionally.

    Attributes:
        name: registry name.
        rollout: one of :data:`ROLLOUT_KINDS`: "sde" (e.g. Flow-GRPO), "solver" (e.g.
            DiffusionNFT, AWM; ``sampler.solver: tree`` gives them tree leaves) or "tree"
            (BranchGRPO: every tree edge is a training transition).
        sampling_adapter: the LoRA adapter that samples rollouts ("default" or e.g. "old").
        eval_adapter: the adapter used for evaluation and the saved LoRA ("default" or "ema").
    """

    name: str
    rollout: str
    sampling_adapter: str = "default"
    eval_adapter: str = "default"

    def setup(self, model: ModelAdapter) -> None:
        """Create extra adapters once the trainable LoRA exists (default: none)."""

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Micro-batches grouped per optimizer step, in the order they run."""
        raise NotImplementedError

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """Before one optimizer step: precompute what its ``loss`` calls need that the step cannot change.

        ``microbatches`` are this process's micro-batches of the step, in the order ``loss`` will see
        them, or empty where the forwards must stay in lockstep with other ranks (a sharded model);
        e.g. the frozen velocities of :class:`FrozenVelocities` (default: nothing).
        """

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss of one micro-batch and detached stats for logging."""
        raise NotImplementedError

    def noise_per_row(self, num_steps: int) -> int:
        """At most how many fresh noise latents :meth:`plan` draws per trained row (default: none).

        Forward-process objectives (DiffusionNFT, AWM) re-noise each clean sample at a few sigmas of
        the rollout's ``num_steps``-step grid; the memory estimate (``flowrl train --check``) counts
        ``rows x noise_per_row x latent`` for the plan.
        """
        return 0

    def after_update(self, model: ModelAdapter) -> dict[str, float]:
        """Called after every optimizer step; returns stats to log (default: nothing to do)."""
        return {}

    def sync_step(self, reduce_sum: Callable[[Tensor], Tensor], microbatches: int) -> None:
        """Several processes: make one optimizer step's statistics global, before :meth:`after_update`.

        Each rank ran only its own part of the step's micro-batches; ``reduce_sum`` sums a tensor
        over the ranks and ``microbatches`` is the step's count over all ranks (default: nothing to do).
        """

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """Called after an iteration's optimizer steps; returns stats to log (default: nothing to do).

        E.g. to soft-update auxiliary adapters.
        """
        return {}

    def state_dict(self) -> dict[str, Any]:
        """JSON-scalar state that must survive a resume (default: stateless).

        Extra LoRA adapters are checkpointed by the trainer, not here.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: a stateless objective is given state (a checkpoint of another objective).
        """
        if state:
            raise ValueError(
                f"objective {self.name!r} keeps no state but the checkpoint holds {sorted(state)}; "
                "resume with the objective that wrote it"
            )


def check_ranges(checks: dict[str, bool], values: Any, where: str) -> None:
    """Raise a one-line error for the first ``objective.<key>`` whose range check failed.

    Args:
        checks: key -> whether its value is in range.
        values: the objective (read for the offending value).
        where: the file documenting the ranges, named in the message.

    Raises:
        ValueError: naming the key and its value.
    """
    for key, ok in checks.items():
        if not ok:
            raise ValueError(
                f"objective.{key} is out of range ({getattr(values, key)!r}); see the objective's docstring"
            )


def chunk_indices(batch_size: int, chunk_size: int) -> list[Tensor]:
    """Consecutive index chunks of the rollout batch: [0..c), [c..2c), ..."""
    return [torch.arange(i, min(i + chunk_size, batch_size)) for i in range(0, batch_size, chunk_size)]


def split_even(items: list, parts: int) -> list[list]:
    """Split a list into ``parts`` consecutive groups of near-equal size (no empty group)."""
    parts = max(1, min(parts, len(items)))
    bounds = [round(i * len(items) / parts) for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def noised_microbatch(batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, Tensor, Tensor, Cond]:
    """Forward-process inputs of a micro-batch: ``x_t = (1 - t) x0 + t eps`` at the planned sigma.

    Returns:
        (x0 (b, ...) fp32, sigma (b,), x_t (b, ...), cond for the b samples).
    """
    x0 = batch.samples[mb.index].float()
    sigma = batch.sigmas[mb.step].float().expand(len(mb.index)).to(x0.device)
    t = batch_view(sigma, x0.ndim)
    return x0, sigma, (1 - t) * x0 + t * mb.noise, select_cond(batch.cond, mb.index)


def noised_inputs(batch: RolloutBatch, microbatches: list[Microbatch]) -> list[tuple[Microbatch, Tensor, Tensor, Cond]]:
    """``(mb, x_t, sigma, cond)`` of each forward-process micro-batch, for :meth:`FrozenVelocities.fill`."""
    items = []
    for mb in microbatches:
        _, sigma, x_t, cond = noised_microbatch(batch, mb)
        items.append((mb, x_t, sigma, cond))
    return items


def adapter_switch(model: ModelAdapter, adapter: str | None) -> contextlib.AbstractContextManager:
    """The context that runs ``model`` as the base model (``adapter`` None) or with LoRA adapter ``adapter``."""
    return adapters_disabled(model.transformer) if adapter is None else use_adapter(model.transformer, adapter)


def velocity_penalty(
    model: ModelAdapter,
    x_t: Tensor,
    sigma: Tensor,
    cond: Cond,
    v_theta: Tensor,
    adapter: str | None,
    v_other: Tensor | None = None,
    keep: Tensor | None = None,
) -> Tensor:
    """``mean (v_theta - v_other)^2`` (fp64) against the base model (adapter None) or a named adapter.

    The velocity-space "KL" used by DiffusionNFT and AWM; the other velocity carries no gradient.
    ``v_other`` is that velocity when the caller has it already (:class:`FrozenVelocities`). With ``keep``
    ((B,) bool, the chunk's ``batch.keep``) the mean runs over the kept rows only, as the policy loss's does,
    so :func:`~flowrl.objectives.planning.weigh_by_kept` makes the step's penalty the mean over its kept rows
    whatever the chunk size; when every row is kept it is the plain mean (the same bits as without ``keep``).
    """
    if v_other is None:
        with torch.no_grad(), adapter_switch(model, adapter):
            v_other = model.velocity(x_t, sigma, cond)
    squared = (v_theta.double() - v_other.double()) ** 2
    if keep is None or bool(keep.all()):
        return squared.mean()
    weights = keep.to(squared.dtype)
    return (squared.flatten(1).mean(1) * weights).sum() / weights.sum().clamp(min=1.0)


FROZEN_CACHE_BYTES = 256 * 2**20
"""At most this many bytes of latents (fp32) per optimizer step for :class:`FrozenVelocities` to precompute."""


class FrozenVelocities:
    """Velocities of a frozen adapter state at one optimizer step's training points, under one switch.

    The KL reference (the base model, adapters off) and DiffusionNFT's sampling policy ("old") do not
    change during an optimizer step, so an objective's :meth:`Objective.prepare` computes their
    velocities for all the step's micro-batches first, under one adapter switch per state, and
    ``loss`` takes them from here instead of switching twice per micro-batch. peft switches every
    LoRA layer in Python (about 1.8 ms an ``adapters_disabled`` on the embedded model's 31 layers on
    this CPU), which on a GPU costs as much as several forwards of a small model's kernels. The calls
    and inputs are the same, so the values are the same bit for bit. Latents above
    :data:`FROZEN_CACHE_BYTES` per step are not precomputed (each micro-batch switches, as before).
    """

    def __init__(self) -> None:
        self.store: dict[tuple[str | None, int], Tensor] = {}

    def fill(
        self, model: ModelAdapter, adapter: str | None, items: list[tuple[Microbatch, Tensor, Tensor, Cond]]
    ) -> None:
        """Compute the velocities of ``adapter``'s state at each ``(mb, x, sigma, cond)`` under one switch.

        Args:
            model: the policy stack.
            adapter: None (the base model) or an adapter name.
            items: one (micro-batch, x (b, ...), sigma (b,), cond) per micro-batch of the step.
        """
        if not items or sum(x.numel() for _, x, _, _ in items) * 4 > FROZEN_CACHE_BYTES:
            return
        with torch.no_grad(), adapter_switch(model, adapter):
            for mb, x, sigma, cond in items:
                self.store[(adapter, id(mb))] = model.velocity(x, sigma, cond)

    def velocity(
        self, model: ModelAdapter, adapter: str | None, mb: Microbatch, x: Tensor, sigma: Tensor, cond: Cond
    ) -> Tensor:
        """The precomputed velocity of ``mb`` (used once), or computed now under its own switch."""
        v = self.store.pop((adapter, id(mb)), None)
        if v is None:
            with torch.no_grad(), adapter_switch(model, adapter):
                v = model.velocity(x, sigma, cond)
        return v

    def clear(self) -> None:
        """Drop what is left (a step that ended early); called at every step's start."""
        self.store.clear()
