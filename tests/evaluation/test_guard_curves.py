"""The reward curve shows guard curves beside the training reward; the update guards' counters are not guards."""

from PIL import Image

from flowrl.outputs import _guard_series, save_reward_curve

ROWS = [
    {"step": 0, "reward_mean": 0.1, "eval/reward_mean": 0.1, "guard/skipped_total": 0.0, "eval/diversity_ratio": 1.0}
    | {"guard/digit_correctness": 0.9, "guard/digit_correctness_best": 0.9, "guard/tripped": 0.0},
    {"step": 1, "reward_mean": 0.3, "guard/skipped_total": 0.0},
    {"step": 2, "reward_mean": 0.5, "eval/reward_mean": 0.5, "guard/skipped_total": 0.0, "eval/diversity_ratio": 0.7}
    | {"guard/digit_correctness": 0.6, "guard/digit_correctness_best": 0.9, "guard/tripped": 1.0},
]


def test_guard_series_are_the_configured_guards_and_the_diversity_ratio():
    series = _guard_series(ROWS)
    assert series == {
        "guard/digit_correctness": [(0, 0.9), (2, 0.6)],
        "eval/diversity_ratio": [(0, 1.0), (2, 0.7)],
    }
    assert _guard_series([{k: v for k, v in r.items() if not k.startswith("guard/digit")} for r in ROWS]) == {}


def test_reward_curve_gets_a_guard_panel(tmp_path):
    with_guards, without = tmp_path / "a.png", tmp_path / "b.png"
    save_reward_curve(ROWS, with_guards)
    save_reward_curve([{k: v for k, v in r.items() if not k.startswith("guard/digit")} for r in ROWS], without)
    assert Image.open(with_guards).size == (1100, 360) and Image.open(without).size == (600, 360)


def test_logged_grids_use_thumbnails_of_large_images():
    import torch

    from flowrl.outputs import thumbnails

    big = torch.rand(2, 3, 1024, 512)
    small = thumbnails(big)
    assert small.shape == (2, 3, 256, 128)
    torch.testing.assert_close(small[0, 0, 0, 0], big[0, 0, :4, :4].mean())  # area average
    assert thumbnails(torch.rand(3, 3, 16, 16)).shape == (3, 3, 16, 16)
    assert thumbnails(torch.rand(1, 5, 3, 8, 8)).shape == (1, 3, 8, 8)  # a clip: its middle frame
