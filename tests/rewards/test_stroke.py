"""stroke_width: Zhang-Suen skeletons, an intensity-free width, and a style reward that dimming or blobs cannot win."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.rewards import RewardError, build_reward, score_reward
from flowrl.rewards.digit_data import digit_part
from flowrl.rewards.stroke import (
    WIDTH_BOLD,
    WIDTH_THIN,
    band_score,
    draw_strokes,
    skeletonize,
    stroke_width,
    stroke_width_reward,
)


@pytest.fixture(scope="module")
def pens() -> tuple[torch.Tensor, torch.Tensor]:
    """The first 20 test-part digits, each drawn with pen radii 0.75, 1.75 and 2.75: (3, 20, 3, 16, 16)."""
    _, digits, labels = digit_part("test")
    digits = torch.as_tensor(digits[:20])
    drawn = [draw_strokes(digits, torch.full((20,), r))[:, None].expand(-1, 3, -1, -1) for r in (0.75, 1.75, 2.75)]
    return torch.stack(drawn), torch.as_tensor(labels[:20])


def rgb(gray: torch.Tensor) -> torch.Tensor:
    return gray[:, None].expand(-1, 3, -1, -1)


def test_skeleton_of_a_bar_is_one_pixel_wide_and_inside_it() -> None:
    bar = torch.zeros(1, 12, 20, dtype=torch.bool)
    bar[0, 4:9, 2:18] = True
    bone = skeletonize(bar)
    assert bool((bone <= bar).all())
    assert bone[0].sum(dim=0).max() == 1  # one pixel per column
    assert 10 <= int(bone.sum()) <= 16
    assert int(skeletonize(torch.zeros(2, 5, 5)).sum()) == 0
    with pytest.raises(ValueError, match="mask must be"):
        skeletonize(torch.zeros(5, 5))


def test_width_follows_the_pen_and_ignores_brightness(pens) -> None:
    drawn, _ = pens
    thin, mid, bold = (stroke_width(d) for d in drawn)
    assert bool((thin < mid).all()) and bool((mid < bold).all())
    assert 0.8 < float(thin.mean()) < 1.6 and 2.6 < float(bold.mean()) < 3.8
    torch.testing.assert_close(stroke_width(drawn[1] * 0.3), mid)  # dimmed: same width
    torch.testing.assert_close(stroke_width(torch.zeros(2, 3, 16, 16)), torch.zeros(2))


def test_band_score_peaks_at_the_real_ends_and_falls_beyond() -> None:
    widths = torch.tensor([WIDTH_THIN - 0.5, WIDTH_THIN, 2.0, WIDTH_BOLD, WIDTH_BOLD + 0.5])
    bold = band_score(widths, torch.ones(5))
    thin = band_score(widths, -torch.ones(5))
    assert float(bold[3]) == pytest.approx(1.0) and float(thin[1]) == pytest.approx(1.0)
    assert bool((bold[:4].diff() > 0).all()) and float(bold[4]) < float(bold[3])
    assert bool((thin[1:].diff() < 0).all()) and float(thin[0]) < float(thin[1])


def test_dimming_and_blobs_score_worse_not_better(pens) -> None:
    drawn, labels = pens
    reward = stroke_width_reward()
    thin_prompts = [f"a thin handwritten {int(d)}" for d in labels]
    bold_prompts = [f"a bold handwritten {int(d)}" for d in labels]
    thin_real, bold_real = reward(drawn[0], thin_prompts), reward(drawn[2], bold_prompts)
    assert float(thin_real.mean()) > 0.7 and float(bold_real.mean()) > 0.7
    assert bool((reward(drawn[0] * 0.3, thin_prompts) < thin_real).all())  # "thin" by dimming loses
    blob = torch.nn.functional.max_pool2d(drawn[2], 5, stride=1, padding=2)  # "bold" by swelling loses
    assert float(reward(blob, bold_prompts).mean()) < float(bold_real.mean()) - 0.3
    assert float(reward(drawn[2], thin_prompts).mean()) < 0.1 < 0.7 < float(reward(drawn[0], thin_prompts).mean())


def test_style_from_prompt_or_metadata_and_nan_without_one(pens) -> None:
    drawn, _ = pens
    images = drawn[1][:3]
    reward = stroke_width_reward()
    out = reward(images, ["a bold handwritten 1", "a thin handwritten 2", "a handwritten 3"])
    assert out.dtype == torch.float32 and reward.allows_nan and math.isnan(float(out[2]))
    meta = reward(images, ["a 1", "a 2", "a 3"], style=["bold", "thin", None])
    torch.testing.assert_close(meta[:2], out[:2])
    with pytest.raises(ValueError, match="metadata style"):
        reward(images, ["a 1", "a 2", "a 3"], style=["fat", None, None])
    with pytest.raises(ValueError, match="one prompt per image"):
        reward(images, ["a bold 1"])
    with pytest.raises(RewardError, match="every sample"):
        score_reward("stroke_width", reward, images[:2], ["a handwritten 1", "a handwritten 2"], {})


def test_registered_and_draw_strokes_checks_shapes() -> None:
    reward = build_reward("stroke_width")
    assert float(reward(torch.zeros(1, 3, 16, 16), ["a bold 1"])[0]) <= 0.0
    with pytest.raises(ValueError, match="radii"):
        draw_strokes(torch.zeros(2, 8, 8), torch.ones(3))
