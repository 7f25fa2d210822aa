"""solrl.mode=regenerate on 2 gloo processes trains the same LoRA as one process.

Each rank explores the candidates of its own prompts (``p % world_size == rank``); the stage-1
rewards are summed over the ranks, so every rank selects the same seeds; stage 2 is the ordinary
owned-rows rollout. ``correct`` mode refuses several processes (one line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
ARGS = [
    "configs/solrl/digits.yaml",
    "prompts.per_iteration=2",
    "prompts.group_size=3",
    "sampler.chunk_size=3",
    "sampler.num_steps=3",
    "solrl.candidates=4",
    "solrl.explore_steps=2",
    "solrl.precision=fp32",  # int8_dynamic scales activations per call: its rewards depend on the chunk's rows
    "train.iterations=2",
    "train.eval_every=2",
    "train.eval_seeds=1",
    "train.eval_steps=3",
    "output.grid_seeds=1",
    "train.progress=false",
]


def _env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR")}
    return {**out, "HF_HUB_OFFLINE": "1", "FLOWRL_NO_SUPERVISOR": "1", **extra}


def _train(args: list[str], out: Path, processes: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flowrl", "train"]
    if processes > 1:
        cmd = [ACCELERATE, "launch", "--main_process_port", "0"]  # a free port: never a clash on 29500
        cmd += ["--config_file", str(ROOT / "configs/accelerate/cpu_gloo.yaml"), "-m", "flowrl"]
        cmd += ["train"]
    env = _env(ACCELERATE_USE_CPU="true") if processes > 1 else _env()
    return subprocess.run(
        [*cmd, *args, f"output.dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_select_and_train_as_one(tmp_path):
    one, two = _train(ARGS, tmp_path / "one", 1), _train(ARGS, tmp_path / "two", 2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    wa = load_file(str(tmp_path / "one" / "lora" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(tmp_path / "two" / "lora" / "pytorch_lora_weights.safetensors"))
    assert wa.keys() == wb.keys() and any(bool(v.abs().max() > 0) for v in wa.values())
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-5, f"LoRA differs by {worst:g}"
    for r1, r2 in zip(_rows(tmp_path / "one")[1:], _rows(tmp_path / "two")[1:]):
        assert r2["nfe"] == r1["nfe"]  # explore + regenerate + training evaluations of all ranks
        for key in ("reward_mean", "solrl/explore_reward_mean", "solrl/pooled_kendall_tau"):
            assert r2[key] == pytest.approx(r1[key], abs=1e-5), key


@pytest.mark.slow
def test_correct_mode_refuses_several_processes(tmp_path):
    args = ["configs/grpo/digits.yaml", "solrl.mode=correct", *ARGS[1:]]
    two = _train(args, tmp_path / "two", 2)
    assert two.returncode != 0 and "solrl.mode=correct runs on one process" in two.stderr
