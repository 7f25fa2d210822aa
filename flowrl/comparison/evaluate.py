"""``flowrl eval``: score checkpoints on a prompt set with fixed seeds and deterministic (ODE) sampling.

Every checkpoint (each run's final LoRA, the EMA/trained adapters where a checkpoint has them, and
the base model of each model) samples the same prompts with the same seeds on the Euler ODE, is
scored on the same rewards (the union of the runs' ``rewards:`` sections, or ``--rewards``) and the
runs' ``guards:``, and becomes one row of :mod:`flowrl.evaluation.table`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from ..evaluation.table import CheckpointFigures, checkpoint_figures, figures_json, markdown_table
from .checkpoints import Checkpoint, CheckpointBank, config_guards, generate, offer_run, read_run_config

if TYPE_CHECKING:
    from ..config import Config
    from ..prompts.files import Prompt

EVAL_SEED_BASE = 3_000_000  # away from training's rollout seeds and the run's own eval/grid seeds


@dataclass(frozen=True)
class EvalSettings:
    """What every checkpoint is evaluated on.

    Attributes:
        seeds: samples per prompt (>= 2 for the per-prompt diversity).
        first_seed: the first seed; prompt p, sample j uses ``first_seed + j`` (the same for every prompt).
        steps: Euler ODE steps; None = each run's ``train.eval_steps`` or ``sampler.num_steps``.
        level: confidence level of the intervals.
    """

    seeds: int = 4
    first_seed: int = EVAL_SEED_BASE
    steps: int | None = None
    level: float = 0.95


def reward_spec(run_dirs: Sequence[Path], names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """The rewards to score with: the union of the runs' ``rewards:`` sections (first run wins a name).

    Args:
        run_dirs: run folders.
        names: keep only these names; a name no run configures is built from the registry with its
            default options (weight 1).

    Raises:
        ValueError: no run and no names.
    """
    return reward_union([read_run_config(run) for run in run_dirs], names)


def reward_union(configs: Sequence[Config], names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`reward_spec` of run configs already read (the demo reads each run's once, when it is offered).

    Raises:
        ValueError: no config and no names.
    """
    union: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        for name, spec in cfg.rewards.items():
            union.setdefault(name, dict(spec))
    if names:
        return {n: union.get(n, {"weight": 1.0}) for n in names}
    if not union:
        raise ValueError("no reward to score with: pass run folders (their config.yaml rewards) or --rewards NAME,...")
    return union


