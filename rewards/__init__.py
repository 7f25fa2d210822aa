"""Rewards: ``reward(images (B, 3, H, W) in [0, 1], prompts, **metadata) -> (B,) float32``.

Rewards are built by factories (``factory(**options) -> RewardFn``), looked up by name with
:func:`build_reward`, combined with :class:`MultiReward`, and listed with :func:`list_rewards`.
Importing this package loads only torch (no diffusers / transformers); PIL and sklearn load lazily.
"""

from __future__ import annotations

from .combine import MultiReward, RewardOutput
from .contract import RewardError, RewardFn, check_images, check_reward_output, score_reward
from .digits import digit_correctness, ink, ink_amount
from .jpeg import jpeg_compressibility, jpeg_incompressibility
from .registry import (
    ENTRY_POINT_GROUP,
    RewardInfo,
    build_multi_reward,
    build_reward,
    known_reward_names,
    list_rewards,
    register_reward,
    resolve_factory,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MultiReward",
    "RewardError",
    "RewardFn",
    "RewardInfo",
    "RewardOutput",
    "build_multi_reward",
    "build_reward",
    "check_images",
    "check_reward_output",
    "digit_correctness",
    "ink",
    "ink_amount",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "known_reward_names",
    "list_rewards",
    "register_reward",
    "resolve_factory",
    "score_reward",
]
