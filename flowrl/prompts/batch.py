"""One iteration's prompts: chosen prompts repeated into groups, with their metadata."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .files import Prompt

__all__ = ["PromptBatch", "collate", "sample_groups"]


class PromptBatch(NamedTuple):
    """Prompts for one iteration: each chosen prompt repeated ``group_size`` times consecutively.

    Attributes:
        texts: B prompt strings.
        metadata: key -> B values (None where a prompt lacks the key).
        group_ids: (B,) int64 group index.
    """

    texts: list[str]
    metadata: dict[str, list[Any]]
    group_ids: Tensor


def collate(prompts: list[Prompt], repeats: int = 1) -> PromptBatch:
    """Repeat each prompt ``repeats`` times and gather metadata into per-key lists."""
    texts, groups, rows = [], [], []
    for g, prompt in enumerate(prompts):
        for _ in range(repeats):
            texts.append(prompt.text)
            groups.append(g)
            rows.append(prompt.metadata)
    keys = sorted({k for row in rows for k in row})
    metadata = {k: [row.get(k) for row in rows] for k in keys}
    return PromptBatch(texts, metadata, torch.tensor(groups, dtype=torch.long))


def sample_groups(
    prompts: list[Prompt], per_iteration: int, group_size: int, generator: torch.Generator
) -> PromptBatch:
    """Draw ``per_iteration`` prompts (without replacement while possible) and repeat each K times."""
    picks: list[int] = []
    while len(picks) < per_iteration:
        perm = torch.randperm(len(prompts), generator=generator).tolist()
        picks.extend(perm[: per_iteration - len(picks)])
    return collate([prompts[i] for i in picks], group_size)
