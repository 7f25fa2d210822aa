"""bench/solrl.py: the reader-confirmed reaching time, and a tiny race of both parts (slow)."""

from __future__ import annotations

import pytest

from bench import solrl


def _row(t: float, reward: float, reader: float, diversity: float = 1.0) -> dict[str, float]:
    return {"train_s": t, "eval/reward_mean": reward, "reader": reader, "eval/diversity_ratio": diversity}


def test_the_reaching_time_is_interpolated_on_the_reward():
    rows = [_row(0, 1.0, 0.9), _row(10, 1.1, 0.9), _row(20, 1.3, 0.95)]
    assert solrl.reach_time(rows, 1.2) == pytest.approx(15.0)
    assert solrl.reach_time(rows, 1.0) == 0.0
    assert solrl.reach_time(rows, 1.31) is None


def test_a_reward_the_reader_does_not_confirm_does_not_count():
    rows = [_row(0, 1.0, 0.9), _row(10, 1.4, 0.85), _row(20, 1.3, 0.9), _row(30, 1.5, 0.95)]
    assert solrl.reach_time(rows, 1.25) == 20.0  # reward reached at 10 s, but the reader fell below the base's 0.9
    assert solrl.reach_time(rows, 1.45) == pytest.approx(27.5)  # 1.3 -> 1.5 between 20 and 30 s
    assert solrl.reach_time([_row(0, 1.0, 0.9), _row(10, 1.4, 0.8)], 1.2) is None


@pytest.mark.slow
@pytest.mark.parametrize("part", ["budget", "modes"])
def test_a_tiny_race_prints_the_reader_confirmed_table(capsys, monkeypatch, part):
    monkeypatch.setattr(
        "sys.argv", ["solrl", part, "--budget-s", "1", "--eval-every-s", "1", "--eval-seeds", "2", "--threads", "1"]
    )
    solrl.main()
    out = capsys.readouterr().out
    assert out.count("| reached |") == 1 and "Machine at the end:" in out and " load " in out
    assert "with the reader's accuracy >= the base model's" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| arm |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    table = lines[start + 2 : end]  # the evaluation table's rows (after its header and rule)
    assert len(table) >= 4 and all(len(line.split("|")) == 12 for line in table)  # 2 arms x (base + >= 1 point)
    if part == "budget":  # then the speed-up at every shorter budget, one row per single-stage evaluation
        assert "At every shorter budget" in out and out.count("| budget s | target") == 2
        assert "keep >= 80% of the base model's diversity" in out


def test_every_single_stage_evaluation_is_a_shorter_budget_with_its_own_target():
    single = [_row(0, 1.0, 0.9), _row(10, 1.1, 0.9), _row(20, 1.2, 0.9), _row(30, 1.15, 0.95)]
    two = [_row(0, 1.0, 0.9), _row(10, 1.2, 0.9), _row(20, 1.25, 0.85), _row(30, 1.3, 0.9)]
    rows = solrl.speedups_by_budget(single, two)
    assert [r["budget_s"] for r in rows] == [10, 20, 30]
    assert (
        rows[0]["single_s"] == 10
        and rows[0]["two_s"] == pytest.approx(5.0)
        and rows[0]["speedup"] == pytest.approx(2.0)
    )
    assert rows[1]["single_s"] == 20 and rows[1]["two_s"] == 10 and rows[1]["speedup"] == 2.0
    # 1.15 is first reached by single stage between 10 and 20 s; two stage at 1.15 between 0 and 10 s
    assert rows[2]["single_s"] == pytest.approx(15.0) and rows[2]["two_s"] == pytest.approx(7.5)
    never = solrl.speedups_by_budget(single, [_row(0, 1.0, 0.9), _row(30, 1.12, 0.9)])
    assert never[1]["two_s"] is None and never[1]["speedup"] is None
    table = solrl.budget_table(never)
    assert table.count("\n") == 4 and "| 20 | 1.200 | 20 | never | - |" in table


