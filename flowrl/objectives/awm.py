"""AWM: advantage-weighted matching, the pretraining flow-matching loss weighted by advantages.

For a clean rollout sample x0, fresh noise eps and a sigma t drawn from the rollout schedule,
``x_t = (1 - t) x0 + t eps`` and ``mse = mean (v_theta(x_t) - (eps - x0))^2``. With the
power transform (p > 0) the per-sample "log-likelihood" is

    lp = -(t / p) ((mse + 1e-10)^p - (1e-10)^p)          (p = None: lp = -mse)
    L  = -A lp + kl_beta * mean (v_theta - v_ref)^2 + ema_beta * mean (v_theta - v_ema)^2

with ``A = clip(A_hat, -c, c) / c`` in [-1, 1]. The reference writes the policy term as a PPO
ratio ``exp(lp - sg(lp))`` with an inactive clip; on-policy that ratio is 1 and its gradient
equals the gradient of ``-A lp`` used here. All of an iteration's micro-batches accumulate into
one optimizer step. The "ema" adapter follows ``theta_ema <- d theta_ema + (1 - d) theta``,
``d = min(ema_decay_rate * iteration, ema_decay_max)``.

References:
    Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models", 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.adapter import ModelAdapter
from ..policy.lora import add_frozen_copy, soft_update
from .base import (
    FrozenVelocities,
    Microbatch,
    Objective,
    RolloutBatch,
    check_ranges,
    noised_inputs,
    noised_microbatch,
    split_even,
    velocity_penalty,
)
from .planning import chunk_noise, kept_chunks, weigh_by_kept


def weighted_log_likelihood(mse: Tensor, sigma: Tensor, power: float | None) -> Tensor:
    """``lp = -(t/p)((mse + 1e-10)^p - 1e-10^p)``, or ``-mse`` when power is None. (b,) fp64."""
    mse = mse.double()
    if power is None:
        return -mse
    eps = 1e-10
    return -(sigma.double() / power) * ((mse + eps) ** power - eps**power)


def _stratum_range(num_steps: int, fraction: float, skip_first: bool) -> tuple[int, int]:
    """The first and last step index (inclusive) :func:`stratified_steps` draws from.

    Raises:
        ValueError: no step is left to train on (one rollout step, and index 0 skipped).
    """
    lo = 1 if skip_first else 0
    if lo > num_steps - 1:
        raise ValueError(
            f"AWM trains at rollout steps {lo}..{num_steps - 1}: none with sampler.num_steps={num_steps}; "
            "set sampler.num_steps >= 2 or objective.skip_first=false"
        )
    return lo, max(lo, min(num_steps - 1, int(num_steps * fraction)))


def stratified_steps(
    num_steps: int, count: int, fraction: float, generator: torch.Generator, skip_first: bool = True
) -> list[int]:
    """One step index per stratum of ``[first, int(num_steps * fraction)]`` (AWM "discrete_wo_init").

    Args:
        num_steps: rollout steps T (indices 0..T-1 address sigmas[0..T-1]).
        count: number of strata / training sigmas.
        fraction: the last usable index is ``int(T * fraction)``.
        generator: RNG.
        skip_first: skip index 0 (sigma = 1, pure noise).

    Returns:
        ``count`` sorted step indices (fewer if the range is shorter).
    """
    lo, hi = _stratum_range(num_steps, fraction, skip_first)
    edges = torch.linspace(lo, hi + 1, count + 1)
    steps = []
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        a, b = int(a), max(int(a) + 1, int(b))
        steps.append(int(torch.randint(a, b, (1,), generator=generator)))
    return sorted(set(steps))


@dataclass
class AWM(Objective):
    """Advantage-weighted matching (reference defaults in parentheses).

    Args:
        power: generalised-Huber power p (0.25); None switches the transform off.
        kl_beta: velocity-space KL weight to the base model (1e-3).
        ema_beta: velocity-space penalty weight to the EMA adapter (1.0).
        adv_clip: advantage clip c (5).
        num_timesteps: training sigmas per sample (6).
        timestep_fraction: last usable rollout step fraction (0.9).
        ema_decay_rate, ema_decay_max: ``d = min(rate * iteration, max)`` (0.001, 0.3).
        updates_per_iteration: optimizer steps per iteration (1, as the reference: strictly
            on-policy); more splits the shuffled micro-batches into that many steps.
        skip_first: never train at step index 0 (sigma 1, pure noise): the reference's
            ``time_type='discrete_wo_init'`` (True); False is its ``discrete`` (the PickScore preset).
    """

    power: float | None = 0.25
    kl_beta: float = 1e-3
    ema_beta: float = 1.0
    adv_clip: float = 5.0
    num_timesteps: int = 6
    timestep_fraction: float = 0.9
    ema_decay_rate: float = 0.001
    ema_decay_max: float = 0.3
    updates_per_iteration: int = 1
    skip_first: bool = True
    name: str = "awm"
    rollout = "solver"

    def __post_init__(self) -> None:
        if self.updates_per_iteration < 1:
            raise ValueError(f"objective.updates_per_iteration must be >= 1; got {self.updates_per_iteration}")
        checks = {
            "power": self.power is None or self.power > 0,
            "kl_beta": self.kl_beta >= 0,
            "ema_beta": self.ema_beta >= 0,
            "adv_clip": self.adv_clip > 0,
            "num_timesteps": 1 <= self.num_timesteps <= 1000,
            "timestep_fraction": 0 < self.timestep_fraction <= 1,
            "ema_decay_rate": self.ema_decay_rate >= 0,
            "ema_decay_max": 0 <= self.ema_decay_max <= 1,
        }
        check_ranges(checks, self, "flowrl/objectives/awm.py")
        self.frozen = FrozenVelocities()  # not a field: no config key

    def setup(self, model: ModelAdapter) -> None:
        """Add the frozen "ema" adapter (the trust-region anchor)."""
        add_frozen_copy(model.transformer, "ema")

    def noise_per_row(self, num_steps: int) -> int:
        """At most ``num_timesteps`` training sigmas per sample (fewer when the usable steps are fewer)."""
        lo, hi = _stratum_range(num_steps, self.timestep_fraction, self.skip_first)
        return min(self.num_timesteps, hi - lo + 1)

    def plan(self, batch: RolloutBatch, generator: torch.Generator) -> list[list[Microbatch]]:
        """Every chunk at the same stratified sigmas, fresh noise; one optimizer step in all.

        With ``updates_per_iteration`` > 1, that many steps over the shuffled micro-batches instead.
        """
        steps = stratified_steps(
            len(batch.sigmas) - 1, self.num_timesteps, self.timestep_fraction, generator, self.skip_first
        )
        mbs = []
        for idx in kept_chunks(batch):
            for j in steps:
                mbs.append(Microbatch(idx, j, chunk_noise(batch, idx, generator)))
        if not mbs:
            return []
        if self.updates_per_iteration == 1:
            return weigh_by_kept([mbs], batch.global_keep)
        order = torch.randperm(len(mbs), generator=generator).tolist()
        return weigh_by_kept(split_even([mbs[i] for i in order], self.updates_per_iteration), batch.global_keep)

    def penalties(self) -> tuple[tuple[str, float, str | None], ...]:
        """(stat name, weight, adapter) of the velocity penalties: the base model's and the EMA anchor's."""
        return (("kl", self.kl_beta, None), ("ema_kl", self.ema_beta, "ema"))

    def prepare(self, model: ModelAdapter, batch: RolloutBatch, microbatches: list[Microbatch]) -> None:
        """The penalised states' velocities (base model, EMA anchor) at the step's points, one switch each."""
        self.frozen.clear()
        items = noised_inputs(batch, microbatches)
        for _, weight, adapter in self.penalties():
            if weight > 0:
                self.frozen.fill(model, adapter, items)

    def loss(self, model: ModelAdapter, batch: RolloutBatch, mb: Microbatch) -> tuple[Tensor, dict[str, float]]:
        """Advantage-weighted flow-matching loss on one chunk at one sigma, times the plan's weight ``mb.weight``."""
        idx = mb.index
        x0, sigma, x_t, cond = noised_microbatch(batch, mb)
        v_theta = model.velocity(x_t, sigma, cond)
        dims = tuple(range(1, x0.ndim))
        mse = ((v_theta.double() - (mb.noise - x0).double()) ** 2).mean(dim=dims)
        lp = weighted_log_likelihood(mse, sigma, self.power)
        adv = batch.advantages[idx].double().clamp(-self.adv_clip, self.adv_clip) / self.adv_clip
        keep = batch.keep[idx].double()
        loss = (-adv * lp * keep).sum() / keep.sum().clamp(min=1.0)
        stats = {"policy_loss": float(loss.detach()), "fm_mse": float(mse.detach().mean())}
        for name, weight, adapter in self.penalties():
            if weight > 0:
                v_other = self.frozen.velocity(model, adapter, mb, x_t, sigma, cond)
                penalty = velocity_penalty(
                    model, x_t, sigma, cond, v_theta, adapter, v_other=v_other, keep=batch.keep[idx]
                )
                loss = loss + weight * penalty
                stats[name] = float(penalty.detach())
        return (loss * mb.weight).float(), stats

    def ema_decay(self, iteration: int) -> float:
        """``d = min(ema_decay_rate * iteration, ema_decay_max)``."""
        return min(self.ema_decay_rate * iteration, self.ema_decay_max)

    def after_iteration(self, model: ModelAdapter, iteration: int) -> dict[str, float]:
        """Move the EMA anchor toward the current policy."""
        decay = self.ema_decay(iteration)
        soft_update(model.transformer, "ema", keep=decay)
        return {"ema_decay": decay}
