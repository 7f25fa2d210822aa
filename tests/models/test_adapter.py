"""The adapter contract's shared helpers (flowrl.models.adapter): resolution parsing, cond repetition, frame checks."""

import pytest
import torch

from flowrl.models.adapter import output_resolution, repeat_cond, select_cond
from flowrl.models.sd3 import SD3Adapter


@pytest.mark.parametrize("resolution", [0, -8, True, [0, 16], [16, -16], [16.0, 16], [16]])
def test_output_resolution_rejects_non_positive_or_malformed_sizes(tiny_sd3: SD3Adapter, resolution: object) -> None:
    """``model.resolution`` must be a positive int or two positive ints; zero, bools and floats are refused."""
    with pytest.raises(ValueError, match="model.resolution must be a positive int"):
        output_resolution(resolution, tiny_sd3)


def test_repeat_cond_repeats_each_row_consecutively() -> None:
    """(B, ...) -> (B * r, ...) with row i at rows [i * r, (i + 1) * r): group members share their prompt."""
    cond = {"a": torch.arange(3).view(3, 1), "uncond.a": torch.arange(6).view(3, 2)}
    repeated = repeat_cond(cond, 2)
    assert repeated["a"].flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert repeated["uncond.a"].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    assert select_cond(repeated, slice(2, 4))["a"].flatten().tolist() == [1, 1]


def test_image_adapter_latent_shape_rejects_any_frame_count(tiny_sd3: SD3Adapter) -> None:
    """An image adapter refuses every explicit frame count, 0 included; only None is accepted."""
    assert tiny_sd3.latent_shape(8, 8, None) == tiny_sd3.latent_shape(8, 8)
    for frames in (0, 1, 5):
        with pytest.raises(ValueError, match="image model"):
            tiny_sd3.latent_shape(8, 8, frames)
