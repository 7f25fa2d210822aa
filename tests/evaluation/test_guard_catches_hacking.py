"""Issue 14's target: a hacking run (the old ink reward at a high learning rate) is caught by the guard
before the independent reader's accuracy falls by more than 5 points.

The embedded model's held-out evaluation logs ``eval/accuracy``: the independent reader of
:mod:`flowrl.models.digits.reader` (other data, other model family). The guard is the
``digit_correctness`` reward (the reader is not a registered reward: rewards may not import
``flowrl.models``), scored on the held-out prompts and seeds and never trained on.
"""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main

HACKING_RUN = [
    "optim.lr=0.01",  # 10x the default job's
    "objective.kl_beta=0",
    "train.iterations=12",
    "train.eval_every=1",
    "train.threads=1",
    "train.progress=false",
    "guards.digit_correctness.tolerance=0.03",
    "guards.digit_correctness.on_trip=stop",
]


@pytest.mark.slow
def test_guard_stops_the_ink_hacking_run_before_accuracy_falls_5_points(tmp_path):
    config = tmp_path / "ink.yaml"
    config.write_text("rewards:\n  ink: {target: prompt}\n")  # mean intensity: won by blotting and dimming
    run = tmp_path / "run"
    assert main(["train", str(config), f"output.dir={run}", *HACKING_RUN]) == 0
    summary = json.loads((run / "summary.json").read_text())
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    trip = summary["guards"]["trips"][0]
    assert summary["guards"]["stopped"] and summary["iterations"] == trip["iteration"] < 12
    assert rows[trip["iteration"]]["eval/ink"] > rows[0]["eval/ink"]  # the trained reward rose
    base = rows[0]["eval/accuracy"]
    for step in range(trip["iteration"] + 1):  # never more than 5 points down while the run went on
        assert rows[step]["eval/accuracy"] >= base - 0.05, (step, rows[step]["eval/accuracy"], base)
    kept = summary["guards"]["kept_iteration"]
    assert (run / "checkpoints" / "best-guard" / "pytorch_lora_weights.safetensors").is_file()
    assert rows[kept]["eval/accuracy"] >= base - 0.05
