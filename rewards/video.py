"""Video rewards: per-frame image rewards reduced over frames, and temporal consistency.

Clips are float tensors (B, F, 3, H, W) in [0, 1]. Any image reward scores video through
:class:`FrameReward`: the F frames of each clip are scored as one image batch of B * F and the
(B, F) scores are reduced per clip with the mean or the min (the worst frame). In a config,
``video: mean`` (or ``min``) on any reward entry does this::

    rewards:
      ink: {target: bold, video: min}            # the clip's darkest-stroke frame
      temporal_consistency: {weight: 0.2, size: 16}

:func:`temporal_consistency` scores how little consecutive frames change (pixel space, after an
area downsample that ignores fine texture): 1 for a still clip, lower for flicker and jumps.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import RewardFn, check_images, reward_allows_nan

FRAME_REDUCTIONS = ("mean", "min")


def check_reduction(reduce: object, what: str) -> str:
    """``reduce`` if it is one of :data:`FRAME_REDUCTIONS`; ValueError naming ``what`` (the option) otherwise."""
    if reduce not in FRAME_REDUCTIONS:
        raise ValueError(f"{what} must be one of {FRAME_REDUCTIONS}; got {reduce!r}")
    return str(reduce)


def reduce_frames(scores: Tensor, reduce: str) -> Tensor:
    """Reduce per-frame scores to one score per clip, ignoring NaN frames.

    Args:
        scores: (B, F) per-frame scores; NaN = frame not applicable.
        reduce: "mean" (``nanmean`` over frames) or "min" (smallest non-NaN frame).

    Returns:
        (B,) in the dtype of ``scores``; NaN where every frame of the clip is NaN.
    """
    check_reduction(reduce, "frame reduction")
    if reduce == "mean":
        return scores.nanmean(dim=1)
    nan = torch.isnan(scores)
    lowest = scores.masked_fill(nan, float("inf")).amin(dim=1)
    return torch.where(nan.all(dim=1), torch.full_like(lowest, float("nan")), lowest)


def _per_frame(value: Any, frames: int, batch_size: int) -> Any:
    """Repeat one metadata entry per frame: B values -> B * F values (others pass unchanged)."""
    if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == batch_size:
        return value.repeat_interleave(frames, dim=0)
    if isinstance(value, (list, tuple)) and len(value) == batch_size:
        return [v for v in value for _ in range(frames)]
    return value


class FrameReward:
    """An image reward applied to every frame of (B, F, 3, H, W) clips, reduced over frames.

    ``r(clip) = reduce_t r_image(clip[t])`` with ``reduce`` the mean or the min over the F frames
    (NaN frames ignored). Prompts and per-sample metadata are repeated for each frame. An image
    batch (B, 3, H, W) is scored as clips of one frame, i.e. exactly like the image reward.

    Args:
        reward: the image reward ``(B, 3, H, W) -> (B,)``.
        reduce: "mean" or "min".
        name: the image reward's name, for error messages.
    """

    def __init__(self, reward: RewardFn, reduce: str = "mean", name: str = "reward") -> None:
        if not callable(reward):
            raise TypeError(f"FrameReward needs a callable image reward; got {type(reward).__name__}")
        self.reward = reward
        self.reduce = check_reduction(reduce, f"reward {name!r}: option video")
        self.name = name

    @property
    def allows_nan(self) -> bool:
        """The image reward's own declaration, read at call time (a remote reward learns it from the server)."""
        return reward_allows_nan(self.reward)

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) for clips (B, F, 3, H, W) or images (B, 3, H, W) in [0, 1]."""
        check_images(images, video=True)
        clips = images if images.ndim == 5 else images.unsqueeze(1)
        batch, frames = clips.shape[:2]
        if len(prompts) != batch:
            raise ValueError(f"got {len(prompts)} prompts for {batch} clips; pass one prompt per clip")
        flat = clips.reshape(batch * frames, *clips.shape[2:])
        out = self.reward(
            flat,
            [p for p in prompts for _ in range(frames)],
            **{k: _per_frame(v, frames, batch) for k, v in metadata.items()},
        )
        if not isinstance(out, Tensor) or tuple(out.shape) != (batch * frames,):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"image reward {self.name!r} returned {got} for {batch} clips x {frames} frames; "
                f"expected ({batch * frames},), one score per frame"
            )
        return reduce_frames(out.reshape(batch, frames), self.reduce)

    def __repr__(self) -> str:
        return f"FrameReward({self.name!r}, reduce={self.reduce!r})"


def frame_reward(reward: RewardFn, reduce: str = "mean", name: str = "reward") -> FrameReward:
    """Score video with an image reward: the mean or min of its per-frame scores.

    Args:
        reward: a built image reward.
        reduce: "mean" or "min" over frames.
        name: the image reward's name, for error messages.

    Returns:
        A reward ``(clips (B, F, 3, H, W) or images (B, 3, H, W), prompts) -> (B,)``.
    """
    return FrameReward(reward, reduce, name)


def frame_differences(clips: Tensor, size: int | None = None) -> Tensor:
    """Mean absolute change between consecutive frames.

    ``d_t = mean_{c, h, w} |D(x_{t+1}) - D(x_t)|`` for t = 0 .. F - 2, where D area-averages each
    frame to ``size`` x ``size`` (identity when ``size`` is None or not smaller than the frame).

    Args:
        clips: (B, F, 3, H, W) float in [0, 1], F >= 2.
        size: side of the area downsample before comparing, or None.

    Returns:
        (B, F - 1) float32 in [0, 1].
    """
    frames = clips.detach().float()
    batch, count = frames.shape[:2]
    flat = frames.reshape(batch * count, *frames.shape[2:])
    if size is not None and (flat.shape[-2] > size or flat.shape[-1] > size):
        flat = F.adaptive_avg_pool2d(flat, (min(size, flat.shape[-2]), min(size, flat.shape[-1])))
    frames = flat.reshape(batch, count, *flat.shape[1:])
    return (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(2, 3, 4))


class TemporalConsistency:
    """Temporal consistency ``r = 1 - reduce_t d_t`` of :func:`frame_differences` (in [0, 1]).

    1 means consecutive frames are identical (after the downsample), 0 means every pixel jumps
    from black to white. "mean" rates the whole clip, "min" (``1 - max_t d_t``) its worst cut.
    A still clip scores 1, so pair this reward with one that wants content or motion.
    """

    allows_nan = False

    def __init__(self, size: int | None = 16, reduce: str = "mean") -> None:
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"temporal_consistency size must be a positive integer or null; got {size!r}")
        self.size = size
        self.reduce = check_reduction(reduce, "temporal_consistency reduce")

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Scores (B,) float32 for clips (B, F, 3, H, W) in [0, 1] with F >= 2."""
        check_images(images, video=True)
        if images.ndim != 5 or images.shape[1] < 2:
            raise ValueError(
                f"temporal_consistency needs clips (B, F, 3, H, W) with F >= 2 frames; got shape {tuple(images.shape)}"
            )
        diffs = frame_differences(images, self.size)
        worst = diffs.mean(dim=1) if self.reduce == "mean" else diffs.amax(dim=1)
        return (1.0 - worst).float()


def temporal_consistency(size: int | None = 16, reduce: str = "mean") -> TemporalConsistency:
    """Temporal consistency of clips: 1 minus the mean absolute change between consecutive frames.

    Args:
        size: frames are area-averaged to size x size before comparing (None: full resolution),
            so small shifts of fine texture cost less than flicker of whole regions.
        reduce: "mean" over the F - 1 transitions, or "min" to score the worst transition.

    Returns:
        A reward ``(clips (B, F, 3, H, W), prompts) -> (B,) float32`` in [0, 1].
    """
    return TemporalConsistency(size, reduce)


temporal_consistency.offline = True  # type: ignore[attr-defined]
