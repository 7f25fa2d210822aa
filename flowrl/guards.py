"""Update guards: an update built on bad numbers is skipped, counted and, if it persists, stops the run.

An optimizer step is only kept when everything it depends on is sane:

- the iteration's rewards are finite and ``|reward| <= train.max_abs_reward``;
- the advantages are finite;
- every micro-batch loss and the gradient norm are finite;
- the LoRA weights after the step are finite and ``|w| <= train.max_lora_weight``.

A failed check skips the step: the weights and the optimizer state are restored from before it,
so a checkpoint never holds weights that failed the check. Skips are counted and logged
(``train/skipped_updates``, ``guard/skipped_total``); after ``train.max_skipped_updates``
consecutive skips the run stops with one line naming the first bad quantity of the streak.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor


class UpdateGuardError(ValueError):
    """Too many consecutive updates were skipped by the guards (one line naming the first bad quantity)."""


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def reward_fault(total: Tensor, components: Mapping[str, Tensor], max_abs: float) -> str | None:
    """Describe what is wrong with an iteration's rewards, or None when they are sane.

    Args:
        total: (B,) weighted total reward.
        components: reward name -> (B,) raw scores (NaN = not applicable, ignored).
        max_abs: bound on ``|total|`` (``train.max_abs_reward``).

    Returns:
        One clause naming the reward and the value, e.g.
        ``"reward 'ink' returned 3e+38 (|total| 3e+38 > train.max_abs_reward=1e+06)"``.
    """
    total = total.detach().float().cpu()
    bad = ~torch.isfinite(total) | (total.abs() > max_abs)
    if not bool(bad.any()):
        return None
    worst = float(total[bad][0])
    culprits = [
        f"{name!r} returned {_fmt(float(v[bad].nan_to_num(0).abs().max()))}"
        for name, v in components.items()
        if bool((~torch.isfinite(v[bad]) & ~torch.isnan(v[bad])).any() | (v[bad].nan_to_num(0).abs() > max_abs).any())
    ]
    who = f"reward {', '.join(culprits)}" if culprits else "the weighted reward total"
    return f"{who} (|total| {_fmt(abs(worst))} > train.max_abs_reward={_fmt(max_abs)}, or not finite)"


def tensor_fault(name: str, value: Tensor) -> str | None:
    """``"<name> is not finite (...)"`` when ``value`` holds inf or NaN, else None."""
    finite = torch.isfinite(value.detach())
    if bool(finite.all()):
        return None
    return f"{name} is not finite ({int((~finite).sum())} of {value.numel()} values)"


def weight_fault(params: Sequence[Tensor], max_abs: float) -> str | None:
    """Describe non-finite or exploding LoRA weights after a step, or None when they are sane."""
    with torch.no_grad():
        finite = all(bool(torch.isfinite(p).all()) for p in params)
        if not finite:
            return "the updated LoRA weights are not finite"
        top = max((float(p.abs().max()) for p in params if p.numel()), default=0.0)
    if top > max_abs:
        return f"the updated LoRA weights reach |w| = {_fmt(top)} > train.max_lora_weight={_fmt(max_abs)}"
    return None


class UpdateGuard:
    """Counts skipped updates and stops the run after ``max_skipped`` consecutive ones.

    Args:
        max_skipped: consecutive skips tolerated (``train.max_skipped_updates``).
    """

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = int(max_skipped)
        self.consecutive = 0
        self.total = 0
        self.first_fault: str | None = None

    def ok(self) -> None:
        """A step went through: the streak ends."""
        self.consecutive, self.first_fault = 0, None

    def skip(self, fault: str, iteration: int) -> None:
        """Count a skipped step.

        Raises:
            UpdateGuardError: this skip makes ``max_skipped`` in a row.
        """
        self.total += 1
        self.consecutive += 1
        self.first_fault = self.first_fault or f"{fault} at iteration {iteration}"
        if self.consecutive >= self.max_skipped:
            raise UpdateGuardError(
                f"stopped after {self.consecutive} consecutive skipped updates; the first bad quantity: "
                f"{self.first_fault}; fix the reward or lower optim.lr (the last checkpoint holds the last good "
                "weights), or raise train.max_skipped_updates"
            )

    def state_dict(self) -> dict[str, Any]:
        """Counters, for checkpoints."""
        return {"consecutive": self.consecutive, "total": self.total, "first_fault": self.first_fault}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty mapping: a checkpoint from before the guards)."""
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
        self.first_fault = state.get("first_fault")


class StepSnapshot:
    """The LoRA weights and optimizer state before a step, to undo a step that failed its checks.

    Args:
        params: the trainable parameters.
        optimizer: their optimizer.
    """

    def __init__(self, params: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            self.weights = [p.detach().clone() for p in params]
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())
        self.params, self.optimizer = params, optimizer

    def restore(self) -> None:
        """Put the weights and the optimizer state back as they were."""
        with torch.no_grad():
            for p, saved in zip(self.params, self.weights):
                p.copy_(saved)
        self.optimizer.load_state_dict(self.optimizer_state)
