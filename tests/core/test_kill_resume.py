"""Kill test: real ``flowrl train`` processes SIGKILLed at a seeded random point and inside a checkpoint write.

The run is resumed until it finishes and must end exactly as an uninterrupted run: the same final
LoRA tensors and optimizer/RNG state, one ``metrics.jsonl`` row per step with the same values, and
TensorBoard scalars with one point per step equal to the reference's (docs/reliability.md, "Kill
test"). ``python -m bench.kill_resume`` runs the same helpers with 20 kills.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not an installed package
from bench import resume_checks as checks  # noqa: E402
from bench.kill_resume import ITERATIONS, Kill, launch, run_until_finished  # noqa: E402

pytestmark = pytest.mark.slow  # five real training processes, about 80 s on the shared 2-core machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, float]:
    """An uninterrupted run, and its training phase in seconds (metrics.jsonl opened -> exit)."""
    root = tmp_path_factory.mktemp("reference")
    ref = launch(root / "run", "fresh", None, root / "reference.log")
    assert ref.returncode == 0, ref.log.read_text()[-2000:]
    return root / "run", ref.end_s - ref.train_start_s


def test_kill_at_random_point_and_inside_checkpoint_write_then_resume_exactly(reference, tmp_path):
    ref, train_s = reference
    rng = random.Random(13)
    # launch 0 dies at a seeded random time within the first 40 % of the training phase (before the
    # last checkpoint); its resume dies inside the write of a later checkpoint; the next one dies
    # right after the last checkpoint (while the final LoRA and summary are written); the last finishes
    kills = [Kill("random", u=rng.uniform(0.15, 0.4)), Kill("checkpoint", u=0.0), Kill("final")]
    trial = run_until_finished(tmp_path / "run", kills, tmp_path, train_s, rng)
    run = trial.run

    first, second, third = trial.launches[:3]
    assert first.killed and second.killed and third.killed and trial.launches[-1].returncode == 0
    assert len(trial.launches) == 4 and second.command == "resume"
    assert third.kill.kind == "final" and third.checkpoint == third.logged_step == ITERATIONS
    # the second kill landed inside a write: its .partial folder outlived the process, and the step
    # it belongs to was already logged, so the resume must cut metrics and TensorBoard back
    target = second.kill.target
    assert second.partial is not None and second.partial.startswith(f"{target:06d}.partial")
    assert second.logged_step == target and second.checkpoint == target - 1
    assert not list((run / "checkpoints").glob("*.partial"))  # the resume removed it and wrote the checkpoint again

    assert checks.check_weights(run, ref) == "ok"
    assert checks.check_state(run, ref) == "ok"
    assert checks.metrics_duplicates(run) == 0
    assert checks.check_metrics(run, ref) == "ok"
    assert checks.check_summary(run, ref) == "ok"

    accumulated = checks.tb_accumulated(run)
    replayed, files, doubled = checks.tb_replayed(run)
    served = checks.tb_served_python(run)  # `tensorboard --load_fast=false`; its first START purges nothing
    assert files == 1 + sum(1 for ln in trial.launches if ln.command == "resume")  # one events file per launch
    assert doubled > 0  # the raw events do hold step `target` twice: the purge is what hides it
    assert [checks.tb_duplicates(series) for series in (accumulated, replayed, served)] == [0, 0, 0]
    reference_tb = checks.tb_accumulated(ref)
    assert checks.compare_series(accumulated, reference_tb) == "ok"
    assert checks.compare_series(replayed, reference_tb) == "ok"
    assert checks.compare_series(served, reference_tb) == "ok"
    assert [s for s, _ in accumulated["reward_mean"]] == list(range(1, ITERATIONS + 1))
