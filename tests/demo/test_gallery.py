"""`flowrl gallery`: the same run and seeds give byte-identical PNGs; small files; video frame strips."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from run_folders import make_run, make_wan_run, write_metrics

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


def test_before_after_is_base_left_and_aligned_right_on_the_first_eval_prompts_and_gallery_seeds(tmp_path) -> None:
    """before_after: first test-split prompts in rows x seeds 4_000_000 + j in columns, base | aligned, 64 px tiles."""
    from flowrl.comparison.checkpoints import base_checkpoint, run_checkpoints
    from flowrl.comparison.evaluate import sample_checkpoint
    from flowrl.demo.gallery import GALLERY_SEED_BASE, before_after
    from flowrl.demo.plots import to_pil
    from flowrl.prompts.sets import load_prompts

    data = tmp_path / "eval-set"  # a dataset folder: the gallery draws from its test split
    data.mkdir()
    (data / "train.txt").write_text("a bold handwritten 7\na thin handwritten 1\n")
    (data / "test.txt").write_text("a bold handwritten 2\na thin handwritten 6\na bold handwritten 9\n")
    run = make_run(tmp_path / "digits", seed=1, overrides=[f"prompts.eval={data}"])
    bank = CheckpointBank()
    (path,) = before_after(bank, run, tmp_path / "g", seeds=2, prompts=2, steps=2)
    assert path.name == "digits-before-after.png"
    final = run_checkpoints(run)[0]
    texts = [p.text for p in load_prompts(bank.config(final).prompts.eval, split="test")[:2] for _ in range(2)]
    assert texts == ["a bold handwritten 2"] * 2 + ["a thin handwritten 6"] * 2
    seeds = [GALLERY_SEED_BASE + j for _ in range(2) for j in range(2)]
    before = sample_checkpoint(bank, base_checkpoint(final.model_path, run), texts, seeds, 2)
    after = sample_checkpoint(bank, final, texts, seeds, 2)
    grid = np.asarray(Image.open(path))
    tile, side = 65, 2 * 65 + 1  # 8x8 samples at 8x, one pixel of padding; two seeds per row, 6 px between halves
    assert grid.shape == (side, 2 * side + 6, 3)
    for half, samples in ((0, before), (side + 6, after)):
        for i in range(4):
            r, j = divmod(i, 2)
            cell = grid[1 + r * tile : 1 + r * tile + 64 : 8, half + 1 + j * tile : half + 1 + j * tile + 64 : 8]
            assert np.array_equal(cell, np.asarray(to_pil(samples[i]))), (half, i)


def test_the_reward_curve_plots_train_and_eval_reward_titled_with_the_run(tmp_path) -> None:
    """reward_curve: the curves figure of reward_mean and eval/reward_mean for the run, under its name."""
    from flowrl.demo.gallery import reward_curve
    from flowrl.demo.plots import REWARD_KEYS, curves_figure, read_rows, save_figure

    run = tmp_path / "runx"
    write_metrics(run, [0.5, 0.6, 0.55])
    path = reward_curve(run, tmp_path / "out")
    assert path == tmp_path / "out" / "runx-reward-curve.png"
    expected = save_figure(curves_figure({"runx": read_rows(run)}, REWARD_KEYS, title="runx"), tmp_path / "e.png")
    assert path.read_bytes() == expected.read_bytes()


def test_benchmark_files_choose_compute_or_nfe_and_reader_or_wall_time(tmp_path) -> None:
    """algorithm_comparison: compute on some points only -> NFE axis (no compute needed); reader on every point ->
    no wall time needed; the image is named after the file without 'benchmarks-'."""
    from flowrl.demo.gallery import algorithm_comparison

    mixed = {
        "a": [
            {"eval/reward_mean": 0.5, "nfe": 10, "compute": 30, "wall_s": 1.0},
            {"eval/reward_mean": 0.6, "nfe": 20, "wall_s": 2.0},
        ]
    }
    read = {
        "a": [{"eval/reward_mean": 0.5, "compute": 30, "reader": 0.8}],
        "b": [{"eval/reward_mean": 0.4, "compute": 60, "reader": 0.7}],
    }
    for name, results in (("benchmarks-mixed.json", mixed), ("benchmarks-read.json", read)):
        (tmp_path / name).write_text(json.dumps(results))
        path = algorithm_comparison(tmp_path / name, tmp_path / "out")
        assert path == tmp_path / "out" / f"algorithms-{name.removeprefix('benchmarks-').removesuffix('.json')}.png"
        assert path.is_file()
    no_wall = {"a": [{"eval/reward_mean": 0.5, "compute": 30, "reader": 0.8}, {"eval/reward_mean": 0.5, "compute": 40}]}
    (tmp_path / "partial.json").write_text(json.dumps(no_wall))
    with pytest.raises(ValueError, match="every point needs eval/reward_mean, compute, wall_s"):
        algorithm_comparison(tmp_path / "partial.json", tmp_path / "out")


@pytest.mark.parametrize(("option", "flag"), [("seeds", "--seeds"), ("prompts", "--prompts")])
def test_a_count_below_one_is_refused(tmp_path, option: str, flag: str) -> None:
    """build_gallery refuses --seeds 0 and --prompts 0 with the flag's name, before loading anything."""
    with pytest.raises(ValueError, match=f"{flag} must be >= 1; got 0"):
        build_gallery([tmp_path / "no-run"], tmp_path / "g", **{option: 0})


