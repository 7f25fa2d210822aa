"""The reward contract: ``reward(images, prompts, **metadata) -> Tensor (B,) float32``.

A reward is a callable built by a factory (``factory(**options) -> RewardFn``). It receives
images as float tensors (B, 3, H, W) in [0, 1] (video rewards: (B, F, 3, H, W) clips of F
frames), the B prompts, and optional per-sample metadata, and returns one float32 score per
image or clip. A reward may set ``allows_nan = True`` on itself to
declare that NaN means "not applicable to this sample" (e.g. a style reward for a style-less prompt).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from .deadline import CallCancelled, DeadlineExceeded, call_with_deadline

_RANGE_TOL = 1e-3


class RewardError(ValueError):
    """A reward failed or returned something that breaks the reward contract."""


class RewardTimeout(RewardError):
    """A reward call did not return within its deadline (``timeout_s``)."""


def timeout_message(name: str, timeout_s: float, batch_index: int | str | None = None) -> str:
    """The one line for a reward that missed its deadline: names the reward, the deadline and the fix."""
    return (
        f"{_where(name, batch_index)} did not return within its deadline of {timeout_s:g} s; "
        f"fix the reward if it hangs, or raise rewards.{name}.timeout_s if it is just slow"
    )


@runtime_checkable
class RewardFn(Protocol):
    """Callable scoring a batch: ``(images (B, 3, H, W) in [0, 1], prompts (B,), **metadata) -> (B,) float32``."""

    def __call__(self, images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        """Score a batch.

        Args:
            images: (B, 3, H, W) float images in [0, 1] (video rewards: (B, F, 3, H, W) clips).
            prompts: the B prompts.
            **metadata: optional per-sample extras.

        Returns:
            (B,) float32 scores, one per image or clip.
        """
        ...


def reward_allows_nan(fn: object) -> bool:
    """Whether a reward declares NaN as "not applicable" via ``allows_nan = True``."""
    return bool(getattr(fn, "allows_nan", False))


def _where(name: str, batch_index: int | str | None) -> str:
    return f"reward {name!r}" + ("" if batch_index is None else f" (batch {batch_index})")


def check_reward_output(
    name: str,
    output: object,
    batch_size: int,
    *,
    allow_nan: bool = False,
    batch_index: int | str | None = None,
    allow_all_nan: bool = False,
) -> Tensor:
    """Validate a reward's output against the contract and return it unchanged.

    Args:
        name: reward name, used in error messages.
        output: what the reward returned; must be a float32 Tensor of shape (batch_size,).
        batch_size: B, the number of images scored.
        allow_nan: accept NaN entries ("not applicable"); an all-NaN output is still rejected.
        batch_index: optional index of the batch, added to error messages.
        allow_all_nan: accept an all-NaN output too (for one part of a batch whose whole is
            checked later, see :meth:`~flowrl.rewards.combine.MultiReward.combine`).

    Returns:
        ``output`` (B,) float32, never cast or copied.

    Raises:
        RewardError: one line naming the reward and the fix.
    """
    where = _where(name, batch_index)
    if not isinstance(output, Tensor):
        raise RewardError(
            f"{where} returned {type(output).__name__}, expected a torch.Tensor of shape ({batch_size},); "
            "return torch.tensor(scores, dtype=torch.float32)"
        )
    if tuple(output.shape) != (batch_size,):
        raise RewardError(
            f"{where} returned shape {tuple(output.shape)}, expected ({batch_size},) with one score per image; "
            "reduce to one value per sample"
        )
    if output.dtype != torch.float32:
        raise RewardError(
            f"{where} returned dtype {output.dtype}, expected torch.float32; convert inside the reward with .float()"
        )
    if torch.isinf(output).any():
        bad = torch.isinf(output).nonzero().flatten().tolist()
        raise RewardError(f"{where} returned inf at samples {bad}; clamp or fix the reward so scores are finite")
    nan = torch.isnan(output)
    if nan.any():
        bad = nan.nonzero().flatten().tolist()
        if not allow_nan:
            raise RewardError(
                f"{where} returned NaN at samples {bad}; fix the reward, or set allows_nan = True on it "
                "if NaN means 'not applicable'"
            )
        if bool(nan.all()) and not allow_all_nan:
            raise RewardError(
                f"{where} returned NaN for every sample (not applicable to the whole batch); "
                "check the prompts match what the reward expects"
            )
    return output


def check_images(images: object, *, video: bool = False) -> Tensor:
    """Validate a batch of images (or, with ``video=True``, also videos) for rewards and return it.

    Args:
        images: float tensor (B, 3, H, W), or (B, F, 3, H, W) when ``video`` is True, with
            values in [0, 1] (tolerance 1e-3).
        video: also accept (B, F, 3, H, W) clips of F frames.

    Returns:
        ``images`` unchanged.

    Raises:
        TypeError: not a tensor, or not floating point.
        ValueError: wrong rank, not 3 channels, or values outside [0, 1].
    """
    expected = "(B, 3, H, W) or (B, F, 3, H, W)" if video else "(B, 3, H, W)"
    if not isinstance(images, Tensor):
        raise TypeError(
            f"images must be a torch.Tensor {expected}, got {type(images).__name__}; convert with torch.as_tensor"
        )
    if not images.is_floating_point():
        raise TypeError(f"images must be a float tensor in [0, 1], got dtype {images.dtype}; use images.float() / 255")
    if images.ndim not in ((4, 5) if video else (4,)):
        hint = "" if video or images.ndim != 5 else "; for video give the reward a frame reduction (option video: mean)"
        raise ValueError(
            f"images must have shape {expected}, got {tuple(images.shape)}; add the batch/channel dims{hint}"
        )
    if images.shape[-3] != 3:
        raise ValueError(
            f"images must have 3 channels {expected}, got {images.shape[-3]}; "
            "replicate grayscale with images.expand(-1, 3, -1, -1)"
        )
    if images.numel() > 0:
        lo, hi = float(images.detach().min()), float(images.detach().max())
        if not (lo >= -_RANGE_TOL and hi <= 1 + _RANGE_TOL):
            raise ValueError(
                f"images must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; "
                "map [-1, 1] outputs with (x + 1) / 2 and clamp(0, 1)"
            )
    return images


def score_reward(
    name: str,
    fn: RewardFn,
    images: Tensor,
    prompts: Sequence[str],
    metadata: Mapping[str, Any] | None = None,
    *,
    batch_index: int | str | None = None,
    allow_all_nan: bool = False,
    timeout_s: float | None = None,
) -> Tensor:
    """Call a reward, wrapping its failures, and check its output.

    Args:
        name: reward name for error messages.
        fn: the reward callable; ``fn.allows_nan`` enables NaN as "not applicable".
        images: (B, 3, H, W) float in [0, 1].
        prompts: B prompts.
        metadata: per-sample extras passed as keyword arguments.
        batch_index: optional batch index for error messages.
        allow_all_nan: see :func:`check_reward_output`.
        timeout_s: deadline of the call in seconds (:func:`~flowrl.rewards.deadline.call_with_deadline`);
            None calls ``fn`` directly (a reward that bounds its own time, e.g. a remote one).

    Returns:
        Scores (B,) float32.

    Raises:
        RewardTimeout: the call did not return within ``timeout_s``.
        RewardError: the reward raised (chained with ``from``) or broke the contract.
    """
    try:
        if timeout_s is None:
            output = fn(images, prompts, **dict(metadata or {}))
        else:
            output = call_with_deadline(fn, timeout_s, (images, prompts), dict(metadata or {}), name=name)
    except DeadlineExceeded:
        raise RewardTimeout(timeout_message(name, float(timeout_s or 0), batch_index)) from None
    except (RewardError, CallCancelled):
        raise
    except SystemExit as err:  # it would end training as "exited with code N without an error message"
        raise RewardError(
            f"{_where(name, batch_index)} called sys.exit({err.code!r}); a reward returns scores or raises an error"
        ) from None
    except Exception as err:  # noqa: BLE001 - any failure inside a reward is re-raised with its name
        message = str(err).splitlines()[0] if str(err) else ""
        raise RewardError(f"{_where(name, batch_index)} raised {type(err).__name__}: {message}") from err
    return check_reward_output(
        name,
        output,
        int(images.shape[0]),
        allow_nan=reward_allows_nan(fn),
        batch_index=batch_index,
        allow_all_nan=allow_all_nan,
    )
