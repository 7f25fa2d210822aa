"""One comparison: every selected checkpoint samples the same prompt and seeds, then all are scored.

The scores come from one reward set for every checkpoint (the runs' ``rewards:`` sections, or the
names chosen in the app), so the images' captions and the per-checkpoint table
(:func:`flowrl.evaluation.table.checkpoint_figures`, the same figures ``flowrl eval`` writes) compare
like with like.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..comparison.checkpoints import Checkpoint, CheckpointBank, generate
from ..comparison.evaluate import build_rewards, reward_spec
from ..config import Config
from ..evaluation.table import CheckpointFigures, checkpoint_figures
from ..prompts.files import Prompt
from .validation import Request

Progress = Callable[[int, int, str], None]  # (done, total, what is running)


@dataclass
class Comparison:
    """The result of one request.

    Attributes:
        labels: checkpoint labels, in the order sampled.
        images: label -> (S, 3, H, W) images or (S, F, 3, H, W) clips, one per seed.
        scores: label -> reward name -> (S,) scores ("total" is the weighted sum).
        figures: one table row per checkpoint.
        seeds: the seeds.
        errors: reward failures (e.g. a prompt a reward cannot read), shown next to the images.
    """

    labels: list[str]
    images: dict[str, Tensor]
    scores: dict[str, dict[str, Tensor]]
    figures: list[CheckpointFigures]
    seeds: tuple[int, ...]
    errors: list[str]

    @property
    def is_video(self) -> bool:
        """Whether the samples are clips (B, F, 3, H, W)."""
        return any(v.ndim == 5 for v in self.images.values())


def reward_names(registry_checkpoints: Sequence[Checkpoint]) -> list[str]:
    """The reward names the runs configure (the default scoring set)."""
    runs = list(dict.fromkeys(c.run_dir for c in registry_checkpoints if c.run_dir is not None))
    return list(reward_spec(runs)) if runs else list(Config().rewards)  # no run: the default job's rewards


def scoring_choices(checkpoints: Sequence[Checkpoint]) -> list[str]:
    """The rewards the demo offers: the runs' own, then every registered reward that builds from its name alone.

    A reward with a required option (``remote``'s url) is offered only where a run configures it.
    """
    from ..rewards import list_rewards, required_options

    alone = [r.name for r in list_rewards() if not r.error and not required_options(r.name)]
    return list(dict.fromkeys([*reward_names(checkpoints), *alone]))


def _score(spec: dict[str, dict[str, Any]], images: Tensor, prompt: str, errors: list[str]) -> dict[str, Tensor]:
    """Score with each reward on its own, so one reward that cannot read the prompt leaves the others."""
    from ..comparison.evaluate import score

    prompts = [Prompt(prompt, {})] * len(images)
    out: dict[str, Tensor] = {}
    failed = False
    total = torch.zeros(len(images))
    for name, options in spec.items():
        try:
            _, parts = score(_built(json.dumps({name: options}, sort_keys=True, default=str)), images, prompts)
        except ValueError as err:  # RewardError is a ValueError
            errors.append(f"{name}: {str(err).splitlines()[0]}")
            failed = True
            out[name] = torch.full((len(images),), float("nan"))
            continue
        out[name] = parts[name]
        total += float(options.get("weight", 1.0)) * torch.nan_to_num(parts[name])
    out = {"total": total if not failed else torch.full((len(images),), float("nan")), **out}
    return out


@functools.lru_cache(maxsize=32)
def _built(spec: str) -> Any:
    """A reward built once per spec (JSON text) and reused by later requests."""
    return build_rewards(json.loads(spec))


def run_comparison(
    bank: CheckpointBank,
    checkpoints: Sequence[Checkpoint],
    request: Request,
    spec: dict[str, dict[str, Any]],
    progress: Progress | None = None,
    guards: dict[str, dict[str, Any]] | None = None,
) -> Comparison:
    """Sample every checkpoint on the request's prompt and seeds, score and summarise them.

    Args:
        bank: the loaded models and adapters.
        checkpoints: the selected checkpoints (base models give the drift reference of their model).
        request: the validated request.
        spec: reward specs to score with.
        progress: called as ``progress(done, total, label)`` before each checkpoint.
        guards: the runs' guard rewards (``guards:`` entries as reward options), scored for the table.

    Returns:
        The :class:`Comparison`.
    """
    seeds = list(request.seeds)
    prompts = [request.prompt] * len(seeds)
    images: dict[str, Tensor] = {}
    ordered = sorted(checkpoints, key=lambda c: c.kind != "base")  # bases first: the drift reference
    for i, checkpoint in enumerate(ordered):
        if progress is not None:
            progress(i, len(ordered), checkpoint.label)
        frames = bank.config(checkpoint).model.num_frames
        with bank.activated(checkpoint, request.guidance) as policy:
            images[checkpoint.label] = generate(
                policy,
                prompts,
                seeds,
                steps=request.steps,
                sampler=request.sampler,
                noise_level=request.noise_level,
                frames=frames,
            )
    if progress is not None:
        progress(len(ordered), len(ordered), "scoring")
    errors: list[str] = []
    scores = {label: _score(spec, imgs, request.prompt, errors) for label, imgs in images.items()}
    guard_scores = {label: _score(guards or {}, imgs, request.prompt, errors) for label, imgs in images.items()}
    errors = list(dict.fromkeys(errors))
    bases = {c.model_path: images[c.label] for c in ordered if c.kind == "base"}
    figures = []
    for c in ordered:
        parts = {k: v for k, v in scores[c.label].items() if k != "total"}
        base = None if c.kind == "base" else bases.get(c.model_path)
        ids = torch.zeros(len(seeds), dtype=torch.long)
        figures.append(
            checkpoint_figures(
                c.label,
                images[c.label],
                ids,
                scores[c.label]["total"],
                parts,
                base_images=base,
                guards={k: v for k, v in guard_scores[c.label].items() if k != "total"},
            )
        )
    return Comparison([c.label for c in ordered], images, scores, figures, request.seeds, errors)


def caption(comparison: Comparison, label: str, index: int) -> str:
    """``label · seed s · total 0.512 · ink 0.401 · ...`` for one image."""
    parts = [f"{label} · seed {comparison.seeds[index]}"]
    for name, values in comparison.scores[label].items():
        value = float(values[index])
        parts.append(f"{name} {value:.3f}" if value == value else f"{name} n/a")
    return " · ".join(parts)
