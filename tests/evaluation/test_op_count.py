"""bench/op_count.py: operators are attributed to the innermost timed category; per-operator cost arithmetic."""

from __future__ import annotations

import pytest
import torch

from bench.op_count import OpCounter, cost_table, per_operator_seconds, table
from bench.profile import CATEGORIES, PHASES, Timers


def test_operators_go_to_the_innermost_timed_category_and_views_apart():
    timers = Timers(lambda: None)
    x = torch.ones(4, 3)
    counter = OpCounter(timers)
    with counter:
        with timers.in_phase("collect"):
            x + 1  # "rest" of the phase
            with timers.timed("sampler"):
                y = x * 2
                y.view(12)  # a view: counted apart
                with timers.timed("forward"):
                    torch.mm(x, x.t())  # t() is a view, mm launches
    assert counter.launches[("collect", "rest")] == 1
    assert counter.launches[("collect", "sampler")] == 1
    assert counter.launches[("collect", "forward")] == 1
    assert sum(counter.views.values()) == 2


def _ops(**per: int) -> dict[str, int]:
    ops = {f"{p}/{c}": 0 for p in PHASES for c in CATEGORIES}
    ops.update({f"{p}/views": 0 for p in PHASES})
    ops.update(per)
    ops["total"] = sum(per.values())
    return ops


def test_per_operator_seconds_divide_a_gpu_runs_seconds_by_the_counts():
    ops = _ops(**{"collect/forward": 100, "update/forward": 300, "update/objective": 50})
    cuda = {"collect/forward": 0.002, "update/forward": 0.006, "update/objective": 0.004, "update/sampler": 0.1}
    per = per_operator_seconds(ops, cuda)
    assert per["forward"] == pytest.approx(2e-5) and per["objective"] == pytest.approx(8e-5)
    assert "sampler" not in per  # nothing counted there: no cost per operator
    assert "| flow_grpo | 20.0 | - | - | - | 80.0 |" in cost_table({"flow_grpo": ops}, {"flow_grpo": cuda})


def test_the_table_shows_the_share_outside_the_denoiser():
    ops = _ops(**{"collect/forward": 60, "update/backward": 20, "update/sampler": 15, "other/logging": 5})
    row = table({"awm": ops}).splitlines()[2]
    assert row.startswith("| awm | 60 | 20 | 0 | 15 |") and "| 5 | 100 | 20% |" in row
