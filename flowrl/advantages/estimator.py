"""The trainer's advantage entry point: the ``advantage`` config section as one callable.

``sum``, ``gdpo`` and ``median`` are stateless and call :func:`flowrl.advantages.group.compute_advantages`
unchanged. ``per_prompt`` (DDPO) normalises each sample's weighted reward against the recent
rewards of its prompt text, kept across iterations by a :class:`~flowrl.advantages.tracker.StatTracker`,
so it also works with one sample per prompt or groups too small for a group baseline. Its
history is the estimator's state: :meth:`AdvantageEstimator.state_dict` is plain JSON, so it
can be saved with the trainer's counters and a resumed run continues with the same baselines.

References:
    Black et al., "Training Diffusion Models with Reinforcement Learning" (DDPO), 2023
    (per-prompt stat tracking). Liu et al., "Flow-GRPO", 2025 (advantage clip 5).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from torch import Tensor

from .group import METHODS, STDS, AdvantageStats, Std, compute_advantages
from .tracker import StatTracker, per_prompt_advantages

if TYPE_CHECKING:
    from ..config import AdvantageConfig

EstimatorMethod = Literal["sum", "gdpo", "median", "per_prompt"]
ADVANTAGE_METHODS: tuple[str, ...] = (*METHODS, "per_prompt")


class AdvantageEstimator:
    """Rewards of one rollout batch -> (advantages, keep, stats), by the configured method.

    Args:
        method: "sum" (weighted sum, then GRPO), "gdpo", "median" (MC-GRPO) or "per_prompt"
            (weighted sum, then DDPO's per-prompt history).
        std: "global", "group" or "none"; used by "sum" and "median" only.
        eps: added to the std(s).
        clip: if given, advantages are clipped to [-clip, clip].
        buffer_size: "per_prompt": rewards kept per prompt.
        min_count: "per_prompt": rewards a prompt needs before its own history replaces the
            batch mean/std.

    Raises:
        ValueError: unknown method or std, ``eps < 0``, ``clip <= 0``, or (per_prompt)
            not ``1 <= min_count <= buffer_size``.

    Example:
        >>> estimator = AdvantageEstimator("per_prompt", buffer_size=4, min_count=2)
        >>> rewards, groups = {"ink": torch.tensor([0.2, 0.8, float("nan")])}, torch.tensor([0, 1, 2])
        >>> adv, keep, stats = estimator(rewards, {"ink": 1.0}, groups, ["a 1", "a 2", "a 3"])
        >>> keep.tolist(), stats.not_applicable
        ([True, True, False], 1)
    """

    def __init__(
        self,
        method: EstimatorMethod = "sum",
        *,
        std: Std = "global",
        eps: float = 1e-4,
        clip: float | None = None,
        buffer_size: int = 16,
        min_count: int = 16,
    ) -> None:
        if method not in ADVANTAGE_METHODS:
            raise ValueError(f"advantage.method must be one of {ADVANTAGE_METHODS}; got {method!r}")
        if std not in STDS:
            raise ValueError(f"advantage.std must be one of {STDS}; got {std!r}")
        if not eps >= 0:
            raise ValueError(f"advantage.eps must be >= 0; got {eps}")
        if clip is not None and not clip > 0:
            raise ValueError(f"advantage.clip must be > 0 or None; got {clip}")
        self.method, self.std, self.eps, self.clip = method, std, float(eps), clip
        self.tracker = StatTracker(buffer_size, min_count, eps) if method == "per_prompt" else None

    @classmethod
    def from_config(cls, section: AdvantageConfig) -> AdvantageEstimator:
        """Build from the config's ``advantage`` section (:class:`flowrl.config.AdvantageConfig`).

        The section's keys are this class's arguments, one for one.
        """
        return cls(**dataclasses.asdict(section))

    def __call__(
        self, components: dict[str, Tensor], weights: dict[str, float], group_ids: Tensor, prompts: list[str]
    ) -> tuple[Tensor, Tensor, AdvantageStats]:
        """Combine the rewards and normalise them.

        Args:
            components: reward name -> (B,) values (NaN = not applicable).
            weights: reward name -> weight (same names).
            group_ids: (B,) integer prompt-group index per sample.
            prompts: B prompt texts (the per-prompt history key; unused by the group methods).

        Returns:
            (advantages (B,) float32, keep (B,) bool, AdvantageStats). For the group methods
            exactly :func:`~flowrl.advantages.group.compute_advantages`; for "per_prompt" a sample
            is dropped (advantage 0, keep False) only when no reward applies to it.

        Raises:
            ValueError: ``len(prompts) != B``, missing weights, bad shapes, infinite rewards.
        """
        if len(prompts) != len(group_ids):
            raise ValueError(f"need one prompt per sample; got {len(prompts)} prompts for {len(group_ids)} group ids")
        if self.tracker is not None:
            return per_prompt_advantages(self.tracker, components, weights, group_ids, prompts, clip=self.clip)
        return compute_advantages(
            components, weights, group_ids, method=self.method, std=self.std, eps=self.eps, clip=self.clip
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``{}`` for the stateless methods, else the per-prompt history.

        Returns:
            ``{}``, or ``{"method": "per_prompt", "history": {prompt: [rewards, oldest first]}}``.
            The settings (buffer size, min count, eps) stay in the config.
        """
        if self.tracker is None:
            return {}
        return {"method": self.method, "history": self.tracker.state_dict()["history"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; ``{}`` is a fresh start (it clears a per-prompt history).

        A saved history longer than this estimator's ``buffer_size`` keeps its newest rewards.

        Raises:
            ValueError: a per-prompt history given to a stateless method, or a malformed state.
        """
        if not state:
            if self.tracker is not None:
                self.tracker.clear()
            return
        if state.get("method") != "per_prompt" or not isinstance(state.get("history"), dict):
            expected = "{} or {'method': 'per_prompt', 'history': {prompt: [rewards]}}"
            raise ValueError(f"advantage state must be {expected}; got keys {sorted(state)}")
        if self.tracker is None:
            raise ValueError(
                f"the advantage state holds a per-prompt reward history but advantage.method is {self.method!r}; "
                "resume with advantage.method: per_prompt or start a new run"
            )
        self.tracker.load_state_dict({**self.tracker.state_dict(), "history": state["history"]})