def test_a_huge_integer_in_metrics_is_left_out_of_the_reward_curve(tmp_path) -> None:
    """reward_curve: a reward of 1 and 400 zeros in metrics.jsonl is skipped (no OverflowError), the rest drawn."""
    from flowrl.demo.gallery import reward_curve

    run = tmp_path / "runx"
    write_metrics(run, [0.5, 0.6])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward_mean": 1' + "0" * 400 + "}\n")
    path = reward_curve(run, tmp_path / "out")
    clean = tmp_path / "clean"
    write_metrics(clean, [0.5, 0.6])
    (clean / "metrics.jsonl").write_text((clean / "metrics.jsonl").read_text() + '{"step": 5}\n')
    assert path.read_bytes() == reward_curve(clean, tmp_path / "o2", name="runx").read_bytes()


def test_runs_of_the_same_name_get_distinct_images_and_a_run_given_twice_is_drawn_once(tmp_path, capsys) -> None:
    """runs/a and dup/a: runs-a-* and dup-a-* (no image overwritten); a run of a unique name keeps its name."""
    first = make_run(tmp_path / "runs" / "a", seed=0)
    second = make_run(tmp_path / "dup" / "a", seed=1)
    other = make_run(tmp_path / "runs" / "b", seed=2)
    again = tmp_path / "runs" / "b" / ".." / "a"  # the first run again, spelt otherwise
    args = ["--benchmarks", "--seeds", "1", "--prompts", "1", "--steps", "2", "--out", str(tmp_path / "g")]
    assert main(["gallery", str(first), str(second), str(other), str(again), *args]) == 0
    out = capsys.readouterr().out
    names = [line.split()[1] for line in out.splitlines()]
    assert [Path(n).name for n in names] == [
        "runs-a-before-after.png",
        "runs-a-reward-curve.png",
        "dup-a-before-after.png",
        "dup-a-reward-curve.png",
        "b-before-after.png",
        "b-reward-curve.png",
    ]
    grids = [Path(n).read_bytes() for n in names if n.endswith("-before-after.png")]
    assert grids[0] != grids[1]  # different LoRA weights: the second run did not overwrite the first


