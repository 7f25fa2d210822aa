"""Run-folder outputs (flowrl/outputs.py): metrics rows, TensorBoard purge on resume, atomic writes, image grids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from flowrl.outputs import (
    DiskFullError,
    MetricsLogger,
    image_grid,
    json_row,
    middle_frame,
    read_metrics,
    save_png,
    thumbnails,
    write_text_atomic,
)


def test_read_metrics_keeps_rows_with_an_integer_step_only(tmp_path: Path) -> None:
    """Lines that are not objects or whose step is not an int are no rows; the last row, cut by a kill, is dropped."""
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 0, "a": 1.0}', '{"step": "1", "a": 2.0}', "[2, 3]", '{"a": 4.0}', '{"step": 1.5}', '{"step": 2}']
    path.write_text("\n".join(lines) + '\n{"step": 3, "a"')
    assert read_metrics(path) == [(0, lines[0]), (2, lines[5])]
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_a_row_that_does_not_parse_before_the_last_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    """Only the last row can be cut short by a kill: a broken one in the middle is refused, not dropped, since a
    resume rewrites the file with the rows it keeps (nothing is rewritten)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n\n{"step": 1, "a"\n{"step": 2}\n')
    message = r"metrics.jsonl: line 3 is not valid JSON \(corrupt or edited\); repair or remove that line"
    with pytest.raises(ValueError, match=message) as info:
        read_metrics(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=message):
        MetricsLogger(tmp_path, resume_step=1)
    assert path.read_bytes() == before


def test_a_resume_keeps_the_lines_that_are_no_rows(tmp_path: Path) -> None:
    """Cutting metrics.jsonl back to a checkpoint keeps lines without an integer step (only later rows go)."""
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 0}', '{"note": "x"}', '{"step": 1}', "[1, 2]", '{"step": 2}']
    path.write_text("\n".join(lines) + "\n")
    logger = MetricsLogger(tmp_path, resume_step=1)
    logger.close()
    assert [r["step"] for r in logger.rows] == [0, 1]
    assert path.read_text().splitlines() == lines[:4]


def test_a_non_utf8_byte_in_metrics_names_the_file_and_line(tmp_path: Path) -> None:
    """A byte that is not UTF-8 is refused naming metrics.jsonl, instead of the codec's bare 'can't decode byte'."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n{"step": 1}\n{"step": 2, "a": \xff}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 3 is not UTF-8 text \(byte 0xff\); repair or remove"):
        read_metrics(path)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="line 3 is not UTF-8"):
        MetricsLogger(tmp_path, resume_step=1)
    assert path.read_bytes() == before  # nothing rewritten, nothing lost


def test_non_finite_metrics_are_null_in_the_jsonl_and_kept_in_the_rows(tmp_path: Path) -> None:
    """inf and NaN become null in metrics.jsonl (strict JSON); the in-memory rows keep the floats."""
    assert json_row({"step": 1, "a": float("inf"), "b": float("nan"), "c": 0.5}) == {
        "step": 1,
        "a": None,
        "b": None,
        "c": 0.5,
    }
    logger = MetricsLogger(tmp_path)
    logger.log(0, {"loss": float("nan"), "reward_mean": 0.25, "note": "text"})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "loss": None, "reward_mean": 0.25}
    assert logger.rows[0]["reward_mean"] == 0.25 and logger.rows[0]["loss"] != logger.rows[0]["loss"]


def test_a_resume_purges_tensorboard_events_after_the_checkpoint(tmp_path: Path) -> None:
    """A fresh run starts its TensorBoard session at step 0; a resume from step 3 starts (and purges) at step 4."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for resume_step in (None, 3):
        logger = MetricsLogger(tmp_path, resume_step=resume_step)
        logger.log(0 if resume_step is None else resume_step + 1, {"reward_mean": 1.0})
        logger.close()
    starts = []
    for events in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):  # names of one second sort either way
        starts += [e.step for e in EventFileLoader(str(events)).Load() if e.HasField("session_log")]
    assert sorted(starts) == [0, 4]


def test_an_error_that_is_not_a_full_disk_is_raised_as_it_is(tmp_path: Path) -> None:
    """write_text_atomic turns only ENOSPC / EDQUOT into DiskFullError; a missing folder stays FileNotFoundError."""
    with pytest.raises(FileNotFoundError) as info:
        write_text_atomic(tmp_path / "missing" / "summary.json", "{}")
    assert not isinstance(info.value, DiskFullError)
    write_text_atomic(tmp_path / "summary.json", "{}\n")
    assert (tmp_path / "summary.json").read_text() == "{}\n" and not (tmp_path / "summary.json.tmp").exists()


def test_image_grid_tiles_row_major_with_ceil_columns() -> None:
    """Six images on 2 rows are 3 columns; image i sits at row i // 3, column i % 3, 1-pixel padding between."""
    images = torch.arange(6, dtype=torch.float32).div(10).view(6, 1, 1, 1).expand(6, 3, 2, 2)
    grid = image_grid(images, rows=2)
    assert grid.shape == (3, 2 * 3 + 1, 3 * 3 + 1)
    for i in range(6):
        r, k = divmod(i, 3)
        assert torch.equal(grid[:, 1 + 3 * r : 3 + 3 * r, 1 + 3 * k : 3 + 3 * k], images[i])
    assert grid[0, 0, 0] == 0.35 and grid[0, 3, 0] == 0.35  # the padding's grey


def test_a_clip_is_shown_by_its_middle_frame() -> None:
    """Frame F // 2 of each clip (2 of 5, 2 of 4); images pass through."""
    for frames in (5, 4):
        clips = torch.arange(frames, dtype=torch.float32).view(1, frames, 1, 1, 1).expand(2, frames, 3, 2, 2)
        assert torch.equal(middle_frame(clips), torch.full((2, 3, 2, 2), 2.0))
    images = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    assert middle_frame(images) is images


def test_thumbnails_round_each_side() -> None:
    """1000 x 300 shrunk so the long side is 256: the short side is round(300 / 3.906) = 77."""
    assert thumbnails(torch.zeros(1, 3, 1000, 300)).shape == (1, 3, 256, 77)


def test_save_png_rounds_to_the_nearest_level(tmp_path: Path) -> None:
    """[0, 1] values are written as round(255 x v), clamped: 0.999 is 255 and 0.6 / 255 is 1 (not 254 and 0)."""
    image = torch.tensor([0.999, 0.6 / 255, 1.5, -0.2]).view(1, 2, 2).expand(3, 2, 2)
    save_png(image, tmp_path / "x.png")
    with Image.open(tmp_path / "x.png") as png:
        assert list(png.getdata()) == [(255,) * 3, (1,) * 3, (255,) * 3, (0,) * 3]
