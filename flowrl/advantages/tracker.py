"""DDPO-style per-prompt reward history: the one stateful advantage normaliser.

For recipes that normalise against past rewards of the same prompt instead of (or when there is
no) in-batch group, e.g. one sample per prompt: ``advantage.method: per_prompt``, run by
:class:`flowrl.advantages.estimator.AdvantageEstimator` through :func:`per_prompt_advantages`. The
pure group-relative functions live in :mod:`flowrl.advantages.group`.

References:
    Black et al., "Training Diffusion Models with Reinforcement Learning" (DDPO), 2023:
    per-prompt stat tracking with a history buffer; until a prompt has ``min_count`` rewards
    the batch mean/std is used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .group import AdvantageStats, _finish, _finite_std, weighted_sum

_STATE_KEYS = ("buffer_size", "min_count", "eps", "history")


class StatTracker:
    """Per-prompt history of the last ``buffer_size`` rewards, for ``A = (r - mean) / (std + eps)``.

    Each call first appends the batch's rewards to their prompts' buffers, then normalises each
    reward by its prompt's buffer (population std) once the buffer holds ``min_count`` rewards,
    else by the mean/std of the whole batch. NaN rewards (not applicable) are not recorded and
    get advantage 0.

    Args:
        buffer_size: rewards kept per prompt (DDPO: 16 or 32).
        min_count: rewards a prompt needs before its own history is used (DDPO: 16).
        eps: added to the std (DDPO: 1e-6).

    Raises:
        ValueError: ``buffer_size < 1``, ``min_count < 1`` or ``min_count > buffer_size``.
    """

    def __init__(self, buffer_size: int = 16, min_count: int = 16, eps: float = 1e-6) -> None:
        if not 1 <= min_count <= buffer_size:
            got = f"min_count={min_count}, buffer_size={buffer_size}"
            raise ValueError(f"StatTracker needs 1 <= min_count <= buffer_size; got {got}")
        self.buffer_size, self.min_count, self.eps = int(buffer_size), int(min_count), float(eps)
        self.history: dict[str, list[float]] = {}

    def update(self, prompts: list[str], rewards: Tensor) -> Tensor:
        """Record this batch and return its advantages.

        Args:
            prompts: B prompt strings.
            rewards: (B,) rewards (NaN = not applicable).

        Returns:
            (B,) float32 advantages (0 for NaN rewards).

        Raises:
            ValueError: ``rewards`` is not (B,) with B = len(prompts), or holds +-inf.
        """
        if rewards.ndim != 1 or len(rewards) != len(prompts):
            raise ValueError(f"rewards must be (B,) with B = len(prompts) = {len(prompts)}; got {tuple(rewards.shape)}")
        if torch.isinf(rewards).any():
            raise ValueError("rewards contain +-inf; return NaN for 'not applicable' and finite values otherwise")
        r = rewards.detach().double().cpu()
        valid = ~torch.isnan(r)
        batch = r[valid]
        batch_mean = batch.mean() if batch.numel() else torch.zeros((), dtype=torch.float64)
        batch_std = batch.std(unbiased=False) if batch.numel() else torch.zeros((), dtype=torch.float64)
        adv = torch.zeros_like(r)
        for prompt in dict.fromkeys(prompts):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt and bool(valid[i])], dtype=torch.long)
            if not idx.numel():
                continue
            buf = (self.history.get(prompt, []) + r[idx].tolist())[-self.buffer_size :]
            self.history[prompt] = buf
            if len(buf) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                hist = torch.tensor(buf, dtype=torch.float64)
                mean, std = hist.mean(), hist.std(unbiased=False)
            adv[idx] = (r[idx] - mean) / (std + self.eps)
        return adv.float().to(rewards.device)

    def clear(self) -> None:
        """Forget all history."""
        self.history.clear()

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: settings and ``{prompt: [rewards]}``."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "eps": self.eps,
            "history": {prompt: list(buf) for prompt, buf in self.history.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (settings included).

        Raises:
            ValueError: a key is missing or the settings are invalid.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"StatTracker state is missing {missing}; pass the dict returned by state_dict()")
        if not 1 <= state["min_count"] <= state["buffer_size"]:
            got = f"{state['min_count']}, {state['buffer_size']}"
            raise ValueError(f"StatTracker state needs 1 <= min_count <= buffer_size; got {got}")
        self.buffer_size, self.min_count = int(state["buffer_size"]), int(state["min_count"])
        self.eps = float(state["eps"])
        self.history = {str(p): [float(x) for x in buf][-self.buffer_size :] for p, buf in state["history"].items()}


def per_prompt_advantages(
    tracker: StatTracker,
    rewards: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor,
    prompts: list[str],
    *,
    clip: float | None = None,
) -> tuple[Tensor, Tensor, AdvantageStats]:
    """DDPO advantages: weighted sum of the rewards, then :meth:`StatTracker.update` (records the batch).

    Nothing is dropped for a lack of signal: a prompt whose history is constant gets advantage 0
    but stays kept, as in DDPO. Only samples with no applicable reward are dropped.

    Args:
        tracker: the run's per-prompt history (updated in place).
        rewards: reward name -> (B,) values (NaN = not applicable, counts 0 in the sum).
        weights: reward name -> weight.
        group_ids: (B,) integer prompt-group index per sample (only counted, for the stats).
        prompts: B prompt texts, the history keys.
        clip: if given, advantages are clipped to [-clip, clip].

    Returns:
        (advantages (B,) float32, keep (B,) bool, AdvantageStats with ``zero_std_groups`` 0 and
        ``std`` the std of the finite weighted rewards of the batch). A sample with no applicable
        reward has advantage 0 and keep False.

    Raises:
        ValueError: missing weights, bad shapes, ``len(prompts) != B``, infinite rewards.
    """
    total = weighted_sum(rewards, weights)  # (B,) float64, NaN where no reward applies
    adv = tracker.update(prompts, total).double()
    nan = torch.isnan(total)
    no_group_dropped = torch.zeros(len(torch.unique(group_ids)), dtype=torch.bool)
    return _finish(adv, ~nan, nan, no_group_dropped, float(_finite_std(total)), clip)