def test_with_a_diversity_floor_collapsed_evaluations_neither_set_nor_reach_targets():
    single = [_row(0, 1.0, 0.9), _row(10, 1.1, 0.9, 0.9), _row(20, 1.2, 0.9, 0.7), _row(30, 1.25, 0.9, 0.6)]
    two = [_row(0, 1.0, 0.9), _row(10, 1.2, 0.9, 0.75), _row(20, 1.15, 0.9, 0.85), _row(30, 1.3, 0.9, 0.5)]
    assert solrl.reach_time(two, 1.1) == pytest.approx(5.0)  # the reader alone: 1.2 at 10 s counts
    assert solrl.reach_time(two, 1.1, 0.8) == 20.0  # 1.2 at 10 s kept 75 % of the diversity; 1.15 at 20 s counts
    assert solrl.reach_time(two, 1.2, 0.8) is None
    rows = solrl.speedups_by_budget(single, two, 0.8)
    assert [r["budget_s"] for r in rows] == [10]  # only the single-stage evaluation at 10 s kept the floor
    assert rows[0]["single_s"] == 10 and rows[0]["two_s"] == 20 and rows[0]["speedup"] == pytest.approx(0.5)


@pytest.mark.slow
def test_the_speed_table_rates_the_chosen_explore_copies(capsys, monkeypatch):
    argv = ["solrl", "speed", "--prompts", "2", "--candidates", "4", "--rounds", "1", "--threads", "1"]
    monkeypatch.setattr("sys.argv", [*argv, "--only", "fp32", "bf16"])
    solrl.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "variant" not in line]
    names = [row.split("|")[1].strip() for row in rows]
    full = ["full precision (stage 2)", "full precision, 10 steps"]
    assert names == [*full, "fp32 merged, 3 steps", "bf16 merged, 3 steps"]
    assert rows[0].split("|")[4].strip() == "1.00x" and rows[0].split("|")[5].strip() == "1.000"  # against itself


def _args(*argv: str):
    return solrl.build_parser().parse_args(["budget", *argv])


def test_both_arms_of_a_budget_race_share_the_task_and_the_kl_unless_overridden():
    one, two = solrl.arm_configs(_args("--set", "objective.kl_beta=0.25"))
    assert one.objective["name"] == two.objective["name"] == "diffusion_nft"
    assert one.objective["kl_beta"] == two.objective["kl_beta"] == 0.25
    assert one.rewards == two.rewards and one.solrl.mode == "off" and two.solrl.mode == "regenerate"
    one, two = solrl.arm_configs(_args("--set", "objective.kl_beta=0.25", "--set-single", "objective.kl_beta=0.1"))
    assert (one.objective["kl_beta"], two.objective["kl_beta"]) == (0.1, 0.25)
    one, two = solrl.arm_configs(_args())  # the shipped file's KL reaches the single-stage arm too
    assert one.objective["kl_beta"] == two.objective["kl_beta"] > 0


def test_the_budget_summary_counts_a_target_two_stage_never_reached_as_zero():
    rows = [
        {"budget_s": 10, "speedup": 5.0, "single_s": 5.0, "two_s": 1.0},
        {"budget_s": 60, "speedup": 2.0, "single_s": 40.0, "two_s": 20.0},
        {"budget_s": 70, "speedup": 3.0, "single_s": 60.0, "two_s": 20.0},
        {"budget_s": 80, "speedup": None, "single_s": 80.0, "two_s": None},
        {"budget_s": 90, "speedup": None, "single_s": None, "two_s": None},  # single stage's own reader said no
        {"budget_s": 95, "speedup": None, "single_s": None, "two_s": 30.0},
    ]
    assert solrl.budget_summary(rows, 50) == "over the 3 budgets of 50 s or more: smallest 0.00x, median 2.00x"
    assert solrl.budget_summary(rows, 100) == "no budget of 100 s or more"
