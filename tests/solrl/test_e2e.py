"""Sol-RL end to end on the embedded model through flowrl.recipe.Run: two iterations, and an exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from solrl_setup import small_config

from flowrl.recipe import Run

RUN = ["train.eval_every=2", "train.eval_seeds=1", "train.eval_steps=3", "output.grid_seeds=1", "train.save_every=1"]


def _run(tmp: Path, iterations: int, resume: Path | None = None, name: str = "run") -> Path:
    out = tmp / name if resume is None else resume
    cfg = small_config(*RUN, f"train.iterations={iterations}", f"output.dir={out}")
    Run(cfg, resume=str(resume) if resume is not None else None).execute()
    return out


def _rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_iterations_log_the_diagnostics_every_iteration(tmp_path):
    out = _run(tmp_path, 2)
    trained = [r for r in _rows(out) if "train/loss" in r]
    assert len(trained) == 2
    for row in trained:
        assert row["solrl/explore_candidates_per_s"] > 0 and row["solrl/regenerate_candidates_per_s"] > 0
        assert -1.0 <= row["solrl/pooled_kendall_tau"] <= 1.0 and 0.0 <= row["solrl/extreme_overlap"] <= 1.0
        assert row["solrl/explore_s"] > 0 and row["solrl/regenerate_s"] > 0
    # stage 1: 2 prompts x 6 candidates x 2 steps (DPM-Solver++ 2M: one evaluation per step);
    # stage 2: 8 samples x 3 steps; training: 8 samples x 1 sigma (train_fraction 0.5 of 3) x 3 passes (the
    # trained and the old policy, and the base model for the file's velocity KL)
    assert trained[0]["nfe"] == 2 * 6 * 2 + 8 * 3 + 8 * 1 * 3
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_resume_mid_run_continues_exactly(tmp_path):
    straight = _run(tmp_path, 3, name="straight")
    part = _run(tmp_path, 2, name="part")
    _run(tmp_path, 3, resume=part)
    for name in ("lora.safetensors", "adapter-old.safetensors"):
        a = load_file(straight / "checkpoints" / "iter-000003" / name)
        b = load_file(part / "checkpoints" / "iter-000003" / name)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a), name
    keys = [k for k in _rows(straight)[-1] if k.startswith(("solrl/kendall", "solrl/explore_reward", "reward_mean"))]
    assert keys and all(_rows(straight)[-1][k] == _rows(part)[-1][k] for k in keys)


def test_a_run_names_the_solrl_keys_its_mode_does_not_read(tmp_path, capsys):
    """The single-stage baseline of a Sol-RL file trains (solrl.mode=off) and says which keys it leaves unread."""
    Run(small_config(*RUN, "solrl.mode=off", f"output.dir={tmp_path / 'run'}"))
    err = capsys.readouterr().err
    assert "flowrl: warning: solrl.mode=off, so solrl.precision=int8_dynamic, solrl.candidates=6" in err
    assert not (tmp_path / "run").exists()
