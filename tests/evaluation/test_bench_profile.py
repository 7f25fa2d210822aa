"""bench/profile.py: the attribution adds up on the real training path, and timed iterations are steady-state ones."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.profile import CATEGORIES, overheads, profile_objective, reward_networks, run_for
from flowrl.samplers.sde_steps import SDE_STEPS, flow_step


def test_overheads_are_shares_of_the_phase_outside_the_denoiser():
    m = {f"{p}/{c}": 0.0 for p in ("collect", "update") for c in CATEGORIES}
    m.update({"collect/wall": 1.0, "collect/forward": 0.8, "collect/decode": 0.01, "collect/vae": 0.04})
    m.update({"collect/rewards": 0.02, "collect/reward_nets": 0.03})
    m.update({"update/wall": 2.0, "update/forward": 1.0, "update/backward": 0.9})
    out = overheads(m)
    assert out["collect"] == pytest.approx(0.2) and out["collect_framework"] == pytest.approx(0.1)
    assert out["collect_networks"] == pytest.approx(0.13)  # the VAE and the reward network are model work
    assert out["update"] == out["update_networks"] == out["update_framework"] == pytest.approx(0.05)


@pytest.mark.slow
def test_warm_prompts_leaves_no_first_time_encoding_to_a_timed_iteration(tmp_path):
    # BranchGRPO samples 10 of its 20 prompts per iteration: cold, its early iterations encode prompts
    run = run_for("configs/branch/digits.yaml", ["train.threads=1"], tmp_path / "run")
    trainer = run.trainer
    trainer.warm_prompts()
    misses = trainer.prompt_cache.misses
    assert misses == 20
    for _ in range(2):
        trainer.train_step()
    assert trainer.prompt_cache.misses == misses


@pytest.mark.slow
def test_the_categories_add_up_to_the_iteration():
    args = argparse.Namespace(iterations=1, warmup=0, device="cpu", config_rev=None)
    m = profile_objective("branch_grpo", "configs/branch/digits.yaml", ["train.threads=1"], args)
    for phase in ("collect", "update"):
        parts = sum(m[f"{phase}/{c}"] for c in CATEGORIES)
        assert parts == pytest.approx(m[f"{phase}/wall"], rel=0.02)  # exclusive times: nothing counted twice
    assert m["collect/forward"] > 0 and m["collect/decode"] > 0 and m["collect/rewards"] > 0
    assert m["collect/vae"] > 0 and m["collect/reward_nets"] > 0  # the digit classifier of digit_correctness
    assert m["collect/backward"] == 0 and m["update/backward"] > 0 and m["update/decode"] == 0
    assert m["collect/wall"] + m["update/wall"] <= m["wall"]
    assert m["samples"] == 160 and m["collect/flops"] > m["collect/model_flops"] > 0
    assert m["update/sampler"] > 0 and SDE_STEPS["flow"] is flow_step  # timed while profiling, restored after


def test_reward_networks_are_the_modules_the_components_hold():
    from flowrl.rewards import MultiReward, ink
    from flowrl.rewards.digits import DigitCorrectness

    correctness = DigitCorrectness()
    net = torch.nn.Linear(2, 2)
    reward = MultiReward(
        {"c": (correctness, 1.0), "ink": (ink("bold"), 1.0), "net": (net, 1.0), "again": (correctness, 1.0)}
    )
    assert reward_networks(reward) == [correctness.model, net]
