"""JPEG (in)compressibility rewards (DDPO)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from flowrl.rewards import RewardError, build_reward, jpeg_compressibility, jpeg_incompressibility, score_reward
from flowrl.rewards.jpeg import jpeg_sizes_kb


@pytest.fixture
def flat_and_noisy() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    flat = torch.full((3, 64, 64), 0.5)
    noisy = torch.rand(3, 64, 64, generator=generator)
    return torch.stack([flat, noisy])


def test_noise_is_less_compressible_than_flat(flat_and_noisy) -> None:
    prompts = ["flat", "noisy"]
    comp = jpeg_compressibility()(flat_and_noisy, prompts)
    incomp = jpeg_incompressibility()(flat_and_noisy, prompts)
    assert comp.shape == (2,) and comp.dtype == torch.float32 and incomp.dtype == torch.float32
    assert comp[0] > comp[1] and incomp[1] > incomp[0]
    torch.testing.assert_close(incomp, -comp)
    assert float(incomp[1]) > 5.0  # 64x64 RGB noise at quality 95 is several kB
    assert float(incomp[0]) < 2.0


def test_size_is_the_pil_jpeg_size_in_kilobytes(flat_and_noisy) -> None:
    image = flat_and_noisy[1]
    array = (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=80)
    expected = len(buffer.getvalue()) / 1000
    assert float(jpeg_sizes_kb(image[None], quality=80)[0]) == pytest.approx(expected)


def test_lower_quality_compresses_noise_more(flat_and_noisy) -> None:
    sizes_95 = jpeg_sizes_kb(flat_and_noisy, 95)
    sizes_30 = jpeg_sizes_kb(flat_and_noisy, 30)
    assert sizes_30[1] < sizes_95[1]


def test_digits_size_and_batch_of_one() -> None:
    out = score_reward(
        "jpeg_compressibility",
        build_reward("jpeg_compressibility", quality=50),
        torch.zeros(1, 3, 8, 8),
        ["a handwritten 0"],
        {},
    )
    assert out.shape == (1,) and float(out[0]) < 0


@pytest.mark.parametrize("quality", [0, 101, 95.0, "95", True])
def test_bad_quality(quality) -> None:
    with pytest.raises(ValueError, match="quality") as exc:
        jpeg_compressibility(quality)
    assert "\n" not in str(exc.value)
    with pytest.raises(RewardError, match="'jpeg_incompressibility'"):
        build_reward("jpeg_incompressibility", quality=quality)


def test_bad_images_are_named() -> None:
    with pytest.raises(RewardError, match="'jpeg_compressibility'.*\\[0, 1\\]"):
        score_reward("jpeg_compressibility", jpeg_compressibility(), torch.full((1, 3, 8, 8), 2.0), ["x"], {})
