"""The convergence harness counts a target as reached only when the independent reader confirms it."""

from __future__ import annotations

import torch

from bench.convergence import first_reach, first_reward_only, reader_figures, reader_floor, report
from flowrl.models.digits.model import load_digit_images


def _point(iteration: int, reward: float, reader: float, compute: int) -> dict[str, float]:
    return {
        "iteration": iteration,
        "eval/reward_mean": reward,
        "reader": reader,
        "ink_gap": 0.1,
        "wall_s": float(iteration),
        "nfe": compute,
        "compute": compute,
    }


def test_a_reward_reached_by_losing_legibility_is_not_a_hit():
    hacking = [_point(0, 1.0, 0.95, 0), _point(1, 1.3, 0.80, 10), _point(2, 1.35, 0.96, 20)]
    assert first_reward_only(hacking, 1.3)["iteration"] == 1
    assert first_reach(hacking, 1.3)["iteration"] == 2  # the reader fell below the base at iteration 1


def test_the_reader_floor_is_one_standard_error_below_the_base():
    base = {"reader": 0.95, "reader_n": 200.0}
    assert abs(reader_floor(base) - (0.95 - (2 * 0.95 * 0.05 / 200) ** 0.5)) < 1e-12
    assert reader_floor({"reader": 0.9}) == 0.9  # no count: the base itself


def test_report_names_both_hits_and_the_ratio_to_flow_grpo():
    results = {
        "flow_grpo": [_point(0, 1.0, 0.95, 0), _point(4, 1.2, 0.96, 400)],
        "fast": [_point(0, 1.0, 0.95, 0), _point(1, 1.25, 0.90, 100), _point(2, 1.21, 0.95, 200)],
        "never": [_point(0, 1.0, 0.95, 0), _point(3, 1.1, 0.97, 300)],
    }
    text = report(results, "4 iterations", "python -m bench.convergence")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1 | 2 | 95.0 % / 0.100 |" in rows["fast"]  # reward-only hit at 1, confirmed at 2
    assert rows["fast"].endswith("| 200 | 0.500 |")  # compute 200 vs Flow-GRPO's 400
    assert "| not reached | not reached |" in rows["never"]


def test_reader_figures_read_real_digits_and_their_ink():
    images, labels, styles = load_digit_images()
    pick = torch.tensor([i for i, s in enumerate(styles) if s is not None][::7])
    x = images[pick]
    metadata = {"digit": labels[pick].tolist(), "style": [styles[i] for i in pick.tolist()]}
    figures = reader_figures(x, metadata)
    assert figures["reader"] > 0.95  # the reader reads the real digits (most of these it was trained on)
    assert figures["ink_gap"] > 0.05  # real bold digits carry more ink than thin ones
