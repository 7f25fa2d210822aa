"""The held-out evaluation of the training loop: samples, rewards, guard rewards and monitors.

Every ``train.eval_every`` iterations the run samples its eval prompts with fixed held-out seeds
(never the training prompts or the training generator), deterministically (Euler ODE) and with
the objective's eval adapter (e.g. DiffusionNFT's EMA weights), then logs:

    eval/reward_mean, eval/<reward>   the trained rewards on the held-out samples
    eval/reward_ci95                  half-width of reward_mean's 95 % interval (as ``flowrl eval`` reports it)
    guard/<name>                      each guard reward (never trained on), and guard/<name>_best
    eval/diversity                    mean over prompts of the per-prompt pairwise RMS distance
    eval/diversity_base, eval/diversity_ratio   the base model's diversity, and ours over it
    eval/drift                        mean RMS distance from the base model's sample (same prompt + seed)

The base model's samples (LoRA off) are drawn once, at the first evaluation, and kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .guard_rewards import GuardSpec, GuardTracker, Trip
from .metrics import mean_ci, prompt_diversity, sample_drift

SampleFn = Callable[[list[Any], list[int]], Tensor]  # (prompts, seeds) -> images
CollateFn = Callable[[list[Any]], Any]  # prompts -> a batch with .texts and .metadata (flowrl.prompts.batch.collate)


def heldout_inputs(prompts: Sequence[Any], seeds: int, seed_base: int) -> tuple[list[Any], list[int], Tensor]:
    """Each prompt repeated ``seeds`` times with seeds ``seed_base + j``.

    Returns:
        (prompts (N,), seeds (N,), group ids (N,) = the prompt's index), N = len(prompts) * seeds.
    """
    rows = [p for p in prompts for _ in range(seeds)]
    seed_list = [seed_base + j for _ in prompts for j in range(seeds)]
    groups = torch.arange(len(prompts)).repeat_interleave(seeds)
    return rows, seed_list, groups


def as_uint8(images: Tensor) -> Tensor:
    """Images in [0, 1] as the 8-bit values a PNG holds (the kept base samples are stored so)."""
    return (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)


@dataclass(frozen=True)
class HeldOutResult:
    """One evaluation: its logged figures, its samples, and what the guards said.

    Attributes:
        metrics: ``eval/*`` and ``guard/*`` figures.
        images: (N, 3, H, W) or (N, F, 3, H, W) samples in [0, 1], prompt-major (``seeds`` per prompt).
        trips: guards that tripped at this evaluation.
        healthy: every guard is within its tolerance of its best (True when there are no guards).
        iteration: the training iteration evaluated.
    """

    metrics: dict[str, float]
    images: Tensor
    trips: list[Trip]
    healthy: bool
    iteration: int


class HeldOutEvaluation:
    """Held-out sampling and scoring with guard rewards, diversity and drift monitors.

    Args:
        prompts: the eval prompts (held out from training).
        seeds: held-out seeds per prompt (``train.eval_seeds``); diversity needs two or more.
        seed_base: the first held-out seed.
        reward: the trained rewards (a MultiReward: ``(images, texts, **metadata) -> RewardOutput``).
        guards: the guard specs (:func:`~flowrl.evaluation.guard_rewards.parse_guards`).
        guard_reward: a MultiReward of the guards that are rewards (None when none is).
        collate: prompts -> batch (``texts``, ``metadata``): :func:`flowrl.prompts.batch.collate`, passed
            in so this package does not import the prompts package (which the models import).
    """

    def __init__(
        self,
        prompts: Sequence[Any],
        seeds: int,
        seed_base: int,
        reward: Any,
        guards: Sequence[GuardSpec] = (),
        guard_reward: Any | None = None,
        *,
        collate: CollateFn,
    ):
        self.prompts, self.seeds, self.groups = heldout_inputs(prompts, seeds, seed_base)
        self.batch = collate(self.prompts)
        self.per_prompt = seeds
        self.reward, self.guard_reward = reward, guard_reward
        self.tracker = GuardTracker(list(guards))
        self.base_images: Tensor | None = None  # uint8, drawn at the first evaluation
        self.base_diversity = math.nan

    @classmethod
    def from_config(
        cls, cfg: Any, prompts: Sequence[Any], reward: Any, seed_base: int, collate: CollateFn
    ) -> HeldOutEvaluation:
        """Build from a run config: ``train.eval_seeds`` and the ``guards`` section (rewards built here)."""
        from ..rewards import build_multi_reward
        from .guard_rewards import parse_guards

        specs = parse_guards(cfg.guards, cfg.rewards)
        scored = {s.name: {**s.options, "weight": 1.0} for s in specs if not s.is_monitor}
        guard_reward = build_multi_reward(scored) if scored else None
        return cls(prompts, cfg.train.eval_seeds, seed_base, reward, specs, guard_reward, collate=collate)

    @property
    def has_guards(self) -> bool:
        """True when the config names at least one guard."""
        return bool(self.tracker.specs)

    def run(self, sample: SampleFn, sample_base: SampleFn, iteration: int) -> HeldOutResult:
        """Sample, score, measure the monitors and update the guards.

        Args:
            sample: (prompts, seeds) -> images with the eval adapter, deterministic.
            sample_base: the same with the LoRA switched off (called once, at the first evaluation).
            iteration: the training iteration evaluated.
        """
        images = sample(self.prompts, self.seeds)
        if self.base_images is None:
            self.base_images = as_uint8(sample_base(self.prompts, self.seeds))
            if self.per_prompt >= 2:
                self.base_diversity = float(prompt_diversity(self.base_images.float() / 255, self.groups).mean())
        batch = self.batch
        scored = self.reward(images, batch.texts, **batch.metadata)
        metrics = {"eval/reward_mean": float(scored.total.mean()), "eval/reward_ci95": mean_ci(scored.total).half_width}
        metrics.update({f"eval/{k}": float(v.float().nanmean()) for k, v in scored.components.items()})
        metrics.update(self._monitors(images))
        guards = self._guards(images, batch.texts, batch.metadata, metrics)
        metrics.update({f"guard/{k}": v for k, v in guards.items()})
        trips, healthy = self.tracker.update(iteration, guards, metrics["eval/reward_mean"])
        if self.has_guards:
            metrics.update(self.tracker.metrics())
        return HeldOutResult(metrics, images, trips, healthy, iteration)

    def _monitors(self, images: Tensor) -> dict[str, float]:
        quantised = as_uint8(images)
        out = {"eval/drift": float(sample_drift(quantised.float() / 255, self.base_images.float() / 255).mean())}
        if self.per_prompt >= 2:
            diversity = float(prompt_diversity(quantised.float() / 255, self.groups).mean())
            out["eval/diversity"] = diversity
            out["eval/diversity_base"] = self.base_diversity
            out["eval/diversity_ratio"] = diversity / self.base_diversity if self.base_diversity > 0 else math.nan
        return out

    def _guards(
        self, images: Tensor, texts: list[str], metadata: dict[str, Any], metrics: dict[str, float]
    ) -> dict[str, float]:
        """Guard name -> its held-out mean (rewards scored here; monitors read from ``metrics``)."""
        out: dict[str, float] = {}
        if self.guard_reward is not None:
            parts = self.guard_reward.score_parts(images, texts, metadata, batch_index="held-out guards")
            out.update({k: float(v.float().nanmean()) for k, v in parts.items()})
        for name, spec in self.tracker.specs.items():
            if spec.is_monitor:
                out[name] = metrics.get(f"eval/{name}", math.nan)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The guard tracker's state (the base samples are drawn again on resume: same seeds, same images)."""
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.tracker.load_state_dict(state)
