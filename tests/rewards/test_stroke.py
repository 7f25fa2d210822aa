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


def _zhang_suen_reference(mask: list[list[int]]) -> list[list[int]]:
    """Zhang & Suen (1984) thinning, pixel by pixel: P2..P9 clockwise from north; each sub-pass removes at once."""
    x = [row[:] for row in mask]
    h, w = len(x), len(x[0])

    def at(i: int, j: int) -> int:
        return x[i][j] if 0 <= i < h and 0 <= j < w else 0

    while True:
        changed = False
        for first in (True, False):
            remove = []
            for i in range(h):
                for j in range(w):
                    if not x[i][j]:
                        continue
                    p = [at(i - 1, j), at(i - 1, j + 1), at(i, j + 1), at(i + 1, j + 1)]
                    p += [at(i + 1, j), at(i + 1, j - 1), at(i, j - 1), at(i - 1, j - 1)]
                    b = sum(p)
                    a = sum(p[k] == 0 and p[(k + 1) % 8] == 1 for k in range(8))
                    p2, p4, p6, p8 = p[0], p[2], p[4], p[6]
                    c1, c2 = (p2 * p4 * p6, p4 * p6 * p8) if first else (p2 * p4 * p8, p2 * p6 * p8)
                    if 2 <= b <= 6 and a == 1 and c1 == 0 and c2 == 0:
                        remove.append((i, j))
            for i, j in remove:
                x[i][j] = 0
            changed = changed or bool(remove)
        if not changed:
            return x


def test_skeleton_matches_a_pixel_by_pixel_zhang_suen() -> None:
    """skeletonize equals a plain loop implementation of Zhang-Suen on blobs, a solid block and an L
    (pins the 2 <= B <= 6 neighbour count and which of P2/P4/P6/P8 each sub-pass tests)."""
    gen = torch.Generator().manual_seed(3)
    noise = torch.rand(4, 1, 5, 6, generator=gen)
    blobs = torch.nn.functional.interpolate(noise, size=(15, 18), mode="bilinear")[:, 0] > 0.5
    block = torch.zeros(1, 15, 18, dtype=torch.bool)
    block[0, 3:12, 4:14] = True
    ell = torch.zeros(1, 15, 18, dtype=torch.bool)
    ell[0, 2:13, 3:7] = True
    ell[0, 9:13, 3:16] = True
    masks = torch.cat([blobs, block, ell])
    bones = skeletonize(masks)
    for mask, bone in zip(masks, bones):
        expected = _zhang_suen_reference(mask.to(torch.int64).tolist())
        assert bone.to(torch.int64).tolist() == expected


def test_width_threshold_includes_pixels_at_exactly_half_the_peak() -> None:
    """Pixels at exactly THRESHOLD x peak are ink (``>=``): the width is the same as with them a hair brighter."""
    images = torch.zeros(1, 3, 16, 16)
    images[..., 3:13, 4:6] = 1.0  # the peak
    at_half = images.clone()
    at_half[..., 3:13, 6:9] = 0.5
    above = images.clone()
    above[..., 3:13, 6:9] = 0.501
    torch.testing.assert_close(stroke_width(at_half), stroke_width(above))


def test_ink_fainter_than_a_thousandth_has_width_zero() -> None:
    """An image whose peak is below 1e-3 has width 0, not the width of its faint stroke."""
    images = torch.zeros(1, 3, 16, 16)
    images[..., 3:13, 6:9] = 9e-4
    assert stroke_width(images).tolist() == [0.0]
    assert float(stroke_width(images * 1000)[0]) > 1.0  # the same stroke, visible, has a width


def test_band_score_is_clamped_at_minus_one() -> None:
    """A width far beyond either end scores -1, not below (1 - 2 x overshoot clamped)."""
    widths = torch.tensor([WIDTH_BOLD + 10.0, WIDTH_BOLD + 0.25 * (WIDTH_BOLD - WIDTH_THIN)])
    assert band_score(widths, torch.ones(2)).tolist() == pytest.approx([-1.0, 0.5])


def test_full_contrast_images_score_their_band_score_unscaled(pens) -> None:
    """A peak above FULL_CONTRAST gives factor 1 (clamped), so a bright image scores exactly its band score (<= 1)."""
    drawn, labels = pens
    images = drawn[2][:6]
    out = stroke_width_reward()(images, [f"a bold handwritten {int(d)}" for d in labels[:6]])
    torch.testing.assert_close(out, band_score(stroke_width(images), torch.ones(6)))
    assert bool((out <= 1.0).all())


def test_peak_is_taken_on_the_channel_mean() -> None:
    """A stroke in one colour channel has the width of its gray (channel-mean) image: peak and mask use the mean."""
    red = torch.zeros(1, 3, 16, 16)
    red[:, 0, 3:13, 6:9] = 0.9
    gray = red.mean(dim=1, keepdim=True).expand(-1, 3, -1, -1)
    width = stroke_width(red)
    assert float(width[0]) > 1.0
    torch.testing.assert_close(width, stroke_width(gray))
