"""A small Sol-RL trainer on the embedded digits model, shared by the tests in this folder."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.config import Config, load_config
from flowrl.policy import build_policy
from flowrl.recipe import build_reward, load_run_prompts
from flowrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=4",
    "sampler.num_steps=3",
    "sampler.chunk_size=8",
    "solrl.candidates=6",
    "solrl.explore_steps=2",
    "train.progress=false",
]


def small_config(*extra: str, path: str = "configs/solrl/digits.yaml") -> Config:
    """configs/solrl/digits.yaml (or ``path``) made small: 2 prompts x 6 candidates -> 4 kept, 3 steps."""
    return load_config(ROOT / path, SMALL + list(extra))


def small_trainer(cfg: Config) -> Trainer:
    """A trainer for ``cfg`` as :class:`flowrl.recipe.Run` builds it (without the run folder)."""
    torch.manual_seed(cfg.train.seed)
    train_prompts, eval_prompts = load_run_prompts(cfg)
    policy = build_policy(cfg, trainable=True)
    return Trainer(cfg, policy, build_reward(cfg), train_prompts, eval_prompts)