def guard_spec(run_dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """The union of the runs' reward guards (``guards:`` entries as reward options; first run wins a name)."""
    return guard_union([read_run_config(run) for run in run_dirs])


def guard_union(configs: Sequence[Config]) -> dict[str, dict[str, Any]]:
    """:func:`guard_spec` of run configs already read."""
    union: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        for name, options in config_guards(cfg).items():
            union.setdefault(name, options)
    return union


def build_rewards(spec: dict[str, dict[str, Any]]) -> Any:
    """A :class:`~flowrl.rewards.combine.MultiReward` of a ``rewards:``-style spec (guards: weight 1 each)."""
    from ..rewards import build_multi_reward

    return build_multi_reward(spec)


def score(reward: Any, images: Tensor, prompts: Sequence[Prompt]) -> tuple[Tensor, dict[str, Tensor]]:
    """Score samples of ``prompts`` (metadata passed per sample, as training does): (total (B,), components)."""
    from ..prompts.batch import collate

    batch = collate(list(prompts))
    parts = reward.score_parts(images, batch.texts, batch.metadata)
    out = reward.combine(parts, allow_all_nan=True)  # a reward that applies to none of the prompts reads "n/a"
    return out.total.float(), {k: v.float() for k, v in out.components.items()}


def checkpoints_of(run_dirs: Sequence[Path]) -> list[Checkpoint]:
    """The base model of each model the runs use (first), then every run's checkpoints, every label distinct.

    Labels come from :func:`~flowrl.comparison.checkpoints.offer_run`, as in the demo: ``runs/a dup/a`` gives
    ``a`` and ``dup/a``; two models in folders named ``model`` give ``base (model)`` and ``base (m2/model)``. A run
    folder named twice (or through a symlink) is evaluated once.
    """
    offered: list[Checkpoint] = []
    seen: set[str] = set()
    for run in run_dirs:
        if os.path.realpath(run) not in seen:
            seen.add(os.path.realpath(run))
            offered += offer_run(Path(run), offered)
    return [c for c in offered if c.kind == "base"] + [c for c in offered if c.kind != "base"]


def checkpoint_steps(bank: CheckpointBank, checkpoint: Checkpoint, steps: int | None) -> int:
    """The ODE steps a checkpoint is sampled with: ``steps``, else its run's evaluation steps."""
    cfg = bank.config(checkpoint)
    return steps or cfg.train.eval_steps or cfg.sampler.num_steps


def sample_checkpoint(
    bank: CheckpointBank, checkpoint: Checkpoint, texts: list[str], seeds: list[int], steps: int | None
):
    """Deterministic ODE samples of one checkpoint (steps: the run's evaluation steps when None)."""
    cfg = bank.config(checkpoint)
    n = checkpoint_steps(bank, checkpoint, steps)
    with bank.activated(checkpoint) as policy:
        return generate(policy, texts, seeds, steps=n, sampler="ode", frames=cfg.model.num_frames)


def evaluate_checkpoints(
    bank: CheckpointBank,
    checkpoints: Sequence[Checkpoint],
    prompts: Sequence[Prompt],
    rewards: dict[str, dict[str, Any]],
    guards: dict[str, dict[str, Any]] | None = None,
    settings: EvalSettings = EvalSettings(),
) -> list[CheckpointFigures]:
    """Sample and score every checkpoint on the same prompts and seeds.

    Args:
        bank: where the models and adapters live.
        checkpoints: base models first (each later checkpoint's drift is measured against the base of its model).
        prompts: the prompt set.
        rewards: reward specs (``rewards:`` section layout).
        guards: guard reward specs (``guards:`` section layout), scored separately.
        settings: seeds, steps, confidence level.

    Returns:
        One :class:`CheckpointFigures` per checkpoint, in order.

    Raises:
        ValueError: ``--seeds``, ``--steps`` or ``--seed`` out of range, or more work than
            :data:`~flowrl.resources.MAX_SAMPLE_STEPS` (one line naming the flags).
    """
    from ..resources import check_sampling_flags, check_sampling_work

    check_sampling_flags(settings.seeds, settings.steps, settings.first_seed)
    most = max((checkpoint_steps(bank, c, settings.steps) for c in checkpoints), default=1)
    what = f"{len(checkpoints)} checkpoints x {len(prompts)} prompts x --seeds {settings.seeds}"
    check_sampling_work(len(checkpoints) * len(prompts) * settings.seeds, most, what)
    reward = build_rewards(rewards)
    guard = build_rewards(guards) if guards else None
    rows_prompts = [p for p in prompts for _ in range(settings.seeds)]
    texts = [p.text for p in rows_prompts]
    seeds = [settings.first_seed + j for _ in prompts for j in range(settings.seeds)]
    ids = torch.arange(len(prompts)).repeat_interleave(settings.seeds)
    bases = {c.model_path: c for c in checkpoints if c.kind == "base"}
    base_images: dict[tuple[str, int], Tensor] = {}  # drift compares samples of the same model and step count

    def base_samples(model_path: str, n: int) -> Tensor | None:
        if (model_path, n) not in base_images and model_path in bases:
            base_images[(model_path, n)] = sample_checkpoint(bank, bases[model_path], texts, seeds, n)
        return base_images.get((model_path, n))

    rows = []
    for checkpoint in checkpoints:
        n = checkpoint_steps(bank, checkpoint, settings.steps)
        if checkpoint.kind == "base":
            images = base_samples(checkpoint.model_path, n)
        else:
            images = sample_checkpoint(bank, checkpoint, texts, seeds, n)
        total, parts = score(reward, images, rows_prompts)
        guard_parts = score(guard, images, rows_prompts)[1] if guard is not None else {}
        base = None if checkpoint.kind == "base" else base_samples(checkpoint.model_path, n)
        rows.append(
            checkpoint_figures(
                checkpoint.label,
                images,
                ids,
                total,
                parts,
                base_images=base,
                guards=guard_parts,
                level=settings.level,
            )
        )
    return rows


EVAL_FILES = ("eval.json", "eval.md")
"""The files :func:`write_report` writes into its folder (``flowrl eval --out`` refuses to replace them unasked)."""


def write_report(rows: Sequence[CheckpointFigures], out: Path, meta: dict[str, Any], level: float = 0.95) -> list[Path]:
    """Write ``out/eval.json`` (figures + settings) and ``out/eval.md`` (the markdown table); returns the paths."""
    from ..outputs import write_json, write_text_atomic

    figures, table = (out / name for name in EVAL_FILES)
    out.mkdir(parents=True, exist_ok=True)
    write_json(figures, {**meta, "checkpoints": figures_json(rows)})
    write_text_atomic(table, markdown_table(rows, level=level))
    return [figures, table]


def eval_meta(
    run_dirs: Sequence[Path], prompts_spec: str, n_prompts: int, settings: EvalSettings, rewards: dict
) -> dict:
    """The settings recorded next to the figures in ``eval.json``."""
    return {
        "runs": [str(r) for r in run_dirs],
        "prompts": prompts_spec,
        "num_prompts": n_prompts,
        "seeds_per_prompt": settings.seeds,
        "first_seed": settings.first_seed,
        "steps": settings.steps,
        "sampler": "ode (euler)",
        "confidence_level": settings.level,
        "rewards": json.loads(json.dumps(rewards, default=str)),
    }
