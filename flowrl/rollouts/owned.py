"""Rolling out the global batch on one rank of several: the model runs only on the rows the rank owns.

Every rank draws the whole global batch's noise from the run's generator, in the same order as a
one-process run (:mod:`flowrl.distributed`). To keep the generator in step, every rank runs the
sampler on every chunk of the global batch, but :class:`OwnedRows` evaluates the model only on the
rows this rank owns and gives the others a zero velocity. A sampler's draws depend on shapes only
(``standard_normal(x, generator)``), so the stream advances exactly as on one process; the rows a
rank does not own are never decoded, scored or trained on (their latents are placeholders).

The samplers see an index conditioning instead of the real one (:func:`row_cond`): under
:data:`OWNED_KEY`, a (B, 2) int64 tensor of the owner rank of each row and its row in the
conditioning the rank holds. It follows every :func:`~flowrl.models.adapter.select_cond`
of the samplers (chunks, a tree's per-tree conditioning, a frontier's nodes) without changing their
signatures, and :class:`OwnedRows` looks the real conditioning of its rows up. So a rank holds the
conditioning of its own rows only, and with ``store`` the samplers keep only its rows' latents and
trajectories (a tree rollout its own trees' nodes): memory per rank is that of ``B / W`` rows, not
of the global batch (:class:`~flowrl.objectives.base.RankRows`).

A sharded denoiser (FSDP2, ZeRO-3) gathers its weights inside every call, so every rank must make
the same number of calls; the calls pair in order, whatever rows they hold. Each rank therefore
calls the model only on its own rows, counts the calls every other rank makes on the same pass
(from the owners of each call's rows, no communication), and tops its count up with one-row
placeholder calls at the end of the rollout (:meth:`OwnedRows.finish`). A rank then makes as many
calls as the busiest rank, not one per chunk of the global batch: with contiguous placement the
gathers are 1/W of what calling on every chunk would cost.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..models.adapter import Cond, ModelAdapter, select_cond
from ..prompts.batch import PromptBatch
from ..rewards import RewardOutput
from ..sharding import is_sharded

OWNED_KEY = "flowrl.owned_rows"
"""Index-conditioning key (:func:`row_cond`): (B, 2) int64, each row's owner rank and row in the held conditioning."""


class OwnedRows:
    """A velocity-only view of a model that evaluates it on the owned rows of each call.

    Under a sharded denoiser (``train.sharding: fsdp2 | zero3``, :mod:`flowrl.sharding`) it also counts,
    for every rank, the calls that hold that rank's rows, and :meth:`finish` makes this rank's count
    up to the largest with one-row placeholder calls (not counted in the NFE, outputs dropped).

    Args:
        model: the sampling policy.
        cond: the conditioning the rank holds (its own rows), looked up by the
            index conditioning of each call.
        rank: this process's rank.
        world_size: the number of ranks ``W``.
    """

    def __init__(self, model: ModelAdapter, cond: Cond, rank: int, world_size: int) -> None:
        self.model = model
        self.cond = cond
        self.rank = rank
        self.lockstep = is_sharded(model.transformer)
        self.calls = torch.zeros(world_size, dtype=torch.long)  # (W,) calls holding each rank's rows
        self.spare: tuple[Tensor, Tensor, Cond] | None = None  # one row of a call, for placeholder calls
        self.placeholders = 0  # placeholder calls made by finish()

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """``model.velocity`` on the rows the index conditioning ``cond`` gives this rank, zeros elsewhere: (b, ...)."""
        owners, held = cond[OWNED_KEY].cpu().unbind(1)  # one host copy per call: counts, owned rows, their cond
        if self.lockstep:
            self._count(x, sigma, torch.bincount(owners, minlength=len(self.calls)))
        mine = (owners == self.rank).nonzero().squeeze(1)
        if len(mine) == len(owners):
            return self.model.velocity(x, sigma, select_cond(self.cond, held))
        v = torch.zeros_like(x)
        if len(mine):
            rows = mine.to(x.device)
            v[rows] = self.model.velocity(x[rows], sigma[rows], select_cond(self.cond, held[mine])).to(v.dtype)
        return v

    def _count(self, x: Tensor, sigma: Tensor, rows_of: Tensor) -> None:
        """Count the call for every rank with rows in it (``rows_of`` (W,)); keep a row for placeholders."""
        self.calls += rows_of.clamp(max=1)
        if self.spare is None:
            self.spare = (x[:1].clone(), sigma[:1].clone(), select_cond(self.cond, slice(0, 1)))

    def finish(self) -> None:
        """Under a sharded model, placeholder calls up to the most calls any rank made (``placeholders``)."""
        if not self.lockstep or self.spare is None:
            return
        nfe = self.model.nfe
        for _ in range(int(self.calls.max() - self.calls[self.rank])):
            self.model.velocity(*self.spare)
            self.placeholders += 1
        self.model.nfe = nfe


def row_cond(owners: Tensor, rank: int, device: torch.device) -> Cond:
    """The samplers' index conditioning of the global batch (:data:`OWNED_KEY`, (B, 2) on ``device``).

    Args:
        owners: (B,) int64, the rank that owns each row.
        rank: this process's rank (it holds the conditioning of its own rows).
        device: where the samplers' tensors live (a tree indexes the conditioning with device tensors).
    """
    rows = ((owners == rank).long().cumsum(0) - 1).clamp(min=0)  # other ranks' rows point at row 0, never looked up
    return {OWNED_KEY: torch.stack([owners.long(), rows], dim=1).to(device)}


def owned_prompts(prompts: PromptBatch, owned: Tensor) -> PromptBatch:
    """The owned rows of an iteration's prompts (texts, metadata, group ids), in global order."""
    rows = owned.nonzero().squeeze(1).tolist()
    metadata = {k: [v[i] for i in rows] for k, v in prompts.metadata.items()}
    return PromptBatch([prompts.texts[i] for i in rows], metadata, prompts.group_ids[owned])


def gathered_rewards(scored: RewardOutput, gather_rows: Callable[[Tensor], Tensor]) -> RewardOutput:
    """The global batch's rewards (B,) from this rank's (b,), all-gathered in global order (the same on every rank)."""
    components = {name: gather_rows(value.float()) for name, value in scored.components.items()}
    return RewardOutput(gather_rows(scored.total.float()), components)
