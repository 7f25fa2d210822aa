"""The reward contract: output checks, image checks and score_reward wrapping."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.rewards import RewardError, RewardFn, check_images, check_reward_output, score_reward


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize(
    ("output", "needle"),
    [
        ([0.1, 0.2], "list"),
        (0.5, "float"),
        (torch.zeros(2, 1), "(2, 1)"),
        (torch.zeros(3), "(3,)"),
        (torch.zeros(()), "()"),
        (torch.zeros(2, dtype=torch.float64), "torch.float64"),
        (torch.zeros(2, dtype=torch.float16), "torch.float16"),
        (torch.zeros(2, dtype=torch.int64), "torch.int64"),
        (torch.tensor([0.0, math.inf]), "inf"),
        (torch.tensor([-math.inf, 0.0]), "inf"),
        (torch.tensor([0.0, math.nan]), "NaN"),
    ],
)
def test_bad_outputs_raise_one_line_naming_the_reward(output: object, needle: str) -> None:
    with pytest.raises(RewardError) as exc:
        check_reward_output("my_reward", output, 2)
    message = one_line(exc)
    assert "'my_reward'" in message and needle in message


def test_batch_index_is_named() -> None:
    with pytest.raises(RewardError) as exc:
        check_reward_output("aesthetic", torch.zeros(4), 2, batch_index=7)
    assert "'aesthetic'" in one_line(exc) and "batch 7" in str(exc.value)


def test_wrong_dtype_is_not_silently_cast() -> None:
    with pytest.raises(RewardError, match="float32"):
        check_reward_output("r", torch.ones(2, dtype=torch.float64), 2)


def test_nan_allowed_only_when_declared_and_never_all_nan() -> None:
    partial = torch.tensor([0.5, math.nan, 1.0])
    assert check_reward_output("style", partial, 3, allow_nan=True) is partial
    with pytest.raises(RewardError, match="allows_nan") as exc:
        check_reward_output("style", partial, 3)
    assert "[1]" in one_line(exc)
    with pytest.raises(RewardError, match="every sample") as exc:
        check_reward_output("style", torch.full((3,), math.nan), 3, allow_nan=True)
    assert "'style'" in one_line(exc)


def test_valid_output_returned_unchanged_including_batch_of_one() -> None:
    out = torch.tensor([0.25])
    assert check_reward_output("r", out, 1) is out
    with pytest.raises(RewardError, match="every sample"):
        check_reward_output("r", torch.tensor([math.nan]), 1, allow_nan=True)
    with pytest.raises(RewardError, match=r"expected \(1,\)"):
        check_reward_output("r", torch.tensor([0.1, 0.2]), 1)


@pytest.mark.parametrize(
    ("images", "error", "needle"),
    [
        ([[0.0]], TypeError, "torch.Tensor"),
        (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), TypeError, "torch.uint8"),
        (torch.zeros(3, 8, 8), ValueError, "(3, 8, 8)"),
        (torch.zeros(2, 1, 8, 8), ValueError, "got 1"),
        (torch.zeros(2, 4, 8, 8), ValueError, "got 4"),
        (torch.full((2, 3, 8, 8), 1.5), ValueError, "[0, 1]"),
        (torch.full((2, 3, 8, 8), -1.0), ValueError, "[0, 1]"),
    ],
)
def test_check_images_errors(images: object, error: type[Exception], needle: str) -> None:
    with pytest.raises(error) as exc:
        check_images(images)
    assert needle in one_line(exc)


def test_check_images_accepts_any_size_and_tiny_overshoot() -> None:
    images = torch.rand(1, 3, 5, 13)
    images[0, 0, 0, 0] = 1.0005
    images[0, 0, 0, 1] = -0.0005
    assert check_images(images) is images


def test_score_reward_wraps_exceptions_with_the_reward_name() -> None:
    def broken(images, prompts, **metadata):
        return 1 / 0

    images = torch.rand(2, 3, 8, 8)
    with pytest.raises(RewardError) as exc:
        score_reward("broken_reward", broken, images, ["a", "b"], {})
    message = one_line(exc)
    assert "'broken_reward'" in message and "ZeroDivisionError" in message and "division by zero" in message
    assert isinstance(exc.value.__cause__, ZeroDivisionError)


def test_score_reward_checks_output_and_honours_allows_nan() -> None:
    images = torch.rand(2, 3, 8, 8)

    def nan_reward(images, prompts, **metadata):
        return torch.tensor([math.nan, 1.0])

    with pytest.raises(RewardError, match="'nan_reward'"):
        score_reward("nan_reward", nan_reward, images, ["a", "b"], {})
    nan_reward.allows_nan = True
    out = score_reward("nan_reward", nan_reward, images, ["a", "b"], {})
    assert torch.isnan(out[0]) and out[1] == 1.0

    def float64_reward(images, prompts, **metadata):
        return torch.zeros(2, dtype=torch.float64)

    with pytest.raises(RewardError, match="batch 3"):
        score_reward("f64", float64_reward, images, ["a", "b"], None, batch_index=3)


def test_score_reward_passes_metadata_and_supports_batch_of_one() -> None:
    def by_digit(images, prompts, digit=None):
        return torch.tensor(digit, dtype=torch.float32)

    assert isinstance(by_digit, RewardFn)
    out = score_reward("by_digit", by_digit, torch.rand(1, 3, 8, 8), ["a 4"], {"digit": [4]})
    assert out.dtype == torch.float32 and out.tolist() == [4.0]


def test_check_images_takes_clips_only_with_video() -> None:
    """A (B, F, 3, H, W) clip is refused by default (with the frame-reduction hint) and accepted with
    ``video=True``; a 6-D tensor is refused either way (pins the rank check's ``video`` branch)."""
    clip = torch.rand(2, 4, 3, 8, 8)
    with pytest.raises(ValueError) as exc:
        check_images(clip)
    assert "(2, 4, 3, 8, 8)" in one_line(exc) and "video: mean" in str(exc.value)
    assert check_images(clip, video=True) is clip
    with pytest.raises(ValueError, match=r"\(B, F, 3, H, W\)"):
        check_images(torch.rand(1, 2, 4, 3, 8, 8), video=True)


@pytest.mark.parametrize("value", [1.002, -0.002, 1.05, -0.05])
def test_check_images_range_tolerance_is_one_thousandth(value: float) -> None:
    """Values more than 1e-3 outside [0, 1] are refused (the docstring's tolerance, not a looser one)."""
    images = torch.rand(1, 3, 4, 4)
    images[0, 1, 2, 3] = value
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_images(images)


def test_score_reward_passes_allow_all_nan_to_the_output_check() -> None:
    """score_reward refuses an all-NaN output of an allows_nan reward unless ``allow_all_nan=True`` is given,
    then returns it unchanged (MultiReward scores a batch in parts this way)."""

    def not_applicable(images, prompts, **metadata):
        return torch.full((2,), math.nan)

    not_applicable.allows_nan = True
    images = torch.rand(2, 3, 8, 8)
    with pytest.raises(RewardError, match="every sample"):
        score_reward("na", not_applicable, images, ["a", "b"])
    out = score_reward("na", not_applicable, images, ["a", "b"], allow_all_nan=True)
    assert out.shape == (2,) and bool(torch.isnan(out).all())


def test_inf_names_every_bad_sample() -> None:
    """The inf error lists the indices of all +inf and -inf samples."""
    with pytest.raises(RewardError, match=r"inf at samples \[1, 3\]"):
        check_reward_output("r", torch.tensor([0.0, math.inf, 0.5, -math.inf]), 4)


def test_a_reward_error_raised_inside_a_reward_is_not_rewrapped() -> None:
    """A RewardError a reward raises itself (e.g. a remote reward's one line) reaches the caller as it is."""
    from flowrl.rewards import RewardError as Error

    def remote_like(images, prompts, **metadata):
        raise Error("reward 'remote' got HTTP 503 from the server; check it is up")

    with pytest.raises(RewardError) as exc:
        score_reward("remote", remote_like, torch.rand(1, 3, 4, 4), ["a"])
    assert str(exc.value) == "reward 'remote' got HTTP 503 from the server; check it is up"


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_a_reward_that_calls_sys_exit_is_named(timeout_s) -> None:
    """sys.exit(3) in a plugin ended training as "exited with code 3 without an error message", naming nothing."""
    import sys

    def quitter(images, prompts, **metadata):
        sys.exit(3)

    with pytest.raises(RewardError) as exc:
        score_reward("quitter", quitter, torch.rand(1, 3, 4, 4), ["a"], batch_index=2, timeout_s=timeout_s)
    assert one_line(exc) == "reward 'quitter' (batch 2) called sys.exit(3); a reward returns scores or raises an error"
