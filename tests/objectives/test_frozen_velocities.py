"""Frozen velocities (the KL reference, DiffusionNFT's "old" policy) precomputed per optimizer step under one
adapter switch: the same training as switching per micro-batch, bit for bit, with far fewer switches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flowrl.objectives.base as base
from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward
from flowrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["prompts.per_iteration=4", "prompts.group_size=4", "sampler.chunk_size=4", "train.progress=false"]
CASES = {
    "flow_grpo": ("configs/grpo/digits.yaml", ["sampler.num_steps=4", "objective.updates_per_iteration=2"]),
    "diffusion_nft": ("configs/nft/digits.yaml", ["sampler.num_steps=4", "objective.kl_beta=1e-2"]),
    "awm": ("configs/awm/digits.yaml", ["sampler.num_steps=4", "objective.kl_beta=1e-2", "objective.ema_beta=1e-2"]),
    "branch_grpo": ("configs/branch/digits.yaml", ["prompts.group_size=16", "objective.kl_beta=1e-2"]),
}
STATES = {"flow_grpo": 1, "diffusion_nft": 2, "awm": 2, "branch_grpo": 1}  # frozen states switched to per step


def _trainer(config: str, extra: list[str]) -> Trainer:
    torch.manual_seed(0)
    cfg = load_config(str(ROOT / config), [*SMALL, *extra])
    prompts = load_prompts(cfg.prompts.train)
    return Trainer(cfg, build_policy(cfg, trainable=True), build_reward(cfg), prompts, prompts[:2])


def _train(config: str, extra: list[str], precompute: bool, monkeypatch) -> tuple[dict, list[dict], int, int]:
    trainer = _trainer(config, extra)
    switches = []
    real = base.adapter_switch

    def counted(model, adapter):
        switches.append(adapter)
        return real(model, adapter)

    monkeypatch.setattr(base, "adapter_switch", counted)
    steps = []
    step = trainer.optimizer.step
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: (steps.append(1), step(*a, **k))[1])
    if not precompute:
        monkeypatch.setattr(trainer.objective, "prepare", lambda model, batch, mbs: trainer.objective.frozen.clear())
    metrics = [trainer.train_step() for _ in range(2)]
    lora = {n: p.detach().clone() for n, p in trainer.model.transformer.named_parameters() if "lora_" in n}
    trainer.close()
    monkeypatch.undo()
    return lora, metrics, len(switches), len(steps)


@pytest.mark.parametrize("name", list(CASES))
def test_precomputed_frozen_velocities_train_bit_for_bit_with_one_switch_per_step(name, monkeypatch):
    config, extra = CASES[name]
    fast, fast_metrics, fast_switches, steps = _train(config, extra, True, monkeypatch)
    slow, slow_metrics, slow_switches, _ = _train(config, extra, False, monkeypatch)
    assert fast.keys() == slow.keys() and all(torch.equal(fast[k], slow[k]) for k in fast)  # every adapter
    for a, b in zip(fast_metrics, slow_metrics):
        assert {k: v for k, v in a.items() if "time" not in k and not k.endswith("_s")} == {
            k: v for k, v in b.items() if "time" not in k and not k.endswith("_s")
        }
    assert steps > 0 and fast_switches == STATES[name] * steps < slow_switches  # one switch per state and step


def test_a_velocity_not_precomputed_is_computed_under_its_own_switch(monkeypatch):
    model = _trainer(*CASES["flow_grpo"]).model
    calls = []
    real = model.velocity

    def counted(x, sigma, cond):
        calls.append(torch.is_grad_enabled())
        return real(x, sigma, cond)

    monkeypatch.setattr(model, "velocity", counted)
    frozen = base.FrozenVelocities()
    mb = base.Microbatch(torch.arange(2), 0)
    x, sigma, cond = torch.randn(2, 4, 8, 8), torch.full((2,), 0.5), model.encode_prompt(["a bold handwritten 3"] * 2)
    frozen.fill(model, None, [(mb, x, sigma, cond)])
    assert calls == [False]  # one no-grad forward of the base model
    v = frozen.velocity(model, None, mb, x, sigma, cond)
    assert calls == [False] and not frozen.store  # taken from the store, used once
    assert torch.equal(frozen.velocity(model, None, mb, x, sigma, cond), v) and calls == [False, False]
    frozen.fill(model, None, [(mb, torch.ones(base.FROZEN_CACHE_BYTES // 4 + 1), sigma, cond)])
    assert len(calls) == 2 and not frozen.store  # above the cap: nothing precomputed
