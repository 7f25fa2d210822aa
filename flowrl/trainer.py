"""The single online-RL training loop: sample -> score -> advantages -> objective -> LoRA update.

The loop is written once; the algorithm-specific part is an :class:`~flowrl.objectives.Objective`.
Its whole state (LoRA weights, optimizer, RNGs, counters) round-trips through
:meth:`Trainer.state_dict`, so a run can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import Tensor

from .advantages.group import compute_advantages
from .config import Config
from .policy.guidance import apply_guidance
from .policy.lora import add_lora, adapter_names, lora_state_dict, load_lora_state, use_adapter
from .models.adapter import CountingAdapter, ModelAdapter, model_latent_shape, output_resolution
from .objectives import OBJECTIVES, Objective, RolloutBatch
from .policy.memory import apply_memory_settings, trainable_attention
from .prompts.cache import PromptCache
from .prompts.files import Prompt
from .prompts.batch import collate, sample_groups
from .rollouts.chunked import chunked_rollout, chunked_solve, sample_images, sigma_window_levels
from .samplers.rollout import sde_noise_levels
from .rollouts.scoring import RolloutScorer, batch_index
from .rollouts.scoring_process import ScoringProcess
from .models.pipeline_schedule import run_sigmas
from .samplers.windows import progressive_window_start, random_window_start, window_noise_levels
from .tree.rollouts import TreeCollector, uses_tree

EVAL_SEED_BASE = 1_000_000  # held-out seeds: training noise comes from the run's generator instead


def build_objective(cfg: Config) -> Objective:
    """Instantiate the configured objective."""
    return OBJECTIVES[cfg.objective["name"]](**cfg.objective)


class Trainer:
    """Online RL on a model adapter with a LoRA policy.

    Args:
        cfg: validated run config.
        model: model adapter (the LoRA is attached to ``model.transformer`` here).
        reward: a reward callable returning ``(total (B,), components)`` (``MultiReward``).
        train_prompts: prompts to sample groups from.
        eval_prompts: prompts for held-out-seed evaluation.
    """

    def __init__(self, cfg: Config, model: ModelAdapter, reward: Any, train_prompts: list[Prompt], eval_prompts: list[Prompt]):
        self.cfg, self.reward = cfg, reward
        if not isinstance(model, CountingAdapter):  # true CFG folds into velocity; scale 1.0 leaves the model as is
            model = apply_guidance(model, cfg.sampler.guidance_scale, cfg.prompts.negative)
        if not isinstance(model, CountingAdapter):  # memory controls wrap the adapter once, inside the counter
            model = CountingAdapter(apply_memory_settings(model, cfg.memory))
        self.model = model
        self.device = torch.device(getattr(model, "device", "cpu"))  # where the denoiser runs; the RNG stays on the CPU
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.resolution = output_resolution(cfg.model.resolution, model)
        self.latent_shape = latent = model_latent_shape(model, self.resolution, cfg.model.num_frames)
        s = cfg.sampler
        self.sigmas = run_sigmas(model, s.schedule, s.num_steps, shift=s.shift, resolution=self.resolution, latent=latent)
        eval_steps = cfg.train.eval_steps
        self.eval_sigmas = self.sigmas if eval_steps is None else run_sigmas(
            model, s.schedule, eval_steps, shift=s.shift, resolution=self.resolution, latent=latent
        )
        self.noise_levels = sde_noise_levels(s.num_steps, s.noise_level)
        targets = cfg.lora.targets or list(model.lora_target_modules)
        self.params = add_lora(model.transformer, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=targets)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        self.objective = build_objective(cfg)
        self.objective.setup(model)
        self.prompt_cache = PromptCache(self.model, cfg.prompts.cache_dir)
        if cfg.memory.free_encoders_when_cached:
            self._free_encoders()
        self.window_levels = sigma_window_levels(self.sigmas, s.noise_level, *s.sde_window) if s.solver == "sde_window" else None
        self.tree = TreeCollector(cfg, self.objective.rollout == "tree") if uses_tree(cfg, self.objective) else None
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.iteration = 0
        self.samples_seen = 0
        self._scoring_process: ScoringProcess | None = None

    def scorer(self, prompts: Any) -> RolloutScorer:
        """A :class:`RolloutScorer` for this iteration's batch, in the ``train.rewards_async`` mode."""
        mode, pieces = self.cfg.train.rewards_async, self.cfg.train.score_chunk_size
        first = batch_index(self.iteration, 0, len(prompts.texts), self.cfg.sampler.chunk_size, pieces)
        return RolloutScorer(self.reward, self.model.decode, prompts.texts, prompts.metadata, threaded=mode in (True, "thread"),
                             first_index=first, worker=self.scoring_process() if mode == "process" else None, score_chunk_size=pieces)

    def scoring_process(self) -> ScoringProcess:
        """The worker process of ``train.rewards_async: process``, started on first use and kept for the run."""
        if self._scoring_process is None:
            decoder = getattr(self.model, "decoder", None)
            if decoder is None:
                raise ValueError(f"train.rewards_async=process needs the model adapter ({type(self.model).__name__}) to define "
                                 "decoder() (a picklable decode); use train.rewards_async=thread")
            self._scoring_process = ScoringProcess(self.reward, decoder(), threads=torch.get_num_threads())
        return self._scoring_process

    def close(self) -> None:
        """Stop the scoring process, if one was started (also stopped when Python exits)."""
        if self._scoring_process is not None:
            self._scoring_process.close()
            self._scoring_process = None

    def _free_encoders(self) -> None:
        """Cache every train/eval prompt, then drop the text encoders.

        Under true CFG each cached entry already holds the negative prompt's tensors
        (``GuidedAdapter.encode_prompt``), so nothing else needs the encoders afterwards.
        """
        self.prompt_cache.warm([p.text for p in self.train_prompts + self.eval_prompts])
        self.model.free_text_encoders()

    # -- one iteration -------------------------------------------------------------------------

    def collect(self) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Sample groups, roll out with SDE noise, decode, score and compute advantages."""
        p = self.cfg.prompts
        prompts = sample_groups(self.train_prompts, p.per_iteration, p.group_size, self.generator)
        cond = self.prompt_cache.encode(prompts.texts)  # each distinct prompt encoded once per run
        if self.tree is not None:  # BranchGRPO, or solver objectives on tree leaves (flowrl/tree/rollouts.py)
            return self.tree.collect(self, prompts, cond)
        shape = (len(prompts.texts), *self.latent_shape)
        x_init = torch.randn(shape, generator=self.generator).to(self.device)
        with self.scorer(prompts) as scorer:
            samples, traj = self._rollout(cond, x_init, on_chunk=scorer.submit)  # chunk k scored while k + 1 samples
            images, scored = scorer.result(samples)
        adv, keep, stats = self.advantages(scored.components, prompts.group_ids)
        batch = RolloutBatch(
            prompts.texts, prompts.group_ids, cond, samples, traj, self.sigmas, images.cpu(), scored.total.cpu(), adv, keep,
            self.cfg.sampler.chunk_size,
        )
        info = {"zero_std_groups": torch.tensor(float(stats.zero_std_groups)), **{f"reward/{k}": v for k, v in scored.components.items()}}
        return batch, info

    def advantages(self, components: dict[str, Tensor], group_ids: Tensor) -> tuple[Tensor, Tensor, Any]:
        """``advantage`` config applied to per-component rewards (B,): computed on the CPU, returned
        (advantages, keep) on the model's device, plus the statistics."""
        a = self.cfg.advantage
        adv, keep, stats = compute_advantages(
            {k: v.cpu() for k, v in components.items()}, self.reward.weights, group_ids.cpu(),
            method=a.method, std=a.std, eps=a.eps, clip=a.clip,
        )
        return adv.to(self.device), keep.to(self.device), stats

    def sde_levels(self) -> Tensor:
        """Per-step noise levels of this iteration's SDE rollout (T,): all steps but the last,
        or only an SDE window (random, progressive or fixed; MixGRPO / Flow-GRPO-Fast)."""
        s = self.cfg.sampler
        if s.window == "none":
            return self.noise_levels
        if s.window == "fixed":
            start = s.window_start
        elif s.window == "random":
            start = random_window_start(s.num_steps, s.window_size, *s.window_range, generator=self.generator)
        else:
            start = progressive_window_start(self.iteration, s.num_steps, s.window_size, s.window_shift_every)
        return window_noise_levels(s.num_steps, s.noise_level, start, s.window_size)

    def _rollout(self, cond: dict[str, Tensor], x_init: Tensor, on_chunk: Any = None) -> tuple[Tensor, Any]:
        """Sample with the objective's adapter: stored SDE transitions, or a black-box solver.
        ``on_chunk(rows, latents)`` receives each chunk's clean latents as soon as it is done."""
        s, chunk = self.cfg.sampler, self.cfg.sampler.chunk_size
        with use_adapter(self.model.transformer, self.objective.sampling_adapter):
            if self.objective.rollout == "sde":
                traj = chunked_rollout(
                    self.model, cond, x_init, self.sigmas, self.sde_levels(), chunk_size=chunk, generator=self.generator, sde=s.sde,
                    on_chunk=on_chunk,
                )
                return traj.latents[:, -1], traj
            samples = chunked_solve(
                self.model, cond, x_init, self.sigmas, solver=s.solver, chunk_size=chunk,
                noise_levels=self.window_levels, generator=self.generator, on_chunk=on_chunk,
            )
        return samples, None

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Run the objective's plan: one optimizer step per planned group of micro-batches
        (attention kernels with a working backward pass: ``flowrl.policy.memory.trainable_attention``)."""
        with trainable_attention(self.device):
            return self._update(batch)

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        totals: dict[str, float] = {}
        count = 0
        first_ratio = None
        update_stats: dict[str, float] = {}
        for group in self.objective.plan(batch, self.generator):
            self.optimizer.zero_grad(set_to_none=True)
            for mb in group:
                loss, stats = self.objective.loss(self.model, batch, mb)
                if not torch.isfinite(loss):
                    raise ValueError(
                        f"non-finite loss at iteration {self.iteration} (objective {self.objective.name}); "
                        "lower optim.lr or check the rewards for extreme values"
                    )
                (loss / len(group)).backward()
                first_ratio = stats.get("ratio") if first_ratio is None else first_ratio
                for k, v in {"loss": float(loss.detach()), **stats}.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(grad_norm) * len(group)
            self.optimizer.step()
            after_update = getattr(self.objective, "after_update", None)  # optional hook (SAGE-GRPO)
            update_stats = after_update(self.model) if after_update is not None else {}
        out = {k: v / max(count, 1) for k, v in totals.items()}
        out.update(update_stats)
        if first_ratio is not None:
            out["first_ratio"] = first_ratio
        return out

    def train_step(self) -> dict[str, float]:
        """One iteration; returns scalar metrics."""
        start = time.perf_counter()
        batch, info = self.collect()
        t_sample = time.perf_counter() - start
        stats = self.update(batch)
        self.iteration += 1
        stats.update(self.objective.after_iteration(self.model, self.iteration))
        self.samples_seen += len(batch.prompts)
        metrics = {
            "iteration": float(self.iteration),
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std(unbiased=False)),
            **{k: float(v.float().nanmean()) if v.numel() > 1 else float(v) for k, v in info.items()},
            **{f"train/{k}": v for k, v in stats.items()},
            "nfe": float(self.model.nfe),
            "prompt_cache/hits": float(self.prompt_cache.hits),
            "prompt_cache/misses": float(self.prompt_cache.misses),
            "time/sample_s": t_sample,
            "time/iteration_s": time.perf_counter() - start,
        }
        return metrics

    # -- evaluation ----------------------------------------------------------------------------

    def sample(self, prompts: list[Prompt], seeds: list[int]) -> Tensor:
        """ODE samples (no noise) for prompt/seed pairs with the eval adapter: images (B, 3, H, W),
        on ``train.eval_steps`` Euler steps (default: the rollout's ``sampler.num_steps``).

        Evaluation is not counted in the training NFE.
        """
        batch, nfe = collate(prompts), self.model.nfe
        try:
            with use_adapter(self.model.transformer, self.objective.eval_adapter):
                return sample_images(
                    self.model, batch.texts, seeds, self.eval_sigmas, resolution=self.resolution, chunk_size=max(self.cfg.sampler.chunk_size, 64),
                    frames=self.cfg.model.num_frames, encode=self.prompt_cache.encode,
                )
        finally:
            self.model.nfe = nfe

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Reward of ODE samples on the eval prompts with held-out seeds."""
        k = self.cfg.train.eval_seeds
        prompts = [p for p in self.eval_prompts for _ in range(k)]
        seeds = [EVAL_SEED_BASE + j for _ in self.eval_prompts for j in range(k)]
        images = self.sample(prompts, seeds)
        batch = collate(prompts)
        scored = self.reward(images, batch.texts, **batch.metadata)
        out = {"eval/reward_mean": float(scored.total.mean())}
        for name, value in scored.components.items():
            out[f"eval/{name}"] = float(value.float().nanmean())
        return out

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: LoRA, optimizer, RNGs and counters."""
        return {
            "lora": lora_state_dict(self.model.transformer),
            "adapters": {n: lora_state_dict(self.model.transformer, n) for n in adapter_names(self.model.transformer) if n != "default"},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # detach from live tensors
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "iteration": self.iteration,
            "samples_seen": self.samples_seen,
            "nfe": self.model.nfe,
            "objective": self.objective.state_dict() if hasattr(self.objective, "state_dict") else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        load_lora_state(self.model.transformer, state["lora"])
        for name, weights in state.get("adapters", {}).items():
            load_lora_state(self.model.transformer, weights, name)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.iteration = int(state["iteration"])
        self.samples_seen = int(state["samples_seen"])
        self.model.nfe = int(state.get("nfe", 0))
        if state.get("objective") and hasattr(self.objective, "load_state_dict"):
            self.objective.load_state_dict(state["objective"])  # scalar state, e.g. SAGE-GRPO's beta
