"""Rewards: ``reward(images (B, 3, H, W) in [0, 1], prompts, **metadata) -> (B,) float32``.

Video rewards take clips (B, F, 3, H, W) (:mod:`.video`); ``remote:http://host:port`` names a
reward served by ``flowrl serve-reward`` (:mod:`.remote`, :mod:`.server`, wire format :mod:`.wire`).
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
    check_reward_options,
    known_reward_names,
    list_rewards,
    register_reward,
    required_options,
    resolve_factory,
)
from .remote import RemoteReward, RemoteRewardError, remote
from .video import FrameReward, frame_reward, reduce_frames, temporal_consistency

__all__ = [
    "ENTRY_POINT_GROUP",
    "FrameReward",
    "MultiReward",
    "RewardError",
    "RewardFn",
    "RewardInfo",
    "RewardOutput",
    "RemoteReward",
    "RemoteRewardError",
    "build_multi_reward",
    "build_reward",
    "check_images",
    "check_reward_options",
    "check_reward_output",
    "digit_correctness",
    "frame_reward",
    "ink",
    "ink_amount",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "known_reward_names",
    "list_rewards",
    "reduce_frames",
    "remote",
    "register_reward",
    "required_options",
    "resolve_factory",
    "score_reward",
    "temporal_consistency",
]
