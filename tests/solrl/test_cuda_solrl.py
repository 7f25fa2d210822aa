"""Sol-RL on a CUDA device: the explore stage, selection and diagnostics with rewards scored on the GPU.

Found on an H100 (2026-11-27, ``python -m bench.profile --device cuda``): stage-1 rewards scored on the GPU
were written into the CPU reward table and compared with CPU tensors ("Expected all tensors to be on the
same device"). These need a GPU (``pytest -m cuda``); without one they are skipped with that reason.
"""

from __future__ import annotations

import math

import pytest
import torch
from solrl_setup import small_config, small_trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize(
    "precision",
    [
        "bf16",
        pytest.param("fp8_e4m3", marks=pytest.mark.skipif(not _fp8_ok(), reason="torch._scaled_mm needs cc >= 8.9")),
    ],
)
def test_regenerate_trains_on_cuda_and_reports_rank_agreement(precision):
    trainer = small_trainer(small_config("model.device=cuda", f"solrl.precision={precision}"))
    info = trainer.train_step()
    assert math.isfinite(float(info["train/loss"])) and info["train/skipped_updates"] == 0.0
    assert -1.0 <= float(info["solrl/pooled_kendall_tau"]) <= 1.0
    assert float(info["solrl/explore_candidates_per_s"]) > 0
