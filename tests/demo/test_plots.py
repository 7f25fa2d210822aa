"""The demo's and gallery's pictures: metrics rows, curve panels and their data, upscaling, PIL/GIF/PNG output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.demo.plots import (
    REWARD_KEYS,
    curves_figure,
    frame_strip,
    metric_keys,
    read_rows,
    save_figure,
    save_gif,
    to_pil,
    upscale,
)


def test_read_rows_keeps_numbers_turns_null_into_nan_and_skips_a_cut_row(tmp_path: Path) -> None:
    """read_rows: numeric values kept, null -> NaN, text and nested values dropped, a row cut by a kill skipped."""
    lines = [
        json.dumps({"step": 0, "reward_mean": 0.5, "kl": None, "note": "warmup", "hist": [1, 2]}),
        json.dumps({"step": 1, "reward_mean": 0.75, "kl": 0.125}),
        '{"step": 2, "reward_me',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = read_rows(tmp_path)
    assert len(rows) == 2
    assert rows[0].keys() == {"step", "reward_mean", "kl"} and math.isnan(rows[0]["kl"])
    assert rows[0]["step"] == 0 and rows[0]["reward_mean"] == 0.5
    assert rows[1] == {"step": 1, "reward_mean": 0.75, "kl": 0.125}


def test_metric_keys_put_the_reward_curves_first_then_the_rest_sorted_without_step() -> None:
    """metric_keys: every key any run logged except step; reward_mean, eval/reward_mean first, then sorted."""
    runs = {
        "a": [{"step": 0, "zeta": 1.0, "eval/reward_mean": 0.5}],
        "b": [{"step": 0, "alpha": 2.0, "reward_mean": 0.4}, {"step": 1, "loss": 0.1}],
    }
    assert metric_keys(runs) == ["reward_mean", "eval/reward_mean", "alpha", "loss", "zeta"]
    assert metric_keys({"a": [{"step": 0, "loss": 1.0}]}) == ["loss"]


def test_curves_figure_draws_one_panel_per_key_and_one_line_per_run_of_finite_points() -> None:
    """curves_figure: a panel per key (two per row), a line per run with (step, value), NaN/missing points left out."""
    runs = {
        "a": [
            {"step": 0, "reward_mean": 0.5, "loss": 2.0},
            {"step": 1, "reward_mean": math.nan},
            {"step": 2, "reward_mean": 0.7},
        ],
        "b": [{"step": 0, "reward_mean": 0.4}, {"step": 3, "reward_mean": 0.9, "loss": 1.0}],
    }
    fig = curves_figure(runs, ["reward_mean", "loss", "kl"], title="two runs")
    assert [ax.get_title() for ax in fig.axes] == ["reward_mean", "loss", "kl"]
    assert [ax.get_subplotspec().get_geometry()[:3] for ax in fig.axes] == [(2, 2, 0), (2, 2, 1), (2, 2, 2)]
    assert fig._suptitle.get_text() == "two runs"
    reward, loss, kl = fig.axes
    assert [line.get_label() for line in reward.lines] == ["a", "b"]
    assert [list(line.get_xdata()) for line in reward.lines] == [[0, 2], [0, 3]]
    assert [list(line.get_ydata()) for line in reward.lines] == [[0.5, 0.7], [0.4, 0.9]]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in loss.lines] == [([0], [2.0]), ([3], [1.0])]
    assert not kl.lines and kl.get_legend() is None  # no run logged it: an empty panel, no legend
    assert reward.get_legend() is not None


def test_curves_figure_with_no_keys_plots_the_reward_curves() -> None:
    """No key chosen: the two reward curves, side by side, and no title unless one is given."""
    fig = curves_figure({"a": [{"step": 0, "reward_mean": 0.5, "eval/reward_mean": 0.6}]}, [])
    assert [ax.get_title() for ax in fig.axes] == list(REWARD_KEYS)
    assert [ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes] == [(1, 2), (1, 2)]
    assert fig._suptitle is None


def test_upscale_repeats_pixels_so_the_short_side_reaches_size_and_never_shrinks() -> None:
    """upscale: nearest-neighbour by size // short side (here 4x on a 2x3 image); a size below the image: unchanged."""
    images = torch.arange(2 * 3 * 2 * 3, dtype=torch.float32).reshape(2, 3, 2, 3)
    big = upscale(images, 9)
    assert big.shape == (2, 3, 8, 12)
    assert torch.equal(big[:, :, ::4, ::4], images) and torch.equal(big[:, :, 3, 7], images[:, :, 0, 1])
    assert upscale(images, 2) is images and upscale(images, 3) is images


