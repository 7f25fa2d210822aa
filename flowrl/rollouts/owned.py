"""Rolling out the global batch on one rank of several: the model runs only on the rows the rank owns.

Every rank draws the whole global batch's noise from the run's generator, in the same order as a
one-process run (:mod:`flowrl.distributed`). To keep the generator in step, every rank runs the
sampler on every chunk of the global batch, but :class:`OwnedRows` evaluates the model only on the
rows this rank owns and gives the others a zero velocity. A sampler's draws depend on shapes only
(``standard_normal(x, generator)``), so the stream advances exactly as on one process; the rows a
rank does not own are never decoded, scored or trained on (their latents are placeholders).

Which rows are owned rides in the conditioning under :data:`OWNED_KEY` (a (B,) bool tensor), so it
follows every :func:`~flowrl.models.adapter.select_cond` of the samplers (chunks, a tree's
per-tree conditioning, a frontier's nodes) without changing their signatures.
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
"""Conditioning key of the (B,) bool mask of the rows this rank owns (stripped before the model sees it)."""


class OwnedRows:
    """A velocity-only view of a model that evaluates it on the owned rows of each call.

    A sharded denoiser (``train.sharding: fsdp2``, :mod:`flowrl.sharding`) gathers its weights with
    collectives inside every call, so every rank must call it in lockstep: a call without owned rows
    then evaluates one placeholder row (not counted in the NFE) and drops its output.

    Args:
        model: the sampling policy.
    """

    def __init__(self, model: ModelAdapter) -> None:
        self.model = model
        self.lockstep = is_sharded(model.transformer)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """``model.velocity`` on the rows whose ``cond[OWNED_KEY]`` is True, zeros elsewhere: (b, ...)."""
        cond = dict(cond)
        owned = cond.pop(OWNED_KEY)
        if bool(owned.all()):
            return self.model.velocity(x, sigma, cond)
        v = torch.zeros_like(x)
        rows = owned.nonzero().squeeze(1)
        if len(rows):
            v[rows] = self.model.velocity(x[rows], sigma[rows], select_cond(cond, rows)).to(v.dtype)
        elif self.lockstep:
            nfe, first = self.model.nfe, torch.zeros(1, dtype=torch.long)
            self.model.velocity(x[:1], sigma[:1], select_cond(cond, first))
            self.model.nfe = nfe
        return v


def owned_cond(cond: Cond, owned: Tensor) -> Cond:
    """``cond`` with the ownership mask (B,) added under :data:`OWNED_KEY` (on the conditioning's device)."""
    device = next(iter(cond.values())).device
    return {**cond, OWNED_KEY: owned.to(device)}


def owned_hook(submit: Callable[[slice, Tensor], None], owned: Tensor) -> Callable[[slice, Tensor], None]:
    """Translate a rollout's ``on_chunk(global rows, latents)`` into ``submit(local rows, owned latents)``.

    Local rows number the owned rows in global order, so the chunks arrive in order and cover the
    rank's batch; a chunk without owned rows is not submitted.
    """
    before = torch.cat([torch.zeros(1, dtype=torch.long), owned.long().cumsum(0)])

    def on_chunk(rows: slice, latents: Tensor) -> None:
        mask = owned[rows.start : rows.start + latents.shape[0]]
        if bool(mask.any()):
            start = int(before[rows.start])
            submit(slice(start, start + int(mask.sum())), latents[mask.to(latents.device)])

    return on_chunk


def owned_prompts(prompts: PromptBatch, owned: Tensor) -> PromptBatch:
    """The owned rows of an iteration's prompts (texts, metadata, group ids), in global order."""
    rows = owned.nonzero().squeeze(1).tolist()
    metadata = {k: [v[i] for i in rows] for k, v in prompts.metadata.items()}
    return PromptBatch([prompts.texts[i] for i in rows], metadata, prompts.group_ids[owned])


def global_scores(
    images: Tensor, scored: RewardOutput, owned: Tensor, gather_rows: Callable[[Tensor], Tensor]
) -> tuple[Tensor, RewardOutput]:
    """Rewards of the global batch from every rank's scores, and images with zeros on the rows of other ranks.

    Args:
        images: (b, ...) this rank's decoded samples.
        scored: this rank's rewards (b,).
        owned: (B,) bool, this rank's rows.
        gather_rows: all-gather of every rank's rows into global order, (b, ...) -> (B, ...).

    Returns:
        (images (B, ...), :class:`RewardOutput` of the B samples), the same rewards on every rank.
    """
    full = torch.zeros((owned.shape[0], *images.shape[1:]), dtype=images.dtype, device=images.device)
    full[owned.to(images.device)] = images
    components = {name: gather_rows(value.float()) for name, value in scored.components.items()}
    return full, RewardOutput(gather_rows(scored.total.float()), components)
