"""Weighted sum of several rewards, keeping each component for logging."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .contract import RewardFn, check_images, check_reward_output, score_reward
from .deadline import DEFAULT_TIMEOUT_S, check_timeout


class RewardOutput(NamedTuple):
    """Scores of a :class:`MultiReward` call.

    Attributes:
        total: (B,) float32 weighted sum, NaN components counted as 0.
        components: reward name -> (B,) float32 raw (unweighted) scores, NaN kept.
    """

    total: Tensor
    components: dict[str, Tensor]


def check_weight(name: str, weight: object) -> float:
    """A reward weight as float: a finite real number (bools rejected) with ``|weight| <= 1e6``.

    The bound keeps ``weight * score`` far from overflow: a weight of 1e300 turns every total into
    inf, and the trainer would then skip every update.

    Raises:
        ValueError: one line naming the reward and its ``rewards.<name>.weight`` key.
    """
    limit = 1e6
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"weight of reward {name!r} must be a finite number; got {weight!r}")
    if abs(weight) > limit:
        raise ValueError(
            f"weight of reward {name!r} must be a number with |weight| <= {limit:g}; got {weight!r}; "
            f"lower rewards.{name}.weight (weights scale rewards relative to each other)"
        )
    return float(weight)


def _timeout(name: str, fn: object, value: object) -> float | None:
    """A component's deadline: the given value checked, or the default for ``fn``."""
    if value == "default":
        return None if getattr(fn, "bounds_own_time", False) else DEFAULT_TIMEOUT_S
    return None if value is None else check_timeout(name, value)


class MultiReward:
    """Weighted sum ``total = sum_k w_k * r_k`` of named rewards.

    Each component ``r_k`` is scored with :func:`~flowrl.rewards.contract.score_reward`, so a
    failing reward is named in the error, and under its own deadline ``timeout_s``: a call that
    does not return in time raises :class:`~flowrl.rewards.contract.RewardTimeout` (one line naming
    the reward and ``rewards.<name>.timeout_s``). A NaN component (only possible for rewards declaring
    ``allows_nan = True``, meaning "not applicable") contributes 0 to the total for that sample;
    the component itself is returned with its NaN so a trainer can log a nan-mean.
    """

    allows_nan = False

    def __init__(self, rewards: Mapping[str, tuple[RewardFn, float] | tuple[RewardFn, float, float | None]]) -> None:
        """Check and store the named rewards with their weights and deadlines.

        Args:
            rewards: name -> (reward callable, weight) or (reward callable, weight, timeout_s); at least
                one entry. ``timeout_s`` is the deadline of one call in seconds; None means the reward
                bounds its own time (``bounds_own_time = True``, e.g. a remote reward). Without it:
                :data:`~flowrl.rewards.deadline.DEFAULT_TIMEOUT_S`, or None for such a reward.

        Raises:
            ValueError: no reward, an entry that is not such a tuple, a weight that is not a finite number,
                or a timeout that is not a finite number > 0.
            TypeError: a reward that is not callable.
        """
        if not rewards:
            raise ValueError("MultiReward needs at least one reward; pass {name: (reward_fn, weight)}")
        self.rewards: dict[str, tuple[RewardFn, float]] = {}
        self.timeouts: dict[str, float | None] = {}
        for name, entry in rewards.items():
            if not isinstance(entry, tuple) or len(entry) not in (2, 3):
                raise ValueError(f"reward {name!r} must be given as (reward_fn, weight[, timeout_s]); got {entry!r}")
            fn, weight = entry[:2]
            if not callable(fn):
                raise TypeError(
                    f"reward {name!r} is not callable ({type(fn).__name__}); pass a reward built by its factory"
                )
            self.rewards[str(name)] = (fn, check_weight(name, weight))
            self.timeouts[str(name)] = _timeout(str(name), fn, entry[2] if len(entry) == 3 else "default")

    @property
    def weights(self) -> dict[str, float]:
        """Reward name -> weight."""
        return {name: weight for name, (_, weight) in self.rewards.items()}

    def __call__(
        self, images: Tensor, prompts: Sequence[str], *, batch_index: int | str | None = None, **metadata: Any
    ) -> RewardOutput:
        """Score a batch with every reward.

        Args:
            images: (B, 3, H, W) float in [0, 1], or (B, F, 3, H, W) clips for video rewards.
            prompts: B prompts.
            batch_index: optional batch index named in error messages.
            **metadata: per-sample lists passed to every reward.

        Returns:
            :class:`RewardOutput` with ``total`` (B,) float32 and each component (B,) float32.
        """
        return self.combine(
            self.score_parts(images, prompts, metadata, batch_index=batch_index), batch_index=batch_index
        )

    def score_parts(
        self,
        images: Tensor,
        prompts: Sequence[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        batch_index: int | str | None = None,
        on_start: Callable[[str], None] | None = None,
    ) -> dict[str, Tensor]:
        """Raw scores of every component on one part of a batch (e.g. one rollout chunk).

        Each output is checked like :func:`~flowrl.rewards.contract.score_reward` does, except
        that a part may be all NaN; :meth:`combine` checks that on the whole batch. Each call
        runs under the component's deadline (:attr:`timeouts`).

        Args:
            images: (b, 3, H, W) or (b, F, 3, H, W) float in [0, 1].
            prompts: b prompts.
            metadata: per-sample lists of b values.
            batch_index: optional batch index named in error messages.
            on_start: called with each component's name just before it is called (a scoring process
                reports it, so its parent can name the reward that hangs or crashes).

        Returns:
            Reward name -> (b,) float32 raw scores.

        Raises:
            RewardTimeout: a component did not return within its ``timeout_s``.
            RewardError: a component raised or broke the contract.
        """
        check_images(images, video=True)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {images.shape[0]} images; pass one prompt per image")
        scores = {}
        for name, (fn, _) in self.rewards.items():
            if on_start is not None:
                on_start(name)
            scores[name] = score_reward(
                name,
                fn,
                images,
                prompts,
                metadata,
                batch_index=batch_index,
                allow_all_nan=True,
                timeout_s=self.timeouts[name],
            )
        return scores

    def combine(
        self,
        components: Mapping[str, Tensor],
        *,
        batch_index: int | str | None = None,
        allow_all_nan: bool = False,
    ) -> RewardOutput:
        """Weighted total of component scores of a whole batch.

        Args:
            components: reward name -> (B,) float32 raw scores (every configured reward).
            batch_index: optional batch index named in error messages.
            allow_all_nan: accept a component NaN for every sample (a reward that applies to none of
                the batch's prompts, e.g. an evaluation table's "n/a" column).

        Returns:
            :class:`RewardOutput`; NaN components count 0 in the total.

        Raises:
            RewardError: a component is NaN for every sample of the batch (unless ``allow_all_nan``).
        """
        first = components[next(iter(self.rewards))]
        total = torch.zeros(first.shape[0], dtype=torch.float32, device=first.device)
        for name, (_, weight) in self.rewards.items():
            scores = check_reward_output(
                name,
                components[name],
                total.shape[0],
                allow_nan=True,
                batch_index=batch_index,
                allow_all_nan=allow_all_nan,
            )
            total = total + weight * torch.nan_to_num(scores.to(total.device), nan=0.0)
        return RewardOutput(total, {name: components[name] for name in self.rewards})

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}: {weight:g}" for name, weight in self.weights.items())
        return f"MultiReward({inner})"
