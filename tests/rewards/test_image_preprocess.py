"""CLIP-style preprocessing geometry: centre-crop and pad offsets, the clamp after bicubic, float32 pixel values."""

import pytest
import torch

from flowrl.rewards.image_preprocess import clip_pixels, resize_longest_pad, resize_shortest_center_crop


def _ramp(h: int, w: int) -> torch.Tensor:
    """(1, 3, h, w) distinct values in [0, 1], so any shifted crop or pad differs."""
    return torch.arange(3 * h * w, dtype=torch.float32).reshape(1, 3, h, w) / (3 * h * w)


def test_centre_crop_top_left_is_floored():
    """An odd margin puts the extra pixel after the crop: ``left = (W - w) // 2`` (CLIPImageProcessor), here 1 of 3."""
    images = _ramp(8, 11)  # shorter side already 8: no resize, only the crop
    out = resize_shortest_center_crop(images, 8)
    torch.testing.assert_close(out, images[..., :, 1:9], rtol=0, atol=0)
    tall = _ramp(13, 8)
    torch.testing.assert_close(resize_shortest_center_crop(tall, 8), tall[..., 2:10, :], rtol=0, atol=0)


def test_pad_puts_the_smaller_half_before_and_pads_an_image_already_at_size():
    """A non-square image whose longer side is already ``size`` is still padded to a square, with ``pad // 2``
    zeros on the top/left and the rest (the larger half, for an odd pad) on the bottom/right."""
    wide = _ramp(5, 16)
    out = resize_longest_pad(wide, 16)  # pad 11 rows: 5 above, 6 below
    assert out.shape == (1, 3, 16, 16)
    torch.testing.assert_close(out[..., 5:10, :], wide, rtol=0, atol=0)
    assert out[..., :5, :].abs().max() == 0 and out[..., 10:, :].abs().max() == 0
    tall = _ramp(16, 5)
    out = resize_longest_pad(tall, 16)
    torch.testing.assert_close(out[..., :, 5:10], tall, rtol=0, atol=0)
    assert out[..., :, :5].abs().max() == 0 and out[..., :, 10:].abs().max() == 0


def test_bicubic_overshoot_is_clamped_to_the_unit_range():
    """Bicubic upsampling of a hard edge rings past [0, 1]; the resized pixels are clamped back into it."""
    images = torch.zeros(1, 3, 4, 4)
    images[..., :, 2:] = 1.0
    raw = torch.nn.functional.interpolate(images, size=(16, 16), mode="bicubic", antialias=True, align_corners=False)
    assert raw.min() < 0 and raw.max() > 1  # the case is a real overshoot
    for out in (resize_shortest_center_crop(images, 16), resize_longest_pad(images[..., :3, :], 16)):
        assert out.min() >= 0 and out.max() <= 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_clip_pixels_are_computed_in_float32(dtype: torch.dtype):
    """Whatever the input's float dtype, pixel values are float32 and equal the float32 computation."""
    images = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = clip_pixels(images, 8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, clip_pixels(images.float(), 8), rtol=0, atol=0)


def test_longest_pad_rounds_the_shorter_side():
    """The shorter side is ``round(h * size / long)`` as open_clip's ResizeMaxSize: 7 x 30 -> 3.73 -> 4 rows (not 3)."""
    images = torch.rand(1, 3, 7, 30, generator=torch.Generator().manual_seed(1))
    out = resize_longest_pad(images, 16)  # 4 x 16 resized, 6 rows of zeros above and below
    expected = torch.nn.functional.interpolate(images, size=(4, 16), mode="bicubic", antialias=True).clamp(0, 1)
    torch.testing.assert_close(out[..., 6:10, :], expected)
    assert out[..., :6, :].abs().max() == 0 and out[..., 10:, :].abs().max() == 0
