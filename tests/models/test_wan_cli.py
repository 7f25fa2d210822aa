"""`flowrl train` / `flowrl sample` on a saved tiny Wan2.2 folder: video reward, true CFG, LoRA on both experts."""

import json

import numpy as np
import pytest
import yaml
from PIL import Image
from tiny_wan import tiny_wan_pipeline

from flowrl.cli import main


@pytest.mark.slow
def test_train_and_sample_a_two_expert_wan_folder(tmp_path):
    folder = tmp_path / "wan22"
    tiny_wan_pipeline(two_experts=True, boundary_ratio=0.6).save_pretrained(str(folder))
    (folder / "flowrl.json").write_text(json.dumps({"resolution": 16, "num_frames": 5, "max_sequence_length": 8}))
    (tmp_path / "prompts.txt").write_text("a red fox running\na blue cat jumping slowly\n")
    config = {
        "model": {"path": str(folder), "num_frames": 9},
        "prompts": {
            "train": str(tmp_path / "prompts.txt"),
            "eval": str(tmp_path / "prompts.txt"),
            "per_iteration": 2,
            "group_size": 2,
            "negative": "blurry static",
        },
        "sampler": {"num_steps": 4, "chunk_size": 2, "guidance_scale": 4.0, "schedule": "shift", "shift": 3.0},
        "rewards": {"temporal_consistency": {"weight": 1.0}, "ink": {"weight": 0.5, "target": "bold", "video": "mean"}},
        "train": {"iterations": 1, "eval_every": 1, "eval_seeds": 1, "progress": False},
        "output": {"dir": str(tmp_path / "run"), "grid_seeds": 2},
    }
    (tmp_path / "wan.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "wan.yaml")]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["train/first_ratio"] == 1.0 and "reward/temporal_consistency" in rows[1]
    assert rows[1]["nfe"] == 2 * (4 * 4 + 2 * 3 * 4)  # CFG: rollout 4 x 4 steps + policy and KL passes on 3 SDE steps
    assert {p.name for p in (run / "lora").glob("*.safetensors")} == {
        "pytorch_lora_weights.safetensors",
        "pytorch_lora_weights_transformer_2.safetensors",
    }
    grid = np.asarray(Image.open(run / "grid_before_after.png"))
    assert grid.ndim == 3 and grid.shape[2] == 3  # videos shown by their middle frame
    out = tmp_path / "sample.png"
    assert (
        main(
            [
                "sample",
                str(tmp_path / "wan.yaml"),
                "--lora",
                str(run),
                "--prompt",
                "a red fox",
                "--seeds",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.is_file()