def test_unique_stems_lengthen_only_clashing_names_and_refuse_paths_no_suffix_tells_apart(tmp_path) -> None:
    """unique_stems: the fewest parent folders that make each stem distinct; t/a-b/c vs t/a/b-c (both a-b-c at
    every length once c clashes) refused in one line naming both."""
    from flowrl.demo.gallery import unique_stems

    paths = [tmp_path / "p" / "q" / "a", tmp_path / "r" / "q" / "a", tmp_path / "a", tmp_path / "c"]
    stems = unique_stems(paths, "run folders", lambda p: p.name)
    assert stems == {paths[0]: "p-q-a", paths[1]: "r-q-a", paths[2]: f"{tmp_path.name}-a", paths[3]: "c"}
    one, two = tmp_path / "a-b" / "c", tmp_path / "a" / "b-c"
    assert unique_stems([one, two], "run folders", lambda p: p.name) == {one: "c", two: "b-c"}
    clashing = [one, two, tmp_path / "w" / "b-c", tmp_path / "e" / "c"]
    with pytest.raises(ValueError, match=f"run folders {one} and {two} would get the same image names"):
        unique_stems(clashing, "run folders", lambda p: p.name)


def test_benchmark_files_no_file_name_tells_apart_are_refused_before_sampling(tmp_path, capsys) -> None:
    """benchmarks-x.json and x.json in one folder would both write algorithms-x.png: one line naming both, exit 2,
    refused before the run is sampled."""
    one, two = tmp_path / "benchmarks-x.json", tmp_path / "x.json"
    for path in (one, two):
        path.write_bytes(BENCH.read_bytes())
    args = ["--benchmarks", str(one), str(two), "--out", str(tmp_path / "g")]
    assert main(["gallery", str(tmp_path / "not-sampled"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"benchmark files {one} and {two} would get the same image names (x)" in err
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())


def test_benchmark_files_of_the_same_name_get_distinct_images(tmp_path) -> None:
    """docs/benchmarks-convergence.json and old/benchmarks-convergence.json: algorithms-docs-convergence.png and
    algorithms-old-convergence.png."""
    copy = tmp_path / "old" / "benchmarks-convergence.json"
    copy.parent.mkdir()
    copy.write_bytes(BENCH.read_bytes())
    written = build_gallery([], tmp_path / "g", benchmarks=[BENCH, copy])
    assert [p.name for p in written] == ["algorithms-docs-convergence.png", "algorithms-old-convergence.png"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"x":[{"eval/reward_mean":{"a":1},"compute":1,"wall_s":1}]}', 'eval/reward_mean is {"a": 1}'),
        ('{"x":[{"eval/reward_mean":"abc","compute":1,"wall_s":1}]}', 'eval/reward_mean is "abc"'),
        ('{"x":[{"eval/reward_mean":0.5,"compute":"zz","wall_s":1}]}', 'compute is "zz"'),
        ('{"x":[{"eval/reward_mean":null,"compute":1,"wall_s":1}]}', "eval/reward_mean is null"),
        ('{"x":[{"eval/reward_mean":NaN,"compute":1,"wall_s":1}]}', "eval/reward_mean is NaN"),
        ('{"x":[{"eval/reward_mean":0.5,"compute":true,"wall_s":1}]}', "compute is true"),
        ('{"x":[{"eval/reward_mean":0.5,"compute":1,"wall_s":1' + "0" * 400 + "}]}", "wall_s is 1000"),
        ('{"x":[{"eval/reward_mean":0.5,"compute":1,"reader":"high"}]}', 'reader is "high"'),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_a_benchmark_file_with_values_that_are_no_finite_numbers_is_refused_in_one_line(
    tmp_path, capsys, text: str, why: str
) -> None:
    """--benchmarks FILE: a dict, text, null, NaN, bool or huge integer where a number is plotted, or JSON nested too
    deeply to read: one 'is not a bench.convergence result' line naming the file and the value, exit 2."""
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert main(["gallery", "--out", str(tmp_path / "g"), "--benchmarks", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad} is not a bench.convergence result" in err and why in err, err
    assert not (tmp_path / "g").exists() or not any((tmp_path / "g").iterdir())
