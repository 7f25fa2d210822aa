"""bench/solrl_frontier.py: reading `bench.solrl budget` logs and each side's best time to a target."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import solrl_frontier as frontier

HEADER = (
    "| arm | train s | iteration | reward | reader | reader bold | reader thin | ink gap | diversity ratio | reached |"
)


def _log(first: str, single: list[tuple[float, float, float]], two: list[tuple[float, float, float]]) -> str:
    """A log as `bench.solrl budget` prints it; rows are (train s, reward, diversity), the reader at 0.98."""
    lines = ["some warning", first, "", HEADER, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rows in (("single-stage DiffusionNFT", single), ("two-stage Sol-RL", two)):
        for i, (t, reward, div) in enumerate(rows):
            reader, reached = (0.95, "") if i == 0 else (0.98, "yes")
            cells = f"{t:.0f} | {i} | {reward:.3f} | {reader:.3f} | 0.9 | 0.9 | 0.1 | {div:.3f} | {reached}"
            lines.append(f"| {name} | {cells} |")
    return "\n".join([*lines, "", "target: ..."])


NEW = "Machine: 2026-11-27 15:00 UTC, ...; rewards {}; kl_beta 0.3 / 0.5; overrides [] / ['objective.kl_beta=0.5']"
OLD = "Machine: 2026-11-27 14:34 UTC, ...; rewards {}; overrides ['objective.kl_beta=0.1'] / []"


def test_the_kl_of_each_arm_comes_from_the_first_line_new_or_old():
    assert frontier.arm_kls(NEW) == (0.3, 0.5)
    assert frontier.arm_kls(OLD) == (0.1, 0.0)  # before 2026-11-27 the configs had no KL
    assert frontier.arm_kls("Machine: x; kl_beta 1e-05 / 2.5e+1; overrides [] / []") == (1e-05, 25.0)
    repeated = "Machine: x; overrides ['objective.kl_beta=0.1', 'objective.kl_beta=0.2'] / []"
    assert frontier.arm_kls(repeated) == (0.2, 0.0)  # the last override wins, as in the config
    with pytest.raises(ValueError, match="not a `bench.solrl budget` log"):
        frontier.arm_kls("Machine: nothing else")
    with pytest.raises(ValueError, match="unreadable kl_beta"):
        frontier.arm_kls("Machine: x; kl_beta 0.3 / abc; overrides [] / []")


def test_each_side_takes_its_fastest_kl_and_a_diversity_below_the_target_does_not_count():
    a = _log(NEW, [(0, 1.1, 1.0), (10, 1.2, 0.9), (20, 1.3, 0.9)], [(0, 1.1, 1.0), (10, 1.3, 0.84), (20, 1.3, 0.86)])
    b = _log(OLD, [(0, 1.1, 1.0), (10, 1.5, 0.9), (20, 1.5, 0.9)], [(0, 1.1, 1.0), (10, 1.2, 0.9), (20, 1.2, 0.9)])
    settings = frontier.collect([(0, a), (0, b)])
    keys = {(0, "single", (0.3, "")), (0, "two", (0.5, "")), (0, "single", (0.1, "")), (0, "two", (0.0, ""))}
    assert set(settings) == keys
    best = frontier.best_times(settings, 1.25, 0.85)[0]
    assert best["single"][1] == (0.1, "") and best["single"][0] == pytest.approx(3.75)  # 1.1 -> 1.5 over 0-10 s
    assert best["two"] == (20.0, (0.5, ""))  # reached at 10 s, but with diversity 0.84 < 0.85
    out = frontier.table(settings, 1.25, 0.85)
    assert "| 0 | 4 | 15 | never | 20 | 4 / 20 | 0.19x |" in out


def test_a_setting_raced_twice_counts_once_from_the_first_log():
    a = _log(NEW, [(0, 1.1, 1.0), (10, 1.3, 0.9)], [(0, 1.1, 1.0), (10, 1.3, 0.9)])
    b = _log(NEW, [(0, 1.1, 1.0), (30, 1.3, 0.9)], [(0, 1.1, 1.0), (30, 1.3, 0.9)])
    settings = frontier.collect([(1, a), (1, b)])
    assert settings[(1, "single", (0.3, ""))][-1]["train_s"] == 10


LR = (
    "Machine: x; kl_beta 0.3 / 0.5; overrides ['objective.kl_beta=0.3', 'optim.lr=6e-3', 'optim.lr=3e-3', "
    "'prompts.group_size=8'] / ['objective.kl_beta=0.5', 'solrl.candidates=16']"
)


def test_other_overrides_make_another_setting_and_name_its_column():
    assert frontier.arm_settings(LR) == ((0.3, "lr=3e-3 group_size=8"), (0.5, "candidates=16"))
    assert frontier.arm_settings(NEW) == ((0.3, ""), (0.5, ""))
    assert frontier.arm_settings("Machine: x; kl_beta 0.2 / 0.2;") == ((0.2, ""), (0.2, ""))
    plain = _log(NEW, [(0, 1.1, 1.0), (10, 1.3, 0.9)], [(0, 1.1, 1.0), (10, 1.3, 0.9)])
    tuned = _log(LR, [(0, 1.1, 1.0), (5, 1.3, 0.9)], [(0, 1.1, 1.0), (40, 1.3, 0.9)])
    settings = frontier.collect([(0, plain), (0, tuned)])
    assert len(settings) == 4  # the lr / group-size race is not the kl 0.3 race run again
    out = frontier.table(settings, 1.25, 0.85)
    head = "| seed | single kl 0.3 | single kl 0.3 lr=3e-3 group_size=8 | two kl 0.5 | two kl 0.5 candidates=16 |"
    assert head in out
    assert "| 0 | 7 | 4 | 7 | 30 | 4 / 7 | 0.50x |" in out  # 7.5 s and 3.75 s, printed to the second
    with pytest.raises(ValueError, match="unreadable override list"):
        frontier.arm_settings("Machine: x; kl_beta 0.2 / 0.2; overrides [1] / []")


def test_the_speedup_is_a_bound_where_one_side_never_reaches_the_target():
    assert frontier.speedup(30.0, 10.0, 150.0) == "3.00x"
    assert frontier.speedup(None, 50.0, 150.0) == "> 3.00x (single stage never)"
    assert frontier.speedup(30.0, None, 150.0) == "< 1x (two stage never)"
    assert frontier.speedup(None, None, 150.0) == "-"
    assert frontier.speedup(5.0, 0.0, 150.0) == frontier.speedup(None, 0.0, 150.0) == "-"  # the base meets it


def test_single_stage_never_is_bounded_by_its_shortest_run_and_unraced_settings_show_a_dash():
    short = _log(NEW, [(0, 1.1, 1.0), (100, 1.2, 0.9)], [(0, 1.1, 1.0), (10, 1.35, 0.9)])
    long = _log(OLD, [(0, 1.1, 1.0), (400, 1.2, 0.9)], [(0, 1.1, 1.0), (50, 1.2, 0.9)])
    other = _log(NEW, [(0, 1.1, 1.0), (10, 1.35, 0.9)], [(0, 1.1, 1.0), (10, 1.35, 0.9)])
    settings = frontier.collect([(0, short), (0, long), (1, other)])
    assert frontier._budget(settings, 0) == 100  # not 400: "never" is only known within the shortest run
    out = frontier.table(settings, 1.25, 0.85)
    # 1.1 -> 1.35 over 0-10 s reaches 1.25 at 6 s; seed 1 raced neither kl 0.1 single nor kl 0 two stage
    assert "| 0 | never | never | never | 6 | never / 6 | > 16.67x (single stage never) |" in out
    assert "| 1 | - | 6 | - | 6 | 6 / 6 | 1.00x |" in out
    with pytest.raises(ValueError, match="seed 7 has no single-stage run"):
        frontier._budget(settings, 7)


def test_an_unfinished_foreign_or_appended_log_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no finished evaluation table"):
        frontier.read_race(NEW + "\n" + HEADER)
    with pytest.raises(ValueError, match="no 'Machine:' line"):
        frontier.read_race("hello")
    race = _log(NEW, [(0, 1.1, 1.0), (10, 1.3, 0.9)], [(0, 1.1, 1.0), (10, 1.3, 0.9)])
    with pytest.raises(ValueError, match="holds 2 races"):
        frontier.read_race(race + "\n" + race)


def test_the_stored_race_logs_give_the_documented_frontier():
    """docs/solrl-races/ holds the 2026-11-28 logs; benchmarks.md quotes their best times to 1.28 with 80 %."""
    logs = sorted(Path(__file__).parents[2].joinpath("docs", "solrl-races").glob("*_s[0-9].log"))
    assert len(logs) == 10
    settings = frontier.collect([(int(p.stem[-1]), p.read_text()) for p in logs])
    best = frontier.best_times(settings, 1.28, 0.8)
    assert [round(best[seed]["two"][0]) for seed in range(4)] == [35, 34, 37, 39]
    assert best[0]["two"][1] == (0.3, "per_iteration=20 group_size=4 candidates=16 explore_steps=2")
    assert [None if best[s]["single"][0] is None else round(best[s]["single"][0]) for s in range(4)] == [
        46,
        109,
        None,
        132,
    ]
