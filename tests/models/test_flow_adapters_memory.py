"""Memory controls (flowrl/policy/memory.py) on the FLUX.1 and Qwen-Image adapters, through the real Trainer."""

import pytest
import torch
from tiny_flow_pipelines import tiny_flux, tiny_qwen_image

from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.trainer import Trainer

ALL_ON = [
    "memory.gradient_checkpointing=true",
    "memory.autocast=bf16",
    "memory.vae_tiling=true",
    "memory.vae_slicing=true",
    "memory.offload_encoders=true",
    "memory.offload_vae=true",
    "memory.free_encoders_when_cached=true",
]


@pytest.mark.parametrize("build", [tiny_flux, tiny_qwen_image], ids=["flux", "qwen_image"])
def test_every_memory_control_trains_with_an_exact_first_ratio(build, tmp_path):
    model = build()
    cfg = load_config(
        None,
        [
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=2",
            "sampler.chunk_size=2",
            "sampler.schedule=model",
            "lora.rank=4",
            "lora.alpha=8",
            "optim.lr=0.05",
            f"prompts.cache_dir={tmp_path}",
            *ALL_ON,
        ],
    )
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        build_multi_reward({"ink": {"weight": 1.0}}),
        prompts,
        prompts[:2],
    )
    assert model.transformer.is_gradient_checkpointing
    lora_b = {n: p.clone() for n, p in model.transformer.named_parameters() if "lora_B" in n}
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert any(not torch.equal(p, lora_b[n]) for n, p in model.transformer.named_parameters() if n in lora_b)
    assert all(
        getattr(model.pipe, name, None) is None for name in ("text_encoder", "text_encoder_2")
    )  # freed once cached
    assert set(trainer.evaluate()) >= {"eval/reward_mean"}
