"""Sol-RL in the training loop: explore many seeds cheaply, train on few at full precision.

``solrl.mode: regenerate`` (Sol-RL, section 3), per iteration:

1. **Refresh** the explore copy (:mod:`flowrl.policy.precision`) from the trained weights of the
   objective's sampling adapter. It is never trained.
2. **Explore**: for each of the P prompts, N = ``solrl.candidates`` seeds
   (:func:`flowrl.solrl.seeds.candidate_seeds`), their initial noise from
   :func:`flowrl.runtime.seeded_noise`, sampled by the explore copy with ``solrl.explore_steps``
   deterministic ``solrl.explore_solver`` steps and scored. Only ``(seed, reward)`` is kept.
3. **Select** K = ``prompts.group_size`` seeds per prompt with ``solrl.selection``.
4. **Regenerate** exactly those seeds from the same initial noise at full precision and
   ``sampler.num_steps`` through the ordinary rollout path
   (:func:`flowrl.rollouts.collect.collect_rollouts` with ``RolloutContext.initial_noise``), so the
   objective sees an ordinary :class:`~flowrl.objectives.base.RolloutBatch` whose rewards and
   advantages are the stage-2 ones.

``solrl.mode: correct`` (verl-omni's approach, :mod:`flowrl.solrl.correction`): the SDE rollout
itself is drawn by the explore copy and trained with truncated importance weights.

Diagnostics (logged as ``solrl/*``): Kendall tau-b and Spearman rho between the stage-1 and
stage-2 rewards of the selected seeds (per prompt, averaged; and pooled over all prompts), the
top/bottom-K/2 overlap, candidates per second and the time of each stage.

Several processes: in stage 1 rank r explores the prompts ``p`` with ``p % world_size == r``; the
stage-1 rewards are summed over ranks (each rank fills its own rows, zeros elsewhere), so every
rank selects the same seeds; stage 2 is the ordinary owned-rows rollout. ``correct`` runs on one
process only.

References:
    Li et al., "FP4 Explore, BF16 Train: Diffusion Reinforcement Learning via Efficient Rollout
    Scaling" (Sol-RL), arXiv 2604.06916, 2026, section 3 and NVlabs/Sana train_scripts/sol_rl.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..models.adapter import Cond
from ..objectives.base import RolloutBatch
from ..policy.precision import ExploreModel, QuantRule, build_explore, refresh
from ..prompts.batch import PromptBatch
from ..rollouts.chunked import chunked_solve
from ..rollouts.collect import collect_rollouts
from ..runtime import seeded_noise
from .correction import ImportanceWeighted, transition_log_probs, truncated_importance_weights
from .diagnostics import extreme_overlap, kendall_tau, spearman_rho
from .explore import explore_transformer
from .seeds import candidate_seeds, selection_generator
from .selection import select_seeds

if TYPE_CHECKING:
    from ..trainer import Trainer


class Stage1(NamedTuple):
    """What the explore stage of one iteration kept.

    Attributes:
        seeds: (P, N) int64 candidate seeds.
        rewards: (P, N) float64 stage-1 rewards (every rank holds all of them).
        seconds: wall time of the stage (sampling and scoring).
    """

    seeds: Tensor
    rewards: Tensor
    seconds: float


class SolRL:
    """The ``solrl`` rollouts of a :class:`~flowrl.trainer.Trainer` (its ``collect`` dispatches here).

    Args:
        trainer: the trainer, after its objective's ``setup`` (the explore copy merges the
            objective's sampling adapter, e.g. DiffusionNFT's "old").

    Raises:
        ValueError: ``correct`` mode on several processes, or an explore precision this machine
            cannot run (one line from :func:`~flowrl.policy.precision.build_explore`).
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.cfg = trainer.cfg.solrl
        if self.cfg.mode == "correct" and trainer.collective.world_size > 1:
            raise ValueError(
                "solrl.mode=correct runs on one process; launch one process, or use solrl.mode=regenerate "
                "with a solver objective"
            )
        self.explore: ExploreModel = build_explore(
            trainer.policy,
            self.cfg.precision,
            adapter=trainer.objective.sampling_adapter,
            rule=QuantRule(min_features=self.cfg.min_features),
            activations=self.cfg.activations,
            scaling=self.cfg.fp8_scaling,
            fast_accum=self.cfg.fp8_fast_accum,
        )
        self.explore_sigmas = trainer.policy.sigmas(self.cfg.explore_steps)
        self.seed = trainer.cfg.train.seed if self.cfg.seed is None else self.cfg.seed

    def collect(self, prompts: PromptBatch, cond: Cond) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """This iteration's batch and logged tensors, in ``solrl.mode``."""
        start = time.perf_counter()
        refresh(self.explore, self.trainer.policy)
        refreshed = time.perf_counter() - start
        if self.cfg.mode == "regenerate":
            batch, info = self.regenerate(prompts, cond)
        else:
            batch, info = self.correct(prompts, cond)
        info["solrl/refresh_s"] = torch.tensor(refreshed)
        return batch, info

    # -- regenerate ------------------------------------------------------------------------------

    def regenerate(self, prompts: PromptBatch, cond: Cond) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Explore N seeds per prompt, keep K, regenerate them at full precision (module docstring)."""
        t = self.trainer
        num_prompts, k = groups(prompts)
        stage1 = self.explore_stage(prompts, num_prompts, k)
        chosen = self.select(stage1, k)  # (P, K) indices into the candidates
        seeds = torch.gather(stage1.seeds, 1, chosen)
        start = time.perf_counter()
        noise = seeded_noise(t.latent_shape, seeds.reshape(-1).tolist())
        ctx = replace(t.rollout_context(), initial_noise=noise)
        batch, info = collect_rollouts(ctx, t.rollout_kind, prompts, cond)
        seconds = time.perf_counter() - start
        explored = torch.gather(stage1.rewards, 1, chosen)
        regenerated = batch.global_rewards.detach().double().cpu().reshape(num_prompts, k)
        info.update(self.diagnostics(stage1, explored, regenerated, seconds))
        return batch, info

    def explore_stage(self, prompts: PromptBatch, num_prompts: int, k: int) -> Stage1:
        """Sample and score this rank's prompts' candidates with the explore copy; all ranks' rewards."""
        t, n = self.trainer, self.cfg.candidates
        start = time.perf_counter()
        seeds = candidate_seeds(self.seed, t.iteration, num_prompts, n)
        mine = [p for p in range(num_prompts) if p % t.collective.world_size == t.collective.rank]
        rewards = torch.zeros(num_prompts, n, dtype=torch.float64)
        if mine:
            rows = torch.tensor(mine).repeat_interleave(n) * k  # first row of each prompt's group, N times
            batch = repeat_rows(prompts, rows)
            noise = seeded_noise(t.latent_shape, seeds[mine].reshape(-1).tolist()).to(t.device)
            cond = t.prompt_cache.encode(batch.texts)
            with t.scorer(batch) as scorer:
                with explore_transformer(t.model, self.explore.module):
                    samples = chunked_solve(
                        t.model,
                        cond,
                        noise,
                        self.explore_sigmas,
                        solver=self.cfg.explore_solver,
                        chunk_size=t.cfg.sampler.chunk_size,
                        on_chunk=scorer.submit,
                    )
                _, scored = scorer.result(samples)  # the explore images are dropped: only (seed, reward) is kept
            # the stage-1 table lives on the CPU (seeds, selection, diagnostics): GPU-scored rewards come over
            total = torch.where(not_applicable(scored.components), math.nan, scored.total.detach().double().cpu())
            rewards[mine] = fill_missing(total.reshape(len(mine), n))
        rewards = t.collective.sum(rewards)
        return Stage1(seeds, rewards, time.perf_counter() - start)

    def select(self, stage1: Stage1, k: int) -> Tensor:
        """(P, K) ascending candidate indices per prompt, by ``solrl.selection``."""
        generator = selection_generator(self.seed, self.trainer.iteration)
        return torch.stack([select_seeds(r, k, self.cfg.selection, generator) for r in stage1.rewards])

    def diagnostics(self, stage1: Stage1, explored: Tensor, regenerated: Tensor, seconds: float) -> dict[str, Tensor]:
        """Rank agreement of the selected seeds' stage-1 and stage-2 rewards (P, K), and the stage speeds."""
        num_prompts, k = explored.shape
        taus = [kendall_tau(a, b) for a, b in zip(explored, regenerated)] if k >= 2 else []
        rhos = [spearman_rho(a, b) for a, b in zip(explored, regenerated)] if k >= 2 else []
        overlap = [extreme_overlap(a, b, k // 2) for a, b in zip(explored, regenerated)] if k >= 2 else []
        candidates = stage1.rewards.numel()
        pooled = explored.numel() >= 2  # one prompt with one kept seed has no ranking to agree on
        a, b = explored.reshape(-1), regenerated.reshape(-1)
        out = {
            "solrl/kendall_tau": nan_mean(taus),
            "solrl/spearman_rho": nan_mean(rhos),
            "solrl/pooled_kendall_tau": kendall_tau(a, b) if pooled else math.nan,
            "solrl/pooled_spearman_rho": spearman_rho(a, b) if pooled else math.nan,
            "solrl/extreme_overlap": nan_mean(overlap),
            "solrl/explore_reward_mean": float(stage1.rewards.mean()),
            "solrl/selected_explore_reward_mean": float(explored.mean()),
            "solrl/explore_s": stage1.seconds,
            "solrl/regenerate_s": seconds,
            "solrl/explore_candidates_per_s": candidates / stage1.seconds,
            "solrl/regenerate_candidates_per_s": num_prompts * k / seconds,
        }
        return {key: torch.tensor(float(value)) for key, value in out.items()}

    # -- correct ---------------------------------------------------------------------------------

    def correct(self, prompts: PromptBatch, cond: Cond) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """SDE rollouts of the explore copy, reweighted to the full-precision policy (:mod:`.correction`)."""
        t = self.trainer
        objective = t.objective
        if not isinstance(objective, ImportanceWeighted):
            raise TypeError("solrl.mode=correct needs the trainer's objective wrapped by build_objective")
        start = time.perf_counter()
        ctx = replace(t.rollout_context(), sampling_adapter="default")  # the copy has the sampling adapter merged
        with explore_transformer(t.model, self.explore.module):
            batch, info = collect_rollouts(ctx, t.rollout_kind, prompts, cond)
        sampled = time.perf_counter() - start
        traj = batch.trajectory
        log_p = transition_log_probs(t.model, objective.sampling_adapter, batch)
        weights = truncated_importance_weights(log_p, traj.log_probs, self.cfg.is_clip, traj.noise_levels)
        objective.weights = weights
        batch = batch._replace(trajectory=traj._replace(log_probs=log_p))  # the PPO ratio starts at 1 against p
        stochastic = traj.noise_levels > 0
        raw = torch.exp(log_p - traj.log_probs)[:, stochastic.to(log_p.device)]
        seconds = time.perf_counter() - start
        weighted = {
            "solrl/is_weight_mean": weights[:, stochastic].mean(),
            "solrl/is_weight_min": weights[:, stochastic].min(),
            "solrl/is_truncated_share": (raw > self.cfg.is_clip).double().mean(),
            "solrl/log_ratio_abs_mean": (log_p - traj.log_probs)[:, stochastic].abs().mean(),
            "solrl/explore_s": torch.tensor(sampled),
            "solrl/correct_s": torch.tensor(seconds - sampled),
            "solrl/explore_candidates_per_s": torch.tensor(len(prompts.texts) / sampled),
        }
        info.update({k: v.detach().cpu().float() for k, v in weighted.items()})
        return batch, info


def groups(prompts: PromptBatch) -> tuple[int, int]:
    """(P prompts, K samples per prompt) of a batch of equal consecutive groups."""
    num_prompts = int(prompts.group_ids.max()) + 1
    return num_prompts, len(prompts.texts) // num_prompts


def repeat_rows(prompts: PromptBatch, rows: Tensor) -> PromptBatch:
    """The prompts (and metadata) of ``rows`` of a batch, as a new batch; group id = the row's group."""
    index = rows.tolist()
    metadata = {key: [values[i] for i in index] for key, values in prompts.metadata.items()}
    return PromptBatch([prompts.texts[i] for i in index], metadata, prompts.group_ids[rows])


def not_applicable(components: dict[str, Tensor]) -> Tensor:
    """(B,) bool on the CPU: the samples whose every reward component is NaN (their weighted total reads 0)."""
    return torch.stack([c.detach().cpu().isnan() for c in components.values()]).all(dim=0)


def fill_missing(rewards: Tensor) -> Tensor:
    """(P, N) stage-1 rewards with NaN (no applicable reward) set to the prompt's lowest finite one (0 if none)."""
    finite = torch.isfinite(rewards)
    lowest = torch.where(finite, rewards, torch.full_like(rewards, math.inf)).min(dim=1, keepdim=True).values
    lowest = torch.where(torch.isfinite(lowest), lowest, torch.zeros_like(lowest))
    return torch.where(finite, rewards, lowest.expand_as(rewards))


def nan_mean(values: list[float]) -> float:
    """Mean of the non-NaN values (NaN when there are none, e.g. every prompt's rewards were constant)."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan
