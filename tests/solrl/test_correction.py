"""solrl.mode=correct: truncated importance weights (float64) and the weighted objective."""

from __future__ import annotations

import math

import pytest
import torch
from solrl_setup import small_config, small_trainer

from flowrl.config import load_config
from flowrl.objectives.base import Microbatch
from flowrl.objectives.flow_grpo import clipped_policy_loss
from flowrl.solrl.correction import ImportanceWeighted, truncated_importance_weights


def test_weights_are_the_truncated_density_ratio_in_float64():
    log_p = torch.tensor([[0.0, -1.0, 2.0], [0.5, -3.0, 1e-9]], dtype=torch.float64)
    log_q = torch.tensor([[0.0, -1.5, 1.0], [1.5, -2.0, 0.0]], dtype=torch.float64)
    w = truncated_importance_weights(log_p, log_q, clip=2.0)
    expected = [[1.0, math.exp(0.5), 2.0], [math.exp(-1.0), math.exp(-1.0), math.exp(1e-9)]]
    assert w.dtype == torch.float64
    assert torch.equal(w, torch.tensor(expected, dtype=torch.float64))  # exp(1) = 2.718 > C is truncated to 2
    levels = torch.tensor([0.7, 0.0, 0.7], dtype=torch.float64)
    masked = truncated_importance_weights(log_p, log_q, clip=2.0, levels=levels)
    assert torch.equal(masked[:, 1], torch.ones(2, dtype=torch.float64)) and torch.equal(masked[:, 0], w[:, 0])


@pytest.mark.parametrize("bad", [{"clip": 0.5}, {"shape": (2, 4)}, {"shape": (6,), "p_shape": (6,)}])
def test_weights_refuse_bad_input(bad):
    """C < 1, mismatched shapes and matching shapes that are not (B, T) are refused."""
    log_p = torch.zeros(bad.get("p_shape", (2, 3)), dtype=torch.float64)
    log_q = torch.zeros(bad.get("shape", (2, 3)), dtype=torch.float64)
    with pytest.raises(ValueError):
        truncated_importance_weights(log_p, log_q, clip=bad.get("clip", 2.0))


def test_a_positive_weight_on_the_advantage_scales_the_clipped_loss_exactly():
    """max(-wAr, -wA clip(r)) = w max(-Ar, -A clip(r)) for w > 0 (float64)."""
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(64, generator=g, dtype=torch.float64) * 0.1
    old = torch.randn(64, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(64, generator=g, dtype=torch.float64)
    w = torch.rand(64, generator=g, dtype=torch.float64) * 2 + 1e-3
    weighted, _ = clipped_policy_loss(log_prob, old, adv * w, 0.05)
    plain, _ = clipped_policy_loss(log_prob, old, adv, 0.05)
    assert torch.allclose(weighted, w * plain, rtol=1e-14, atol=0)


def test_correct_mode_trains_flow_grpo_on_explore_rollouts_with_ratio_one():
    """A fresh LoRA and an fp32 explore copy: the copy is the policy, so every weight is exactly 1."""
    cfg = small_config("solrl.mode=correct", "solrl.precision=fp32", path="configs/grpo/digits.yaml")
    trainer = small_trainer(cfg)
    assert isinstance(trainer.objective, ImportanceWeighted) and trainer.objective.name == "flow_grpo"
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0
    assert metrics["solrl/is_weight_mean"] == 1.0 and metrics["solrl/is_weight_min"] == 1.0
    assert metrics["train/skipped_updates"] == 0.0
    weights = trainer.objective.weights
    assert weights.shape == (8, 3)


def test_importance_weighted_loss_is_the_inner_loss_with_scaled_advantages():
    cfg = small_config("solrl.mode=correct", "solrl.precision=int8_dynamic", path="configs/grpo/digits.yaml")
    trainer = small_trainer(cfg)
    batch, _ = trainer.collect()
    objective = trainer.objective
    weights = objective.weights
    assert weights.dtype == batch.trajectory.log_probs.dtype and bool((weights <= cfg.solrl.is_clip).all())
    mb = Microbatch(torch.arange(4), 1)
    loss, _ = objective.loss(trainer.model, batch, mb)
    scaled = batch._replace(advantages=batch.advantages * weights[:, 1])
    inner, _ = objective.inner.loss(trainer.model, scaled, mb)
    assert torch.equal(loss.detach(), inner.detach())


def test_weight_metrics_cover_the_stochastic_steps_only():
    """With an SDE window, steps outside it are Euler steps of weight exactly 1: the logged weight statistics
    read only the stochastic steps (a mean over every step would be pulled towards 1)."""
    cfg = small_config(
        "solrl.mode=correct",
        "solrl.precision=int8_dynamic",
        "sampler.window=fixed",
        "sampler.window_start=0",
        "sampler.window_size=2",
        path="configs/grpo/digits.yaml",
    )
    trainer = small_trainer(cfg)
    batch, info = trainer.collect()
    stochastic = batch.trajectory.noise_levels > 0
    assert stochastic.tolist() == [True, True, False]
    weights = trainer.objective.weights
    assert bool((weights[:, ~stochastic] == 1).all()) and bool((weights[:, stochastic] != 1).any())
    assert float(info["solrl/is_weight_mean"]) == pytest.approx(float(weights[:, stochastic].mean()), rel=1e-6)
    assert float(info["solrl/is_weight_min"]) == pytest.approx(float(weights[:, stochastic].min()), rel=1e-6)


def test_only_correct_mode_wraps_the_objective_so_regenerate_keeps_its_training_noise_estimate() -> None:
    """build_objective wraps only under solrl.mode=correct: regenerate's DiffusionNFT keeps its estimated noise."""
    from flowrl.memory_estimate import estimate_memory
    from flowrl.models.digits.model import DIGITS_DIR
    from flowrl.models.geometry import read_geometry
    from flowrl.objectives import DiffusionNFT
    from flowrl.trainer import build_objective

    geometry = read_geometry(DIGITS_DIR, None)

    def noise_parts(*overrides: str) -> list[tuple[str, float]]:
        cfg = load_config("configs/solrl/digits.yaml", list(overrides))
        parts = estimate_memory(cfg, geometry).parts
        return [(p.name, p.nbytes) for p in parts if p.name.startswith("training noise")]

    regenerate = load_config("configs/solrl/digits.yaml", ["solrl.mode=regenerate"])
    assert type(build_objective(regenerate)) is DiffusionNFT
    assert noise_parts("solrl.mode=regenerate") == noise_parts("solrl.mode=off") != []
