"""Run folders for the demo, eval and gallery tests, written through the real save paths (no mocks).

A "run" here is what ``flowrl train`` leaves behind, minus the training: the resolved
``config.yaml``, ``metrics.jsonl`` written by ``MetricsLogger``, and a LoRA with small random
weights saved by the model adapter's own ``save_lora`` (diffusers' ``save_lora_weights``). With
``ema=True`` a DiffusionNFT ``Trainer`` is built on the policy and its state (trained + EMA
adapters) is written by ``save_checkpoint``, as a run's checkpoint is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from flowrl.checkpoint import save_checkpoint
from flowrl.config import load_config, to_dict
from flowrl.outputs import MetricsLogger
from flowrl.policy import build_policy
from flowrl.policy.lora import adapter_parameters, lora_state_dict

FAST = ["sampler.num_steps=4", "train.eval_steps=4", "prompts.per_iteration=2", "prompts.group_size=2"]
REWARDS = {"ink": {"weight": 1.0, "target": "bold"}, "jpeg_compressibility": {"weight": 0.1}}


def rewards_file(folder: Path, rewards: dict) -> str:
    """A config layer that sets the rewards section (a file's rewards replace the earlier ones whole)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / f"{folder.name}-rewards.yaml"
    path.write_text(yaml.safe_dump({"rewards": rewards}))
    return str(path)


def write_metrics(folder: Path, rewards: list[float]) -> None:
    logger = MetricsLogger(folder)
    for step, r in enumerate(rewards):
        logger.log(step, {"reward_mean": r, "eval/reward_mean": r + 0.01, "loss": 1.0 / (step + 1)})
    logger.close()


def make_run(
    folder: Path,
    *,
    seed: int = 0,
    scale: float = 0.05,
    config: str | None = None,
    overrides: list[str] | None = None,
    ema: bool = False,
    guards: dict | None = None,
    rewards: dict | None = None,
) -> Path:
    """Write a run folder whose final LoRA holds ``scale``-sized random weights (seeded by ``seed``)."""
    layers = [*([config] if config else []), rewards_file(folder, rewards or REWARDS)]
    cfg = load_config(layers, [*FAST, f"output.dir={folder}", *(overrides or [])])
    torch.manual_seed(seed)
    policy = build_policy(cfg, trainable=True)
    with torch.no_grad():
        for p in policy.params:
            p.add_(scale * torch.randn_like(p))
    folder.mkdir(parents=True)
    data = to_dict(cfg)
    if guards:
        data["guards"] = guards
    (folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    write_metrics(folder, [0.5 + 0.1 * seed + 0.02 * i for i in range(4)])
    transformer = policy.model.transformer
    saved = "default"
    if ema:
        from flowrl.prompts.sets import load_prompts
        from flowrl.recipe import build_reward
        from flowrl.trainer import Trainer

        prompts = load_prompts(cfg.prompts.train)[:4]
        trainer = Trainer(cfg, policy, build_reward(cfg), prompts, prompts)  # adds the "old" and "ema" adapters
        with torch.no_grad():
            for p in adapter_parameters(transformer, "ema").values():
                p.mul_(0.5)  # the EMA lags the trained weights
        state = {**trainer.state_dict(), "config": data}
        save_checkpoint(state, folder / "checkpoints" / f"iter-{state['iteration']:06d}")  # the name training gives it
        trainer.close()
        saved = trainer.objective.eval_adapter
    (folder / "lora").mkdir()
    policy.model.save_lora(folder / "lora", lora_state_dict(transformer, saved))
    return folder


def make_wan_run(folder: Path, model_dir: Path, *, seed: int = 0, scale: float = 0.1) -> Path:
    """A run folder on a saved tiny Wan2.1 pipeline (16x16 clips of 5 frames)."""
    from tiny_wan import tiny_wan_pipeline

    if not model_dir.exists():
        tiny_wan_pipeline().save_pretrained(str(model_dir))
        (model_dir / "flowrl.json").write_text(
            json.dumps({"resolution": 16, "num_frames": 5, "max_sequence_length": 8})
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    prompts = folder.parent / "wan_prompts.txt"
    prompts.write_text("a red fox running\na blue cat jumping slowly\n")
    config = folder.parent / f"{folder.name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(model_dir)},
                "prompts": {"train": str(prompts), "eval": str(prompts)},
            }
        )
    )
    rewards = {"temporal_consistency": {"weight": 1.0}, "ink": {"weight": 0.5, "target": "bold", "video": "mean"}}
    return make_run(folder, seed=seed, scale=scale, config=str(config), rewards=rewards)
