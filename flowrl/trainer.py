"""The single online-RL training loop: sample -> score -> advantages -> objective -> LoRA update.

The loop is written once; the algorithm-specific part is an :class:`~flowrl.objectives.Objective`.
Its whole state (LoRA weights, optimizer, RNGs, counters) round-trips through
:meth:`Trainer.state_dict`, so a run can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import Tensor

from .advantages import AdvantageEstimator
from .advantages.group import AdvantageStats
from .config import Config
from .console import stderr_line
from .distributed import (
    Collective,
    agree_fault,
    batch_geometry,
    gather_rows,
    merge_totals,
    sum_gradients,
)
from .evaluation.heldout import HeldOutEvaluation, HeldOutResult
from .guards import StepSnapshot, UpdateGuard, reward_fault, tensor_fault, weight_fault
from .models.adapter import Cond
from .objectives import OBJECTIVES, Objective, RolloutBatch
from .objectives.planning import plan_megabytes
from .policy import Policy
from .policy.lora import adapter_names, adapters_disabled, check_lora_state, load_lora_state, use_adapter
from .policy.memory import trainable_attention
from .prompts.batch import PromptBatch, collate, sample_groups
from .prompts.cache import PromptCache
from .prompts.files import Prompt
from .rewards import MultiReward
from .rollouts.chunked import sample_images, sigma_window_levels
from .rollouts.collect import RolloutContext, collect_rollouts, rollout_kind
from .rollouts.owned import owned_prompts
from .rollouts.scoring import RolloutScorer, batch_index
from .rollouts.scoring_process import ScoringProcess
from .sharding import (
    Lockstep,
    collective_calls,
    full_tensors,
    load_lora_shards,
    local_tensors,
    lora_weights,
    placeholder_backward,
    rank_microbatches,
    run_sharding,
    shard_optimizer_state,
    shard_transformer,
)
from .solrl.correction import ImportanceWeighted
from .solrl.pipeline import SolRL
from .tree.rollouts import tree_spec
from .zero import ZERO_STAGES, ZeroEngine, adapters_gathered

EVAL_SEED_BASE = 1_000_000  # held-out seeds: training noise comes from the run's generator instead


def build_objective(cfg: Config) -> Objective:
    """Instantiate the configured objective (importance-weighted under ``solrl.mode: correct``)."""
    objective = OBJECTIVES[cfg.objective["name"]](**cfg.objective)
    return ImportanceWeighted(objective) if cfg.solrl.mode == "correct" else objective


class Trainer:
    """Online RL on a policy with trainable LoRA weights.

    Args:
        cfg: validated run config.
        policy: the policy from :func:`flowrl.policy.build_policy` with ``trainable=True``
            (adapter stack, LoRA parameters, output geometry).
        reward: the weighted rewards (``(total (B,), components)`` per batch).
        train_prompts: prompts to sample groups from.
        eval_prompts: prompts for held-out-seed evaluation.
        collective: this process's place in a launch (:func:`flowrl.distributed.join_launch`); None =
            one process. Each rank trains on the rows it owns (``train.placement``), gradients summed.

    Raises:
        ValueError: no trainable LoRA parameters, or the batch does not split over the processes.
    """

    def __init__(
        self,
        cfg: Config,
        policy: Policy,
        reward: MultiReward,
        train_prompts: list[Prompt],
        eval_prompts: list[Prompt],
        *,
        collective: Collective | None = None,
    ):
        if not policy.params:
            raise ValueError(
                "the Trainer needs trainable LoRA parameters; build the policy with build_policy(cfg, trainable=True)"
            )
        self.cfg, self.reward, self.policy = cfg, reward, policy
        self.model = policy.model
        self.params = policy.params
        self.device = torch.device(self.model.device)  # where the denoiser runs; the RNG stays on the CPU
        self.train_prompts, self.eval_prompts = train_prompts, eval_prompts
        self.resolution, self.latent_shape = policy.resolution, policy.latent_shape
        s = cfg.sampler
        self.sigmas = policy.sigmas(s.num_steps)
        self.eval_sigmas = self.sigmas if cfg.train.eval_steps is None else policy.sigmas(cfg.train.eval_steps)
        self.advantage = AdvantageEstimator.from_config(cfg.advantage)
        self.objective = build_objective(cfg)
        self.objective.setup(self.model)
        self.collective = collective or Collective()
        self.lockstep: Lockstep | None = None  # sharded: rank 0's evaluation and gathers run on every rank
        sharding = run_sharding(cfg, self.collective)
        if sharding == "fsdp2":  # after setup: the objective's adapters are sharded too
            self.params = shard_transformer(self.model.transformer, self.collective)
        if sharding != "none":
            calls = {"sample": self.sample, "state": self.state_dict, "lora": self.adapter_weights}
            self.lockstep = Lockstep(self.collective, collective_calls(sharding, calls))
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
        self.zero: ZeroEngine | None = None  # train.sharding=zero1|2|3: DeepSpeed's engine steps (flowrl/zero.py)
        if sharding in ZERO_STAGES:
            self.zero = ZeroEngine.start(
                self.model.transformer, self.optimizer, ZERO_STAGES[sharding], o.max_grad_norm, self.collective
            )
        self.prompt_cache = PromptCache(self.model, cfg.prompts.cache_dir)
        if cfg.memory.free_encoders_when_cached:
            self._free_encoders()
        self.rollout_kind = rollout_kind(self.objective.rollout, s.solver)
        self.solver_levels = (
            sigma_window_levels(self.sigmas, s.noise_level, *s.sde_window) if s.solver == "sde_window" else None
        )
        kind = self.rollout_kind
        self.tree = tree_spec(cfg, edges=kind == "tree") if kind in ("tree", "tree_leaves") else None
        self.geometry = batch_geometry(cfg, self.collective, self.rollout_kind)
        self.owners = self.geometry.owners() if self.collective.world_size > 1 else None  # (B,) rank of each row
        self.owned = None if self.owners is None else self.owners == self.geometry.rank
        self.generator = torch.Generator().manual_seed(cfg.train.seed)
        self.iteration = 0
        self.samples_seen = 0
        self._scoring_process: ScoringProcess | None = None
        self.guard = UpdateGuard(cfg.train.max_skipped_updates)
        self.solrl = SolRL(self) if cfg.solrl.mode != "off" else None  # Sol-RL rollouts (flowrl/solrl/pipeline.py)
        self.heldout = HeldOutEvaluation.from_config(cfg, eval_prompts, reward, EVAL_SEED_BASE, collate)

    def scorer(self, prompts: PromptBatch) -> RolloutScorer:
        """A :class:`RolloutScorer` for this iteration's batch, in the ``train.rewards_async`` mode."""
        mode, pieces = self.cfg.train.rewards_async, self.cfg.train.score_chunk_size
        first = batch_index(self.iteration, 0, len(prompts.texts), self.cfg.sampler.chunk_size, pieces)
        return RolloutScorer(
            self.reward,
            self.model.decode,
            prompts.texts,
            prompts.metadata,
            threaded=mode in (True, "thread"),
            first_index=first,
            worker=self.scoring_process() if mode == "process" else None,
            score_chunk_size=pieces,
        )

    def scoring_process(self) -> ScoringProcess:
        """The worker process of ``train.rewards_async: process``, started on first use and kept for the run."""
        if self._scoring_process is None:
            self._scoring_process = ScoringProcess(self.reward, self.model.decoder(), threads=torch.get_num_threads())
        return self._scoring_process

    def close(self, abandon: bool = False) -> None:
        """Stop the scoring process, if one was started (also stopped when Python exits).

        Args:
            abandon: kill it at once instead of letting it finish its chunk (the run failed or was interrupted).
        """
        if self._scoring_process is not None:
            self._scoring_process.close(abandon=abandon)
            self._scoring_process = None

    def _free_encoders(self) -> None:
        """Cache every train/eval prompt, then drop the text encoders.

        Under true CFG each cached entry already holds the negative prompt's tensors
        (``GuidedAdapter.encode_prompt``), so nothing else needs the encoders afterwards.
        """
        self.warm_prompts()
        self.model.free_text_encoders()

    def warm_prompts(self) -> int:
        """Encode every train and eval prompt not cached yet (as a run's start evaluation does for its own).

        Returns:
            How many prompts had to be encoded.
        """
        return self.prompt_cache.warm([p.text for p in self.train_prompts + self.eval_prompts])

    # -- one iteration -------------------------------------------------------------------------

    def collect(self) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Sample prompt groups, roll out, decode, score and compute advantages.

        Uses :func:`flowrl.rollouts.collect.collect_rollouts`, the same path for every rollout kind,
        with the attention kernels :meth:`update` trains with (``flowrl.policy.memory.trainable_attention``),
        so a sample's rollout and training forwards agree bit for bit.
        """
        prompts, cond = self.draw_prompts()
        with trainable_attention():
            if self.solrl is not None:
                return self.solrl.collect(prompts, cond)
            return collect_rollouts(self.rollout_context(), self.rollout_kind, prompts, cond)

    def draw_prompts(self) -> tuple[PromptBatch, Cond]:
        """This iteration's prompt groups (from the trainer's generator) and the conditioning of this rank's rows."""
        p = self.cfg.prompts
        prompts = sample_groups(self.train_prompts, p.per_iteration, p.group_size, self.generator)
        mine = prompts if self.owned is None else owned_prompts(prompts, self.owned)  # a rank encodes only its rows
        return prompts, self.prompt_cache.encode(mine.texts)  # each distinct prompt encoded once per run

    def rollout_context(self) -> RolloutContext:
        """What this iteration's rollout needs: the policy, grid, generator, scorer and advantages."""
        return RolloutContext(
            model=self.model,
            sampling_adapter=self.objective.sampling_adapter,
            sampler=self.cfg.sampler,
            sigmas=self.sigmas,
            latent_shape=self.latent_shape,
            device=self.device,
            generator=self.generator,
            iteration=self.iteration,
            scorer=self.scorer,
            advantages=self.advantages,
            advantage_clip=self.cfg.advantage.clip,
            tree=self.tree,
            solver_levels=self.solver_levels,
            owners=self.owners,
            rank=self.geometry.rank,
            gather_rows=lambda local: gather_rows(self.collective, self.geometry, local),
        )

    def advantages(
        self, components: dict[str, Tensor], group_ids: Tensor, prompts: list[str]
    ) -> tuple[Tensor, Tensor, AdvantageStats]:
        """``advantage`` config applied to per-component rewards (B,) of the B ``prompts``.

        Computed on the CPU; returns (advantages, keep) on the model's device, plus the statistics.
        """
        components = {k: v.cpu() for k, v in components.items()}
        adv, keep, stats = self.advantage(components, self.reward.weights, group_ids.cpu(), prompts)
        return adv.to(self.device), keep.to(self.device), stats

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Run the objective's plan: one optimizer step per planned group of micro-batches.

        Runs with attention kernels that have a working backward pass
        (``flowrl.policy.memory.trainable_attention``).
        """
        with trainable_attention():
            return self._update(batch)

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        totals: dict[str, float] = {}
        count = skipped = position = 0
        first: tuple[int, float] | None = None  # (position in the plan, ratio) of the first trained micro-batch
        update_stats: dict[str, float] = {}
        plan = self.objective.plan(batch, self.generator)
        if not plan:
            self._warn_empty_plan()
        for group in plan:
            parts = rank_microbatches(group, batch, self.owned, None if self.lockstep is None else self.geometry)
            mine = [(position + i, mb, real) for i, mb, real in parts]
            position += len(group)
            self.optimizer.zero_grad(set_to_none=True)
            free = self.lockstep is None and self.zero is None  # sharded forwards must pair with other ranks'
            self.objective.prepare(self.model, batch, [mb for _, mb, real in mine if real] if free else [])
            fault, group_totals, ratio = self._accumulate(batch, mine, len(group))
            fault = agree_fault(self.collective, fault)
            if fault is not None and self.zero is not None:
                self.zero.discard()  # DeepSpeed's buffers hold the gradients of the step not taken
            elif self.zero is not None:  # DeepSpeed reduces, clips and steps (undone on a fault)
                grad_norm, fault = self.zero.step(self.cfg.train.max_lora_weight)
            elif fault is None:
                if self.lockstep is None:  # sharded gradients are already summed (reduce-scatter)
                    sum_gradients(self.params, self.collective)
                grad_norm = full_tensors(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm))
                fault = tensor_fault("the gradient norm", grad_norm) or self._step()
            if fault is not None:  # nothing applied (the steps undo their own): no checkpoint holds bad weights
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                self.guard.skip(fault, self.iteration + 1)
                continue
            self.guard.ok()
            first = ratio if first is None else first
            for k, v in group_totals.items():
                totals[k] = totals.get(k, 0.0) + v
            totals["grad_norm"] = (
                totals.get("grad_norm", 0.0) + float(grad_norm) * len(group) / self.collective.world_size
            )
            count += len(group)
            if self.collective.world_size > 1:
                self.objective.sync_step(self.collective.sum, len(group))
            with adapters_gathered(self.model.transformer, modify=True):  # ZeRO-3: soft updates see whole adapters
                update_stats = self.objective.after_update(self.model)
        totals, first = merge_totals(self.collective, totals, first)
        out = {k: v / max(count, 1) for k, v in totals.items()}
        out.update(update_stats)
        out["skipped_updates"] = float(skipped)
        out["plan_mb"] = plan_megabytes(plan)
        if first is not None:
            out["first_ratio"] = first[1]
        return out

    def _warn_empty_plan(self) -> None:
        """Say (rank 0) that the objective planned nothing though rows were kept: no rollout step has a density."""
        if self.collective.is_main:
            stderr_line(
                f"flowrl: warning: iteration {self.iteration + 1}: {self.objective.name} planned no optimizer step "
                "(no rollout step has noise: sampler.noise_level, sampler.window, or cps's step to sigma 0); "
                "nothing to train on this iteration"
            )

    def _step(self) -> str | None:
        """Apply the optimizer step; when it overflows or leaves bad weights, undo it and return the fault."""
        snapshot = StepSnapshot(self.params, self.optimizer)
        try:
            self.optimizer.step()
            fault = weight_fault(local_tensors(self.params), self.cfg.train.max_lora_weight)
            if self.lockstep is not None:  # each rank checked its shard
                fault = agree_fault(self.collective, fault)
        except RuntimeError as err:
            if "overflow" not in str(err):
                raise
            fault = f"the optimizer step overflowed at lr {self.optimizer.param_groups[0]['lr']:g} ({err})"
        if fault is not None:
            snapshot.restore()
        return fault

    def _accumulate(
        self, batch: RolloutBatch, mine: list[tuple[int, Any, bool]], size: int
    ) -> tuple[str | None, dict[str, float], tuple[int, float] | None]:
        """Backward this rank's micro-batches of one optimizer step of ``size`` micro-batches in all.

        A placeholder micro-batch (``real`` False: a sharded model's lockstep) is backwarded with its
        loss scaled by zero and is not counted (statistics, NFE). A non-finite loss ends the step on
        this rank at once, unless the backward itself is collective (a sharded model's reduce-scatter,
        DeepSpeed's gradient reduction): then this rank backwards that micro-batch scaled by zero and
        the rest as placeholders, so its collectives pair with the other ranks' until the step's
        fault is agreed and the step dropped everywhere.

        Returns (fault, summed stats, (plan position, ratio) of the first micro-batch).
        """
        totals: dict[str, float] = {}
        first = fault = None
        backward = torch.Tensor.backward if self.zero is None else self.zero.backward
        in_step = self.lockstep is not None or self.zero is not None  # every rank must finish the backwards
        for pos, mb, real in mine:
            if not real or fault is not None:
                placeholder_backward(self.objective, self.model, batch, mb, backward)
                continue
            loss, stats = self.objective.loss(self.model, batch, mb)
            fault = tensor_fault(f"the {self.objective.name} loss", loss)
            if fault is not None and not in_step:
                return fault, {}, None
            if fault is not None:
                backward(loss * 0.0)  # gradients dropped with the step: only the collectives count
                continue
            backward(loss / size)
            if first is None and "ratio" in stats:
                first = (pos, stats["ratio"])
            for k, v in {"loss": float(loss.detach()), **stats}.items():
                totals[k] = totals.get(k, 0.0) + v
        return (fault, {}, None) if fault is not None else (None, totals, first)

    def _batch_fault(self, batch: RolloutBatch, info: dict[str, Tensor]) -> str | None:
        """What makes this iteration's rewards or advantages unusable, or None."""
        components = {k.removeprefix("reward/"): v for k, v in info.items() if k.startswith("reward/")}
        return reward_fault(batch.global_rewards, components, self.cfg.train.max_abs_reward) or tensor_fault(
            "the advantages", batch.global_advantages
        )

    def train_step(self) -> dict[str, float]:
        """One iteration; returns scalar metrics.

        The update is skipped (and counted by :attr:`guard`) when the rewards or advantages are
        bad, or per optimizer step when a loss, the gradient norm or the new weights are.
        """
        start, nfe = time.perf_counter(), self.model.nfe
        history = self.advantage.state_dict()  # per-prompt reward history before this batch
        batch, info = self.collect()
        t_sample = time.perf_counter() - start
        fault = self._batch_fault(batch, info)
        if fault is not None:
            self.advantage.load_state_dict(history)  # a skipped batch leaves no trace in later advantages
            self.guard.skip(fault, self.iteration + 1)
            stats = {"skipped_updates": 1.0}
        elif not bool(batch.global_keep.any()):
            if self.collective.is_main:  # every rank sees the same global batch: rank 0 says it for the launch
                stderr_line(
                    f"flowrl: warning: iteration {self.iteration + 1}: every prompt group was dropped (constant "
                    "rewards within each group, or no applicable reward); nothing to train on this iteration"
                )
            stats = {"skipped_updates": 0.0}
        else:
            stats = self.update(batch)
        self.iteration += 1
        with adapters_gathered(self.model.transformer, modify=True):  # ZeRO-3: soft updates see whole adapters
            stats.update(self.objective.after_iteration(self.model, self.iteration))
        if self.collective.world_size > 1:  # every rank counts the model evaluations of all ranks
            self.model.nfe = nfe + int(self.collective.sum(torch.tensor([self.model.nfe - nfe])).item())
        self.samples_seen += batch.size
        metrics = {
            "iteration": float(self.iteration),
            "reward_mean": float(batch.global_rewards.mean()),
            "reward_std": float(batch.global_rewards.std(unbiased=False)),
            **{k: float(v.float().nanmean()) if v.numel() > 1 else float(v) for k, v in info.items()},
            **{f"train/{k}": v for k, v in stats.items()},
            "guard/skipped_total": float(self.guard.total),
            "nfe": float(self.model.nfe),
            "prompt_cache/hits": float(self.prompt_cache.hits),
            "prompt_cache/misses": float(self.prompt_cache.misses),
            "time/sample_s": t_sample,
            "time/iteration_s": time.perf_counter() - start,
        }
        return metrics

    # -- evaluation ----------------------------------------------------------------------------

    def sample(self, prompts: list[Prompt], seeds: list[int], *, base: bool = False) -> Tensor:
        """ODE samples (no noise) for prompt/seed pairs with the eval adapter: images (B, 3, H, W).

        Sampled on ``train.eval_steps`` Euler steps (default: the rollout's ``sampler.num_steps``).
        Evaluation is not counted in the training NFE. ``base``: the base model (LoRA switched off).
        """
        if self.lockstep is not None:  # a sharded model: the other ranks make the same calls
            self.lockstep.announce("sample", prompts, seeds, base=base)
        batch, nfe = collate(prompts), self.model.nfe
        transformer = self.model.transformer
        switch = adapters_disabled(transformer) if base else use_adapter(transformer, self.objective.eval_adapter)
        try:
            with switch, trainable_attention():  # the kernels of the rollouts and training passes
                return sample_images(
                    self.model,
                    batch.texts,
                    seeds,
                    self.eval_sigmas,
                    resolution=self.resolution,
                    chunk_size=max(self.cfg.sampler.chunk_size, 64),
                    frames=self.cfg.model.num_frames,
                    encode=self.prompt_cache.encode,
                )
        finally:
            self.model.nfe = nfe

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Rewards, guard rewards, diversity and drift of ODE samples on the eval prompts with held-out seeds."""
        return self.evaluate_heldout().metrics

    @torch.no_grad()
    def evaluate_heldout(self) -> HeldOutResult:
        """The held-out evaluation (:class:`flowrl.evaluation.heldout.HeldOutEvaluation`) at this iteration."""
        return self.heldout.run(self.sample, lambda p, s: self.sample(p, s, base=True), self.iteration)

    # -- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: LoRA, optimizer, RNGs and counters (full tensors when sharded)."""
        if self.lockstep is not None:  # gathering the shards is collective
            self.lockstep.announce("state")
        return {
            "lora": lora_weights(self.model.transformer),
            "adapters": {
                n: lora_weights(self.model.transformer, n)
                for n in adapter_names(self.model.transformer)
                if n != "default"
            },
            "optimizer": self._optimizer_state(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "iteration": self.iteration,
            "samples_seen": self.samples_seen,
            "nfe": self.model.nfe,
            "objective": self.objective.state_dict(),
            "advantage": self.advantage.state_dict(),
            "guard": self.guard.state_dict(),
            "heldout": self.heldout.state_dict(),  # reward-hacking guards' best values and trips
        }

    def adapter_weights(self, adapter: str = "default") -> dict[str, Tensor]:
        """One LoRA adapter's full weights on the CPU, as a peft state dict (gathered on every rank when sharded)."""
        if self.lockstep is not None:
            self.lockstep.announce("lora", adapter)
        return lora_weights(self.model.transformer, adapter)

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state, detached from the live tensors (shards gathered into full tensors)."""
        if self.zero is not None:  # DeepSpeed's partitions, in the one-process AdamW layout
            return self.zero.optimizer_state()
        state = copy.deepcopy(self.optimizer.state_dict())
        return state if self.lockstep is None else full_tensors(state)

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Check, without loading, that a checkpoint's LoRA adapters and AdamW moments fit this run (keys and shapes).

        The checkpoint must hold this run's extra adapters (no other) and LoRA weights within
        ``train.max_lora_weight``. Whole adapters only; sharded ones (FSDP2, ZeRO-3) are checked by
        :meth:`load_state_dict`.

        Raises:
            ValueError: a LoRA that does not fit (one line).
        """
        if self.lockstep is not None or self.zero is not None:
            return
        self._check_adapter_names(state.get("adapters", {}))
        check_lora_state(self.model.transformer, state["lora"])
        for name, weights in state.get("adapters", {}).items():
            check_lora_state(self.model.transformer, weights, name)
        self._check_lora_size(state["lora"])
        optimizer = state["optimizer"]
        if len(optimizer["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the optimizer state has {len(optimizer['param_groups'])} parameter groups; this run has "
                f"{len(self.optimizer.param_groups)}"
            )
        for pid, entry in optimizer["state"].items():
            shape = tuple(self.params[pid].shape) if 0 <= pid < len(self.params) else None
            bad = [k for k in ("exp_avg", "exp_avg_sq") if tuple(entry[k].shape) != shape]
            if bad or entry["step"].numel() != 1:
                raise ValueError(f"the optimizer state of parameter {pid} does not fit this run's LoRA ({shape})")

    def _check_adapter_names(self, adapters: dict[str, Any]) -> None:
        """Refuse a checkpoint whose extra adapters are not the ones this run's objective keeps (one line)."""
        have = sorted(n for n in adapter_names(self.model.transformer) if n != "default")
        extra, missing = sorted(set(adapters) - set(have)), sorted(set(have) - set(adapters))
        if extra:
            raise ValueError(
                f"adapter-{extra[0]}.safetensors is an adapter this run does not have (it has {have or 'none'}); "
                "resume with the objective that wrote the checkpoint, or from another checkpoint"
            )
        if missing:
            raise ValueError(
                f"the checkpoint has no adapter-{missing[0]}.safetensors, which this run's objective keeps; "
                "resume with the objective that wrote the checkpoint, or from another checkpoint"
            )

    def _check_lora_size(self, weights: dict[str, Tensor]) -> None:
        """Refuse LoRA weights above ``train.max_lora_weight``: the update guard never lets training save them."""
        bound = self.cfg.train.max_lora_weight
        for key, value in sorted(weights.items()):
            top = float(value.detach().abs().max()) if value.numel() else 0.0
            if top > bound:
                raise ValueError(
                    f"lora.safetensors: tensor '{key}' reaches |w| = {top:.3g} > train.max_lora_weight={bound:g} "
                    "(corrupt or edited); resume from another checkpoint"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        load = load_lora_state if self.lockstep is None else load_lora_shards
        load(self.model.transformer, state["lora"])
        for name, weights in state.get("adapters", {}).items():
            load(self.model.transformer, weights, name)
        if self.zero is not None:  # DeepSpeed: masters from the loaded LoRA, moments cut into the partitions
            self.zero.load_optimizer_state(state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
            shard_optimizer_state(self.optimizer)  # sharded parameters: each rank keeps its shard of the moments
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.iteration = int(state["iteration"])
        self.samples_seen = int(state["samples_seen"])
        self.model.nfe = int(state.get("nfe", 0))
        self.objective.load_state_dict(state.get("objective", {}))  # scalar state, e.g. SAGE-GRPO's beta
        self.advantage.load_state_dict(state.get("advantage", {}))  # per-prompt reward history
        self.guard.load_state_dict(state.get("guard", {}))
        self.heldout.load_state_dict(state.get("heldout", {}))
