"""SAGE-GRPO: Flow-GRPO's clipped ratio loss with a gradient-norm equaliser and a dual trust region.

A stored transition ``x_j -> x_{j+1}`` was drawn from ``N(mu_old, s_j^2)`` by the rollout policy;
every SDE step's mean is affine in the velocity, ``mu = a_j + b_j v``. With ``x' = mu + s_j z``
the log-prob's gradient is ``d log p / d v = b_j z / (s_j D)`` (mean over D elements), so its
norm scales with the step's sensitivity ``g_j = |b_j| / s_j`` (``|dt| / s_j`` plus the score
term's share of ``b_j``). For sample i at step j:

    c_j    = median_k(g_k) / g_j                  (k over the trajectory's stochastic steps)
    L_pg   = mean_i c_j max(-A_i rho, -A_i clip(rho, 1 - eps, 1 + eps))
    KL_anc = mean_i mean_elem (mu_theta - mu_anchor)^2 / (2 s_j^2)   anchor = copy of theta,
                                                                      refreshed every K updates
    KL_stp = mean_i mean_elem (mu_theta - mu_old)^2 / (2 s_j^2)      old = the rollout policy
    L      = L_pg + beta (w_anc KL_anc + w_stp KL_stp)

Both KLs are the closed form ``KL(N(mu_1, s^2) || N(mu_2, s^2))`` per element. The reference's
step-wise term is the sampled estimate ``mean(log p_old(x') - log p_theta(x'))``, whose
expectation over ``x' ~ p_old`` is ``KL_stp``; the closed form has no sampling noise. While no
optimizer update has happened since the rollout, theta *is* the rollout policy and ``KL_stp = 0``
with no extra forward pass; later updates of the same iteration read ``mu_old`` from a frozen
"rollout" adapter (a copy of theta taken when the iteration's rollout was sampled).

After each optimizer update the KL weight adapts to the update's mean ``KL_eff = w_anc KL_anc +
w_stp KL_stp`` (proportional controller of Ziegler et al., 2019):

    beta <- clamp(beta (1 + clip(KL_eff / target - 1, -r, r)), beta_min, beta_max)

and every K-th update the "anchor" adapter becomes a hard copy of theta (K = 0: the anchor is
the base model, LoRA switched off).

With ``tree: true`` the same loss runs on the edges of branching tree rollouts (BranchGRPO's
micro-batches, depth-wise advantages and ``1 / E`` edge weights); a split step's std is scaled,
so its sensitivity is ``g_j / scale_j``. docs/sage-grpo.md lists the knobs.

References:
    Zheng et al., "Manifold-Aware Exploration for RL in Video Generation" (SAGE-GRPO),
    arXiv 2603.21872, 2026 (Tencent-Hunyuan/SAGE-GRPO).
    Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593, 2019.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from ..models.adapter import Cond, ModelAdapter, select_cond
from ..policy.lora import adapters_disabled, add_frozen_copy, soft_update, use_adapter
from ..samplers.sde_steps import get_sde_step
from ..samplers.tree import branch_step
from ..samplers.types import SDEStep
from .base import Microbatch, Objective, RolloutBatch, check_ranges
from .flow_grpo import policy_terms, transition_kl
from .planning import EdgeMicrobatch, chunk_children, plan_transitions, plan_tree_edges

ANCHOR = "anchor"
ROLLOUT = "rollout"


def velocity_under(model: ModelAdapter, adapter: str | None, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
    """The velocity with LoRA adapter ``adapter`` active ("default" = theta, None = base model)."""
    if adapter == "default":
        return model.velocity(x, sigma, cond)
    switch = adapters_disabled(model.transformer) if adapter is None else use_adapter(model.transformer, adapter)
    with switch:
        return model.velocity(x, sigma, cond)


def step_sensitivity(sde: str, sigmas: Tensor, levels: Tensor) -> Tensor:
    """``g_j = |d mean / d v| / std`` of every step of a grid, in float64.

    The derivative is read off the step function itself (every registered step's mean is
    affine in v), so the same code serves the Flow-SDE, Dance-SDE, CPS and SAGE steps; for SAGE
    it is ``(|dt| + s^2 (1 - sigma) / (2 sigma)) / s``.

    Args:
        sde: name of the step in :data:`flowrl.samplers.SDE_STEPS`.
        sigmas: (T + 1,) grid.
        levels: (T,) noise level per step.

    Returns:
        (T,) float64; NaN where the step is deterministic (std 0).
    """
    step_fn = get_sde_step(sde)
    sigma, sigma_next = sigmas[:-1].double(), sigmas[1:].double()
    zero = torch.zeros(len(sigma), 1, 1, dtype=torch.float64)
    one = torch.ones_like(zero)
    level = levels.double()
    slope = step_fn(zero, one, sigma, sigma_next, level, prev_sample=zero).mean
    base = step_fn(zero, zero, sigma, sigma_next, level, prev_sample=zero)
    std = base.std.reshape(-1)
    g = (slope - base.mean).reshape(-1).abs() / std
    return torch.where(std > 0, g, torch.full_like(g, float("nan")))


def equaliser_scales(g: Tensor) -> Tensor:
    """``c_j = median(g) / g_j`` over the finite entries of g; 1 elsewhere.

    The median is ``torch.median`` (the lower middle value for an even count), as the reference
    computes it. Each step's loss times ``c_j`` has a gradient norm of ``median(g) |z| / D``.

    Args:
        g: (T,) step sensitivities from :func:`step_sensitivity` (NaN = not stochastic).

    Returns:
        (T,) float64 scales.
    """
    finite = torch.isfinite(g) & (g > 0)
    if not finite.any():
        return torch.ones_like(g, dtype=torch.float64)
    median = torch.median(g[finite].double())
    return torch.where(finite, median / g.double(), torch.ones_like(g, dtype=torch.float64))


def adapt_kl_weight(beta: float, kl: float, target: float, rate: float, lo: float, hi: float) -> float:
    """``clamp(beta (1 + clip(kl / target - 1, -rate, rate)), lo, hi)``: up when kl > target.

    A non-finite ``kl`` (a step whose KL overflowed) leaves ``beta`` unchanged.
    """
    if not math.isfinite(kl):
        return beta
    error = min(max(kl / target - 1.0, -rate), rate)
    return min(max(beta * (1.0 + error), lo), hi)


class Edges(NamedTuple):
    """The stored transitions of one micro-batch: flat (one per sample) or tree edges.

    Attributes:
        x: (p, ...) parent latents the model runs on (once per parent).
        cond: conditioning of the p parents.
        local: (e,) parent row of each edge.
        x_next: (e, ...) stored children.
        old_log_prob: (e,) rollout-time log-density of each edge.
        advantages: (e,) advantage of each edge.
        weights: (e,) loss weight of each edge (``keep * mb.weight / kept`` flat; BranchGRPO's ``1 / E`` on trees).
        step: index of the step in the grid.
        sigmas, levels: (T + 1,) grid and (T,) noise levels.
        noise_scales: (T,) std multipliers of a tree's split steps; None for flat trajectories.
        sde: the SDE step's name.
    """

    x: Tensor
    cond: Cond
    local: Tensor
    x_next: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    weights: Tensor
    step: int
    sigmas: Tensor
    levels: Tensor
    noise_scales: Tensor | None
    sde: str

    @property
    def noise_scale(self) -> float:
        """The std multiplier of this step (1.0 for flat trajectories and unsplit tree steps)."""
        return 1.0 if self.noise_scales is None else float(self.noise_scales[self.step])


def flat_edges(batch: RolloutBatch, mb: Microbatch) -> Edges:
    """A chunk of flat trajectories at one step; zero-variance groups weigh 0, the kept rows ``mb.weight / kept``."""
    traj, idx, j = batch.trajectory, mb.index, mb.step
    keep = batch.keep[idx].float()
    return Edges(
        traj.latents[idx, j],
        select_cond(batch.cond, idx),
        torch.arange(len(idx)),
        traj.latents[idx, j + 1],
        traj.log_probs[idx, j],
        batch.advantages[idx],
        keep * mb.weight / keep.sum().clamp(min=1.0),
        j,
        traj.sigmas,
        traj.noise_levels,
        None,
        traj.sde,
    )


def tree_edges(batch: RolloutBatch, mb: EdgeMicrobatch) -> Edges:
    """The trained edges below one frontier chunk of a tree step (BranchGRPO's micro-batch)."""
    tb, t, parents = batch.tree, mb.step, mb.index
    tr = tb.rollout
    children, local = chunk_children(parents, int(tr.factors[t]), tb.train[t])
    return Edges(
        tr.nodes[t][parents],
        select_cond(tb.cond, tr.trees(t)[parents]),
        local,
        tr.nodes[t + 1][children],
        tr.log_probs[t][children],
        tb.advantages[t][children],
        torch.full((len(children),), float(mb.weight)),
        t,
        tr.sigmas,
        tr.noise_levels,
        tr.noise_scales,
        tr.sde,
    )


@dataclass
class SageGRPO(Objective):
    """SAGE-GRPO objective (reference defaults in parentheses).

    Args:
        clip_range: PPO epsilon (1e-4).
        equalise: scale each step's policy loss by ``median(g) / g_j`` (on).
        anchor_every: K, refresh the anchor adapter every K optimizer updates (10); 0 keeps the
            base model (LoRA off) as a fixed anchor.
        anchor_weight: weight of the anchor KL inside ``KL_eff`` (1.0).
        step_kl_weight: weight of the step-wise KL to the rollout policy (0.1).
        kl_init, kl_min, kl_max: initial value and bounds of the adaptive beta (1e-7, 1e-7, 1e-5).
        kl_target: the KL_eff the controller steers to (the reference passes ``kl_weight``, 1e-5).
        kl_rate: largest relative change of beta per update (0.2).
        updates_per_iteration: optimizer steps per iteration.
        tree: train on branching tree rollouts (``sampler.tree``), one loss term per edge with
            BranchGRPO's depth-wise advantages and edge weighting, instead of flat trajectories.
        ratio_norm: GRPO-Guard's ratio normalisation (off; :func:`flowrl.objectives.flow_grpo.guard_log_ratio`);
            later updates of an iteration read ``mu_old`` from the frozen "rollout" adapter.
    """

    clip_range: float = 1e-4
    equalise: bool = True
    anchor_every: int = 10
    anchor_weight: float = 1.0
    step_kl_weight: float = 0.1
    kl_init: float = 1e-7
    kl_min: float = 1e-7
    kl_max: float = 1e-5
    kl_target: float = 1e-5
    kl_rate: float = 0.2
    updates_per_iteration: int = 1
    tree: bool = False
    ratio_norm: bool = False
    name: str = "sage_grpo"

    def __post_init__(self) -> None:
        checks = {
            "clip_range": self.clip_range > 0,
            "anchor_every": self.anchor_every >= 0,
            "anchor_weight": self.anchor_weight >= 0,
            "step_kl_weight": self.step_kl_weight >= 0,
            "kl_target": self.kl_target > 0,
            "kl_init": self.kl_init >= 0,
            "kl_min": self.kl_min >= 0,
            "kl_max": self.kl_max >= 0,
            "kl_rate": 0 <= self.kl_rate < 1,
            "updates_per_iteration": self.updates_per_iteration >= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/sage_grpo.py")
        if not 0 <= self.kl_min <= self.kl_init <= self.kl_max:
            raise ValueError(
                f"objective needs 0 <= kl_min <= kl_init <= kl_max; got {self.kl_min}, {self.kl_init}, {self.kl_max}"
            )
        if self.kl_init == 0 < self.kl_max:
            raise ValueError(
                f"objective.kl_init=0 with kl_max={self.kl_max}: beta adapts by factors, so it can never leave 0; "
                "set kl_init (and kl_min) > 0, or kl_max=0 to train without the KL"
            )
        self.beta = self.kl_init
        self.updates = 0  # optimizer updates so far
        self.refreshes = 0  # anchor refreshes so far
        self.since_refresh = 0  # updates since the anchor was last equal to theta
        self.iteration_updates = 0  # updates since this iteration's rollout
        self._kl_sum, self._kl_count = 0.0, 0

    @property
    def uses_rollout_adapter(self) -> bool:
        """A frozen copy of the rollout policy is needed only when theta moves within an iteration."""
        return self.updates_per_iteration > 1 and (self.step_kl_weight > 0 or self.ratio_norm)

    def setup(self, model: ModelAdapter) -> None:
        """Add the frozen "anchor" adapter (K > 0) and the "rollout" adapter (several updates per iteration)."""
        if self.anchor_every > 0:
            add_frozen_copy(model.transformer, ANCHOR)
        if self.uses_rollout_adapter:
            add_frozen_copy(model.transformer, ROLLOUT)

    @property
    def rollout(self) -> str:
        """The rollout kind: "tree" (branching tree rollouts, trained per edge) or "sde" (flat trajectories)."""
        return "tree" if self.tree else "sde"

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Plan the micro-batches of one iteration, split into ``updates_per_iteration`` optimizer steps.

        Every (chunk, stochastic step) pair once as Flow-GRPO plans it; on trees, every
        (step, frontier chunk) with a trained edge once, as BranchGRPO plans it.
        """
        if batch.tree is not None:
            return plan_tree_edges(batch, generator, self.updates_per_iteration)
        return plan_transitions(batch, generator, self.updates_per_iteration)

    def step_scale(self, sde: str, sigmas: Tensor, levels: Tensor, noise_scales: Tensor | None, step: int) -> float:
        """The equaliser's ``c_j`` (1 when off); a tree's split steps have their std scaled, so g / scale."""
        if not self.equalise:
            return 1.0
        g = step_sensitivity(sde, sigmas, levels)
        if noise_scales is not None:
            g = g / noise_scales.double()
        g = torch.where(levels > 0, g, torch.full_like(g, float("nan")))  # median over stochastic steps
        return float(equaliser_scales(g)[step])

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """Start one optimizer step's KL_eff mean afresh (a step the update guard skipped left its sum behind)."""
        self._kl_sum, self._kl_count = 0.0, 0

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Equalised clipped ratio loss plus beta times the dual-trust-region KL of one micro-batch."""
        edges = tree_edges(batch, mb) if batch.tree is not None else flat_edges(batch, mb)
        step_fn = get_sde_step(edges.sde)
        n_parents, n_edges = len(edges.x), len(edges.local)
        sigma_p = edges.sigmas[edges.step].float().expand(n_parents)
        sigma = edges.sigmas[edges.step].float().expand(n_edges)
        sigma_next = edges.sigmas[edges.step + 1].float().expand(n_edges)
        level = float(edges.levels[edges.step])

        def recompute(adapter: str | None = "default") -> SDEStep:
            v = velocity_under(model, adapter, edges.x, sigma_p, edges.cond)[edges.local]
            x = edges.x[edges.local]
            return branch_step(step_fn, x, v, sigma, sigma_next, level, edges.noise_scale, prev_sample=edges.x_next)

        step = recompute()
        rollout_adapter = ROLLOUT if self.iteration_updates > 0 else "current"
        old_mean = self._other_mean(rollout_adapter, step, recompute) if self.ratio_norm else None
        per_edge, ratio = policy_terms(
            step, edges.old_log_prob, old_mean, edges.advantages, self.clip_range, sigma - sigma_next
        )
        scale = self.step_scale(edges.sde, edges.sigmas, edges.levels, edges.noise_scales, edges.step)
        policy = scale * (per_edge * edges.weights).sum()
        anchor_mean = self._other_mean(self._anchor_adapter(), step, recompute)
        kl_anchor = (transition_kl(step.mean, anchor_mean, step.std) * edges.weights).sum()
        kl_step = torch.zeros((), dtype=policy.dtype)
        if self.step_kl_weight > 0:
            old_mean = old_mean if old_mean is not None else self._other_mean(rollout_adapter, step, recompute)
            kl_step = (transition_kl(step.mean, old_mean, step.std) * edges.weights).sum()
        kl_eff = self.anchor_weight * kl_anchor + self.step_kl_weight * kl_step
        self._kl_sum += float(kl_eff.detach())
        self._kl_count += 1
        stats = {
            "ratio": float(ratio.detach().mean()),
            "clipfrac": float(((ratio.detach() - 1).abs() > self.clip_range).float().mean()),
            "approx_kl": float(0.5 * ((step.log_prob.detach() - edges.old_log_prob) ** 2).mean()),
            "policy_loss": float(policy.detach()),
            "eq_scale": scale,
            "kl_anchor": float(kl_anchor.detach()),
            "kl_step": float(kl_step.detach()),
            "kl_beta": self.beta,
        }
        return policy + self.beta * kl_eff, stats

    def _anchor_adapter(self) -> str | None:
        """The anchor policy's adapter: "current" while it equals theta, else "anchor" (K > 0) or None (base model)."""
        if self.anchor_every == 0:
            return None
        return "current" if self.since_refresh == 0 else ANCHOR

    @staticmethod
    def _other_mean(adapter: str | None, step: SDEStep, recompute: Callable[[str | None], SDEStep]) -> Tensor:
        """Transition mean of another policy on the same stored step (no grad).

        ``adapter`` "current" means the other policy's weights equal theta's right now, so its
        mean is theta's (detached) and no forward pass is needed; None is the base model.
        """
        if adapter == "current":
            return step.mean.detach()
        with torch.no_grad():
            return recompute(adapter).mean

    def sync_step(self, reduce_sum: Callable[[Tensor], Tensor], microbatches: int) -> None:
        """Several processes: the step's KL_eff summed over the ranks, averaged over all its micro-batches."""
        self._kl_sum = float(reduce_sum(torch.tensor([self._kl_sum], dtype=torch.float64)))
        self._kl_count = microbatches

    def after_update(self, model: ModelAdapter) -> dict[str, float]:
        """After each optimizer step: adapt beta to the update's mean KL_eff, refresh the anchor every K."""
        kl = self._kl_sum / max(self._kl_count, 1)
        self._kl_sum, self._kl_count = 0.0, 0
        self.beta = adapt_kl_weight(self.beta, kl, self.kl_target, self.kl_rate, self.kl_min, self.kl_max)
        self.updates += 1
        self.iteration_updates += 1
        self.since_refresh += 1
        if self.anchor_every > 0 and self.updates % self.anchor_every == 0:
            soft_update(model.transformer, ANCHOR, keep=0.0)
            self.refreshes += 1
            self.since_refresh = 0
        return {"kl_eff": kl, "anchor_refreshes": float(self.refreshes)}

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """Snapshot theta as the next iteration's rollout policy (when several updates per iteration)."""
        if self.uses_rollout_adapter:
            soft_update(model.transformer, ROLLOUT, keep=0.0)
        self.iteration_updates = 0
        return {"updates": float(self.updates)}

    def state_dict(self) -> dict[str, float | int]:
        """The scalar state that must survive a resume (adapters are saved by the trainer)."""
        return {
            "beta": self.beta,
            "updates": self.updates,
            "refreshes": self.refreshes,
            "since_refresh": self.since_refresh,
            "iteration_updates": self.iteration_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.beta = float(state["beta"])
        self.updates = int(state["updates"])
        self.refreshes = int(state["refreshes"])
        self.since_refresh = int(state["since_refresh"])
        self.iteration_updates = int(state.get("iteration_updates", 0))
