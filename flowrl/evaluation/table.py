"""The per-checkpoint evaluation table: reward means with confidence intervals, diversity, drift, guards.

One row per checkpoint, computed from its samples on a fixed prompt set and seeds. ``flowrl eval``
writes it as JSON and markdown, and the demo shows the same rows (:func:`table_cells`), so both
report the same figures from the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .metrics import MeanCI, mean_ci, prompt_diversity, sample_drift


@dataclass(frozen=True)
class CheckpointFigures:
    """The figures of one checkpoint on one prompt set.

    Attributes:
        label: the checkpoint's name.
        total: the weighted reward total (mean and CI over samples).
        rewards: reward name -> mean and CI over samples.
        diversity: mean over prompts of the per-prompt diversity (CI over prompts); None with one seed.
        drift: RMS distance from the base model's sample of the same prompt and seed; None for the base.
        guards: guard reward name -> mean and CI over samples.
        samples: number of samples scored.
    """

    label: str
    total: MeanCI
    rewards: dict[str, MeanCI]
    diversity: MeanCI | None
    drift: MeanCI | None
    guards: dict[str, MeanCI] = field(default_factory=dict)
    samples: int = 0


def checkpoint_figures(
    label: str,
    images: Tensor,
    group_ids: Tensor | Sequence[int],
    total: Tensor,
    rewards: Mapping[str, Tensor],
    *,
    base_images: Tensor | None = None,
    guards: Mapping[str, Tensor] | None = None,
    level: float = 0.95,
) -> CheckpointFigures:
    """Summarise one checkpoint's scored samples.

    Args:
        label: the checkpoint's name.
        images: (B, 3, H, W) or (B, F, 3, H, W) samples in [0, 1].
        group_ids: (B,) prompt index of each sample (seeds of one prompt share it).
        total: (B,) weighted reward totals.
        rewards: name -> (B,) component scores (NaN: not applicable, left out of the mean).
        base_images: (B, ...) the base model's samples on the same prompts and seeds (for drift);
            None for the base model itself.
        guards: name -> (B,) guard reward scores.
        level: confidence level of the intervals.

    Returns:
        The :class:`CheckpointFigures`.
    """
    ids = torch.as_tensor(group_ids, dtype=torch.long).cpu()
    per_prompt = ids.bincount()
    diversity = mean_ci(prompt_diversity(images, ids), level) if int(per_prompt[per_prompt > 0].min()) >= 2 else None
    drift = None if base_images is None else mean_ci(sample_drift(images, base_images), level)
    return CheckpointFigures(
        label=label,
        total=mean_ci(total, level),
        rewards={k: mean_ci(v, level) for k, v in rewards.items()},
        diversity=diversity,
        drift=drift,
        guards={k: mean_ci(v, level) for k, v in (guards or {}).items()},
        samples=len(images),
    )


def _ci_json(ci: MeanCI | None) -> dict[str, Any] | None:
    if ci is None:
        return None
    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731 (strict JSON: NaN -> null)
    return {"mean": finite(ci.mean), "low": finite(ci.low), "high": finite(ci.high), "n": ci.n}


def figures_json(rows: Sequence[CheckpointFigures]) -> list[dict[str, Any]]:
    """The rows as strict-JSON-ready dicts (NaN -> null)."""
    return [
        {
            "label": r.label,
            "samples": r.samples,
            "total": _ci_json(r.total),
            "rewards": {k: _ci_json(v) for k, v in r.rewards.items()},
            "diversity": _ci_json(r.diversity),
            "drift_from_base": _ci_json(r.drift),
            "guards": {k: _ci_json(v) for k, v in r.guards.items()},
        }
        for r in rows
    ]


def format_ci(ci: MeanCI | None, digits: int = 4) -> str:
    """``mean ± half-width`` ("–" for a missing figure, "n/a" for no finite value)."""
    if ci is None:
        return "–"
    if not math.isfinite(ci.mean):
        return "n/a"
    if ci.n < 2:
        return f"{ci.mean:.{digits}f}"
    return f"{ci.mean:.{digits}f} ± {ci.half_width:.{digits}f}"


def _names(rows: Sequence[CheckpointFigures]) -> tuple[list[str], list[str]]:
    """The rewards and the guards of the rows, in first-seen order."""
    rewards = list(dict.fromkeys(k for r in rows for k in r.rewards))
    guards = list(dict.fromkeys(k for r in rows for k in r.guards))
    return rewards, guards


def table_columns(rows: Sequence[CheckpointFigures]) -> list[str]:
    """Column headers: checkpoint, total, each reward, each guard, diversity, drift, samples."""
    rewards, guards = _names(rows)
    return ["checkpoint", "reward total", *rewards, *(f"guard: {g}" for g in guards), "diversity", "drift", "n"]


def table_cells(rows: Sequence[CheckpointFigures], digits: int = 4) -> tuple[list[str], list[list[str]]]:
    """The table as headers and rows of strings (what the demo's checkpoint table and markdown show)."""
    headers = table_columns(rows)
    rewards, guards = _names(rows)  # the same lists as the headers: a reward may be labelled "drift" or "n"
    cells = []
    for r in rows:
        cells.append(
            [
                r.label,
                format_ci(r.total, digits),
                *(format_ci(r.rewards.get(k), digits) for k in rewards),
                *(format_ci(r.guards.get(g), digits) for g in guards),
                format_ci(r.diversity, digits),
                format_ci(r.drift, digits),
                str(r.samples),
            ]
        )
    return headers, cells


def markdown_table(rows: Sequence[CheckpointFigures], level: float = 0.95, digits: int = 4) -> str:
    """A markdown table of the rows (``mean ± half-width`` of the ``level`` Student-t CI)."""
    headers, cells = table_cells(rows, digits)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    note = (
        f"\nMeans ± half-width of the {level:.0%} Student-t interval over samples (diversity: over "
        "prompts). Diversity: mean pairwise RMS pixel distance between the seeds of one prompt. Drift: RMS pixel "
        "distance from the base model's sample of the same prompt and seed.\n"
    )
    return "\n".join(lines) + "\n" + note
