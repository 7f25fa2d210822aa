"""DDPO's per-prompt advantages (advantage.method: per_prompt) through the training loop and its checkpoint."""

import json

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.checkpoint import load_checkpoint, save_checkpoint
from flowrl.config import ConfigError, load_config
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.trainer import Trainer

PER_PROMPT = [
    "prompts.per_iteration=3",
    "prompts.group_size=1",  # one sample per prompt: no group to normalise against
    "sampler.num_steps=3",
    "sampler.chunk_size=3",
    "train.eval_seeds=1",
    "optim.lr=0.01",
    "advantage.method=per_prompt",
    "advantage.buffer_size=4",
    "advantage.min_count=2",
]


def _trainer(model):
    cfg = load_config(None, PER_PROMPT)
    prompts = load_prompts("digits-styles")[:2]  # 3 draws from 2 prompts: histories fill within a few iterations
    policy = build_policy(cfg, model=model, trainable=True)
    return Trainer(cfg, policy, build_multi_reward(cfg.rewards), prompts, prompts[:1])


def test_per_prompt_advantages_train_and_resume_exactly(tiny_sd3, tmp_path):
    trainer = _trainer(tiny_sd3)
    for _ in range(2):
        metrics = trainer.train_step()
    assert metrics["zero_std_groups"] == 0.0  # per-prompt normalisation never drops a single-sample group
    history = trainer.advantage.state_dict()["history"]
    assert sum(len(v) for v in history.values()) == 6  # every sample's reward recorded under its prompt
    json.dumps(trainer.state_dict()["advantage"])  # JSON, so it travels in trainer.json

    save_checkpoint(trainer.state_dict(), tmp_path / "ckpt")
    resumed = _trainer(SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)))
    resumed.load_state_dict(load_checkpoint(tmp_path / "ckpt"))
    assert resumed.advantage.state_dict() == trainer.advantage.state_dict()
    batch, _ = trainer.collect()
    again, _ = resumed.collect()
    assert torch.equal(batch.advantages, again.advantages)  # the history decides the next advantages alike


def test_single_sample_groups_need_per_prompt_advantages():
    with pytest.raises(ConfigError, match="group_size' must be >= 2 for advantage.method=sum.*per_prompt"):
        load_config(None, ["prompts.group_size=1"])
    assert load_config(None, ["prompts.group_size=1", "advantage.method=per_prompt"]).prompts.group_size == 1
