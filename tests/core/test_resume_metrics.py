"""Metrics resume exactly: one row per step, TensorBoard purged in place, final LoRA equal to an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flowrl.recipe as recipe
from flowrl.cli import main
from flowrl.outputs import MetricsLogger

SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=2",
    "train.save_every=1",
    "train.eval_every=1",
    "train.eval_seeds=1",
    "train.threads=1",
    "train.progress=false",
    "output.grid_seeds=1",
]
# counters that are not training state: wall times, and the prompt cache (cold again after a restart)
NOT_STATE = ("time/", "prompt_cache/")


def _train(*args: str) -> int:
    return main(["train", *SMALL, *args])


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _state_metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(NOT_STATE)} for row in _rows(run)]


def _scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _assert_same_as(run: Path, straight: Path) -> None:
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3]  # one row per step, no extra eval row
    assert _state_metrics(run) == _state_metrics(straight)
    for name in ("checkpoints/iter-000003/lora.safetensors", "lora/pytorch_lora_weights.safetensors"):
        a, b = load_file(str(run / name)), load_file(str(straight / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    for tag in ("reward_mean", "eval/reward_mean"):
        steps = [s for s, _ in _scalars(run, tag)]
        assert steps == sorted(set(steps)), (tag, steps)  # TensorBoard: no duplicated step
        assert _scalars(run, tag) == _scalars(straight, tag)
    summary, reference = (json.loads((r / "summary.json").read_text()) for r in (run, straight))
    assert summary["start"] == reference["start"] and summary["end"] == reference["end"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    assert _train("train.iterations=3", f"output.dir={out}") == 0
    return out


def test_resume_after_two_of_three_iterations(straight, tmp_path):
    out = tmp_path / "run"
    assert _train("train.iterations=2", f"output.dir={out}") == 0
    assert _train("train.iterations=3", "--resume", str(out)) == 0
    _assert_same_as(out, straight)


def test_kill_between_logging_and_checkpoint(straight, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = recipe.save_checkpoint

    def killed_at_3(state, directory):
        if state["iteration"] == 3:
            raise KeyboardInterrupt  # step 3 is already in metrics.jsonl and TensorBoard
        return real(state, directory)

    monkeypatch.setattr(recipe, "save_checkpoint", killed_at_3)
    assert _train("train.iterations=3", f"output.dir={out}") == 130
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3]
    monkeypatch.setattr(recipe, "save_checkpoint", real)
    assert _train("train.iterations=3", "--resume", str(out)) == 0
    _assert_same_as(out, straight)


def test_metrics_logger_cuts_back_to_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "reward_mean": float(s)}) for s in range(6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "rew')  # a row cut by a kill
    logger = MetricsLogger(tmp_path, resume_step=3)
    assert [r["step"] for r in logger.rows] == [0, 1, 2, 3]  # the reward curve covers the whole run
    logger.log(4, {"reward_mean": 40.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[:4] == lines[:4]
    assert [r["reward_mean"] for r in _rows(tmp_path)] == [0.0, 1.0, 2.0, 3.0, 40.0]


def test_a_time_budget_spent_during_an_evaluation_ends_the_run_there(tmp_path, monkeypatch):
    """The budget is checked after the evaluation too: that evaluation is the final one, no iteration follows."""
    import time

    evaluate, evaluated = recipe.Run._evaluate, []

    def slow(self):
        evaluated.append(self.trainer.iteration)
        metrics = evaluate(self)
        if self.trainer.iteration > 0:
            time.sleep(2.0)  # an evaluation slower than the whole budget
        return metrics

    monkeypatch.setattr(recipe.Run, "_evaluate", slow)
    overrides = ["train.iterations=20", "train.time_budget_s=1.0", "train.save_every=100"]
    assert main(["train", *SMALL, *overrides, f"output.dir={tmp_path / 'run'}"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 1 and evaluated == [0, 1]
