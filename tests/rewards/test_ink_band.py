"""ink_band: the style scored on the real digits' ink band; blobs and faded digits score below real ones."""

import math

import pytest
import torch

from flowrl.rewards.ink_band import INK_BOLD, INK_THIN, OVERSHOOT_SLOPE, band_score
from flowrl.rewards.registry import build_reward as get_reward


def _uniform(value: float, n: int = 1) -> torch.Tensor:
    return torch.full((n, 3, 8, 8), value)


def test_band_ends_are_the_real_data_percentiles():
    from flowrl.models.digits.model import load_digit_images

    images, _, styles = load_digit_images()
    ink = images.mean(dim=(1, 2, 3))
    thin = ink[torch.tensor([s == "thin" for s in styles])]
    bold = ink[torch.tensor([s == "bold" for s in styles])]
    assert INK_THIN == pytest.approx(float(torch.quantile(thin, 0.01)), abs=1e-4)
    assert INK_BOLD == pytest.approx(float(torch.quantile(bold, 0.99)), abs=1e-4)


def test_band_score_rises_to_the_style_end_then_falls():
    ink = torch.tensor([INK_THIN, (INK_THIN + INK_BOLD) / 2, INK_BOLD, INK_BOLD + 0.05, 0.9], dtype=torch.float64)
    bold = band_score(ink, torch.ones(5, dtype=torch.bool)).double()
    width = INK_BOLD - INK_THIN
    expected = [0.0, 0.5, 1.0, 1.0 - OVERSHOOT_SLOPE * 0.05 / width, -1.0]
    assert bold.tolist() == pytest.approx(expected, abs=1e-6)
    thin = band_score(ink, torch.zeros(5, dtype=torch.bool)).double()
    assert thin[:3].tolist() == pytest.approx([1.0, 0.5, 0.0], abs=1e-6)
    faded = band_score(torch.tensor([INK_THIN - 0.05]), torch.zeros(1, dtype=torch.bool))
    assert float(faded) == pytest.approx(1.0 - OVERSHOOT_SLOPE * 0.05 / width, abs=1e-6)


def test_real_digit_beats_its_blob_and_its_faded_copy():
    from flowrl.models.digits.model import load_digit_images

    images, _, styles = load_digit_images()
    reward = get_reward("ink_band")
    bold = next(i for i, s in enumerate(styles) if s == "bold")
    thin = next(i for i, s in enumerate(styles) if s == "thin")
    real_bold = images[bold : bold + 1]
    blob = torch.nn.functional.max_pool2d(real_bold, 3, stride=1, padding=1)  # strokes swollen
    assert reward(blob, ["a bold handwritten 3"]) < reward(real_bold, ["a bold handwritten 3"])
    real_thin = images[thin : thin + 1]
    faded = real_thin * 0.5
    assert reward(faded, ["a thin handwritten 3"]) < reward(real_thin, ["a thin handwritten 3"])


def test_style_from_prompt_or_metadata_and_nan_without_one():
    reward = get_reward("ink_band")
    images = _uniform((INK_THIN + INK_BOLD) / 2, 3)
    out = reward(images, ["a bold handwritten 1", "a handwritten 1", "a handwritten 1"], style=[None, None, "thin"])
    assert out[0].item() == pytest.approx(0.5, abs=1e-5) and math.isnan(out[1].item())
    assert out[2].item() == pytest.approx(0.5, abs=1e-5)


def test_bad_band_is_one_line():
    with pytest.raises(ValueError, match="ink band needs 0 <= low < high <= 1"):
        get_reward("ink_band", low=0.5, high=0.4)


@pytest.mark.parametrize(("low", "high"), [(0.3, 0.3), (-0.1, 0.5), (0.2, 1.1)])
def test_band_must_be_a_proper_sub_interval_of_unit(low: float, high: float):
    """An empty band (low == high: u would divide by zero) and one reaching outside [0, 1] are refused."""
    with pytest.raises(ValueError, match="ink band needs 0 <= low < high <= 1"):
        band_score(torch.tensor([0.3]), torch.ones(1, dtype=torch.bool), low, high)


def test_overshoot_falls_four_times_as_fast_as_the_band_rises():
    """Past its own end the score falls at 4x the in-band rate (the shipped OVERSHOOT_SLOPE, stated as a number):
    10% of the band past the bold end scores 0.6, 10% below the thin end (thin prompt) too."""
    assert OVERSHOOT_SLOPE == 4.0
    width = 0.5
    ink = torch.tensor([0.75 + 0.1 * width, 0.25 - 0.1 * width], dtype=torch.float64)
    out = band_score(ink, torch.tensor([True, False]), 0.25, 0.75).double()
    assert out.tolist() == pytest.approx([0.6, 0.6], abs=1e-6)
