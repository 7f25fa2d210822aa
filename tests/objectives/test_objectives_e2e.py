"""Two iterations of every objective on the embedded model, through the real recipe."""

import json

import pytest

from flowrl.config import load_config
from flowrl.recipe import Run

SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=4",
    "sampler.chunk_size=8",
    "train.iterations=2",
    "train.eval_every=2",
    "train.eval_seeds=1",
    "output.grid_seeds=1",
    "train.progress=false",
]


@pytest.mark.parametrize(
    "config",
    [
        "configs/grpo/digits.yaml",
        "configs/nft/digits.yaml",
        "configs/awm/digits.yaml",
        "configs/nft/digits_fast.yaml",
        "configs/awm/digits_fast.yaml",
    ],
)
def test_two_iterations(config, tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / config, SMALL + [f"output.dir={tmp_path / 'run'}"])
    summary = Run(cfg).execute()
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 2 and all(r["nfe"] > 0 for r in trained)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    if cfg.objective["name"] == "diffusion_nft":
        assert (tmp_path / "run" / "checkpoints" / "iter-000002" / "adapter-old.safetensors").is_file()
        assert rows[-1]["train/old_decay"] == pytest.approx(0.002)
    if config.endswith("_fast.yaml"):  # 8 samples x 5 rollout steps + 8 x 2 sigmas x passes per sigma
        passes = 2 if cfg.objective["name"] == "diffusion_nft" else 3  # NFT: trained + old (no KL); AWM: + base + EMA
        assert trained[0]["nfe"] == 8 * 5 + 8 * 2 * passes
