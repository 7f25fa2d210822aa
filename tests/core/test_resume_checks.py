"""The kill test's checks (bench/resume_checks.py) pass on equal runs and name what differs otherwise.

The runs here are written by hand through :class:`flowrl.outputs.MetricsLogger` (the logger a
training run uses), so each check is shown to fail on the fault it exists to catch: a changed
tensor, a duplicated metrics row, a TensorBoard step written twice without a purge, a changed
summary, a missing checkpoint. ``tests/core/test_kill_resume.py`` runs them on real killed runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flowrl.outputs import MetricsLogger

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package
from bench.resume_checks import (  # noqa: E402
    check_metrics,
    check_state,
    check_summary,
    check_weights,
    compare_series,
    last_checkpoint,
    metrics_duplicates,
    tb_accumulated,
    tb_duplicates,
    tb_replayed,
    tb_served_python,
)

STEPS = 4


def _reward(step: int) -> float:
    return 0.25 * step


def _log(logger: MetricsLogger, steps: range, time_s: float) -> None:
    for step in steps:
        logger.log(step, {"reward_mean": _reward(step), "time/iteration_s": time_s + step})


def _relaunch_name(folder: Path, launch: int) -> None:
    """Give the newest events file the name a launch ``launch`` seconds later would write.

    ``SummaryWriter`` names a file by wall-clock second, host, pid and a per-process counter, and
    readers take the files in name order. Relaunches here are one process within one second, where
    the counter decides (``.10`` sorts before ``.9``); a real relaunch is a later second.
    """
    folder = folder / "tensorboard"
    for path in folder.iterdir():
        if not path.name.endswith(".launch"):
            path.rename(folder / f"events.out.tfevents.{1_000_000_000 + launch}.test.launch")


def _tensors(run: Path, name: str, scale: float) -> None:
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.arange(4.0) * scale}, str(path))


def make_run(folder: Path, time_s: float = 1.0, lora: float = 1.0, optimizer: float = 1.0, end: float = 0.5) -> Path:
    """A finished run of ``STEPS - 1`` iterations with checkpoints at iterations 1 and 3."""
    logger = MetricsLogger(folder)
    _log(logger, range(STEPS), time_s)
    logger.close()
    _relaunch_name(folder, 0)
    _tensors(folder, "lora/pytorch_lora_weights.safetensors", lora)
    for it in (1, STEPS - 1):
        ck = f"checkpoints/iter-{it:06d}"
        _tensors(folder, f"{ck}/lora.safetensors", lora)
        _tensors(folder, f"{ck}/optimizer.safetensors", optimizer)
        _tensors(folder, f"{ck}/rng.safetensors", 1.0)
        meta = {"step": it, "config": {"output": {"dir": str(folder)}}}
        (folder / ck / "trainer.json").write_text(json.dumps(meta))
    summary = {"start": {"reward": 0.0}, "end": {"reward": end}, "iterations": STEPS - 1, "samples_seen": 12}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.fixture
def ref(tmp_path) -> Path:
    return make_run(tmp_path / "reference")


def test_an_equal_run_in_another_folder_with_other_wall_times_passes_every_check(ref, tmp_path):
    run = make_run(tmp_path / "run", time_s=7.0)
    assert (
        check_weights(run, ref) == check_state(run, ref) == check_metrics(run, ref) == check_summary(run, ref) == "ok"
    )
    assert metrics_duplicates(run) == 0
    reference_tb = tb_accumulated(ref)
    for series in (tb_accumulated(run), tb_replayed(run)[0], tb_served_python(run)):
        assert compare_series(series, reference_tb) == "ok" and tb_duplicates(series) == 0


def test_a_changed_tensor_or_summary_is_named(ref, tmp_path):
    assert (
        check_weights(make_run(tmp_path / "lora", lora=2.0), ref)
        == "pytorch_lora_weights.safetensors: 1 tensors differ (e.g. w)"
    )
    assert (
        check_state(make_run(tmp_path / "adam", optimizer=2.0), ref)
        == "optimizer.safetensors: 1 tensors differ (e.g. w)"
    )
    assert check_summary(make_run(tmp_path / "end", end=0.75), ref) == 'summary end differs ({"reward": 0.75})'


def test_a_purged_resume_is_equal_and_an_unpurged_one_shows_every_duplicate(ref, tmp_path):
    resumed = make_run(tmp_path / "resumed")
    logger = MetricsLogger(resumed, resume_step=1)  # the checkpoint at 1: steps 2 and 3 are trained again
    _log(logger, range(2, STEPS), 3.0)
    logger.close()
    _relaunch_name(resumed, 1)
    series, files, doubled = tb_replayed(resumed)
    assert (files, doubled) == (2, 4)  # the raw events hold steps 2 and 3 of both tags twice: the purge hides them
    assert compare_series(series, tb_accumulated(ref)) == "ok" and tb_duplicates(series) == 0
    assert check_metrics(resumed, ref) == "ok" and metrics_duplicates(resumed) == 0

    unpurged = make_run(tmp_path / "unpurged")
    with (unpurged / "metrics.jsonl").open("a") as f:  # appended, not cut back to the checkpoint
        f.writelines(json.dumps({"step": s, "reward_mean": _reward(s)}) + "\n" for s in range(2, STEPS))
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(unpurged / "tensorboard"))  # no purge_step: no SessionLog.START
    for step in range(2, STEPS):
        writer.add_scalar("reward_mean", _reward(step), step)
    writer.close()
    _relaunch_name(unpurged, 1)
    assert metrics_duplicates(unpurged) == 2
    assert check_metrics(unpurged, ref) == "steps [0, 1, 2, 3, 2, 3]"
    series, _, doubled = tb_replayed(unpurged)
    assert doubled == 2 and tb_duplicates(series) == 2
    assert compare_series(series, tb_accumulated(ref)).startswith(
        "reward_mean: [(0, 0.0), (1, 0.25), (2, 0.5), (3, 0.75), (2,"
    )


def test_last_checkpoint_skips_partial_folders_and_names_a_run_without_one(ref, tmp_path):
    (ref / "checkpoints" / "iter-000004.partial").mkdir()  # a write that a kill cut short
    assert last_checkpoint(ref) == "checkpoints/iter-000003"
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ValueError, match="bare: the reference run has no checkpoint; train it with train.save_every"):
        last_checkpoint(bare)