def test_to_pil_clamps_rounds_and_puts_channels_last() -> None:
    """to_pil: [0, 1] -> uint8 rounded to nearest (0.5 -> 128, not 127), out-of-range values clamped, (H, W, 3)."""
    image = torch.tensor([[[0.5, -0.5]], [[0.2, 1.5]], [[0.002, 1.0]]])  # (3, 1, 2)
    array = np.asarray(to_pil(image))
    assert array.dtype == np.uint8 and array.shape == (1, 2, 3)
    assert array.tolist() == [[[128, 51, 1], [0, 255, 255]]]


def test_frame_strip_puts_each_clip_on_its_own_row_of_frames() -> None:
    """frame_strip: clip n, frame f lands at row n, column f, upscaled to size, on a pad-wide grey grid."""
    clips = torch.rand(2, 3, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    strip = frame_strip(clips, size=4, pad=1)
    assert strip.shape == (3, 2 * (4 + 1) + 1, 3 * (4 + 1) + 1)
    for n in range(2):
        for f in range(3):
            tile = strip[:, 1 + n * 5 : 1 + n * 5 + 4, 1 + f * 5 : 1 + f * 5 + 4]
            assert torch.equal(tile, upscale(clips[n, f][None], 4)[0]), (n, f)


def test_save_gif_writes_a_looping_clip_at_the_frame_rate_and_size(tmp_path: Path) -> None:
    """save_gif: one GIF frame per clip frame, upscaled to size, 1000 / fps ms per frame, looping forever."""
    clip = torch.stack([torch.full((3, 4, 4), v) for v in (0.0, 0.5, 1.0)])
    path = save_gif(clip, tmp_path / "sub" / "clip.gif", size=8, fps=4)
    with Image.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (8, 8)
        assert gif.info["loop"] == 0 and gif.info["duration"] == 250
        gif.seek(2)
        assert np.asarray(gif.convert("RGB"))[0, 0].tolist() == [255, 255, 255]


def test_save_figure_writes_a_png_without_the_software_version(tmp_path: Path) -> None:
    """save_figure: the PNG carries no 'Software' (matplotlib version) text, so other builds give the same bytes."""
    fig = curves_figure({"a": [{"step": 0, "reward_mean": 0.5}]}, ["reward_mean"])
    path = save_figure(fig, tmp_path / "new" / "curve.png")
    with Image.open(path) as png:
        assert png.format == "PNG" and "Software" not in png.info


@pytest.mark.parametrize("n_points", [11, 12])
def test_curves_mark_points_only_on_short_runs(n_points: int) -> None:
    """Fewer than 12 points: a marker on each; 12 or more: a plain line."""
    rows = [{"step": i, "reward_mean": 0.1 * i} for i in range(n_points)]
    (line,) = curves_figure({"a": rows}, ["reward_mean"]).axes[0].lines
    assert line.get_marker() == ("o" if n_points < 12 else "None")


def test_read_rows_leaves_out_an_integer_too_large_for_a_float_and_curves_still_draw(tmp_path: Path) -> None:
    """read_rows: a reward of 1 and 400 zeros is dropped like text (no OverflowError in curves_figure); a row whose
    step is such an integer is skipped."""
    huge = "1" + "0" * 400
    lines = [
        json.dumps({"step": 0, "reward_mean": 0.5}),
        f'{{"step": 5, "reward_mean": {huge}, "loss": 0.25}}',
        f'{{"step": {huge}, "reward_mean": 0.75}}',
        json.dumps({"step": 6, "reward_mean": 0.625}),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = read_rows(tmp_path)
    assert rows == [{"step": 0, "reward_mean": 0.5}, {"step": 5, "loss": 0.25}, {"step": 6, "reward_mean": 0.625}]
    reward, loss = curves_figure({"a": rows}, ["reward_mean", "loss"]).axes
    assert [list(line.get_xdata()) for line in reward.lines] == [[0, 6]]
    assert [list(line.get_ydata()) for line in loss.lines] == [[0.25]]
