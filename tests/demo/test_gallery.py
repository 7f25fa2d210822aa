"""`flowrl gallery`: the same run and seeds give byte-identical PNGs; small files; video frame strips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from run_folders import make_run, make_wan_run

from flowrl.cli import main
from flowrl.comparison.checkpoints import CheckpointBank
from flowrl.demo.gallery import build_gallery

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "benchmarks-convergence.json"


def test_the_gallery_regenerates_identical_pngs(tmp_path):
    run = make_run(tmp_path / "digits", seed=1)
    first = build_gallery([run], tmp_path / "a", benchmarks=[BENCH], seeds=2, prompts=3, steps=3)
    second = build_gallery(
        [run], tmp_path / "b", benchmarks=[BENCH], seeds=2, prompts=3, steps=3, bank=CheckpointBank()
    )
    names = [p.name for p in first]
    assert names == ["digits-before-after.png", "digits-reward-curve.png", "algorithms-convergence.png"]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes(), a.name
        assert a.stat().st_size < 150_000, a.name
    grid = np.asarray(Image.open(first[0]))
    assert grid.shape[0] >= 3 * 32 and grid.shape[1] > 2 * 2 * 32  # 3 prompts x (base | aligned) x 2 seeds


def test_gallery_command_and_errors(tmp_path, capsys):
    assert main(["gallery", "--out", str(tmp_path / "g"), "--benchmarks", str(BENCH)]) == 0
    assert (tmp_path / "g" / "algorithms-convergence.png").is_file()
    assert main(["gallery", "--out", str(tmp_path / "g"), "--benchmarks", str(tmp_path / "missing.json")]) == 2
    assert "no benchmark file" in capsys.readouterr().err
    for text in ('{"a": [{}]}', '{"a": [1]}', "{bad", "[]", '{"a": []}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert main(["gallery", "--out", str(tmp_path / "g"), "--benchmarks", str(bad)]) == 2, text
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{bad} is not a bench.convergence result" in err, (text, err)


@pytest.mark.slow
def test_a_video_run_gets_a_frame_strip(tmp_path):
    run = make_wan_run(tmp_path / "wan", tmp_path / "wan-model")
    written = build_gallery([run], tmp_path / "g", seeds=1, prompts=2, steps=2)
    strip = [p for p in written if p.name == "wan-frames.png"]
    assert strip, [p.name for p in written]
    h, w, _ = np.asarray(Image.open(strip[0])).shape
    assert w > 4 * h / 2  # 5 frames in a row, two rows (base, aligned)


def test_gallery_command_passes_its_options_and_an_empty_benchmarks_list_means_none(tmp_path, monkeypatch) -> None:
    """``--benchmarks`` with no file plots no benchmark (not the defaults); --seeds/--prompts/--steps reach the grid."""
    monkeypatch.chdir(ROOT)  # where the default docs/benchmarks-convergence*.json are found
    run = make_run(tmp_path / "digits", seed=1)
    args = ["--benchmarks", "--seeds", "1", "--prompts", "2", "--steps", "2"]
    assert main(["gallery", str(run), "--out", str(tmp_path / "cli"), *args]) == 0
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert names == ["digits-before-after.png", "digits-reward-curve.png"]
    direct = build_gallery([run], tmp_path / "direct", benchmarks=[], seeds=1, prompts=2, steps=2)
    for path in direct:
        assert (tmp_path / "cli" / path.name).read_bytes() == path.read_bytes(), path.name
