"""A folder written by a real (one-iteration) `flowrl train` run works in eval, the demo and the gallery."""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.demo.registry import RunRegistry
from flowrl.recipe import Run

FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=3",
    "sampler.chunk_size=4",
    "train.iterations=1",
    "train.eval_every=1",
    "train.eval_seeds=1",
    "output.grid_seeds=1",
    "train.progress=false",
]


@pytest.mark.slow
def test_a_trained_run_folder_is_offered_evaluated_and_drawn(tmp_path):
    run = tmp_path / "runs" / "tiny"
    Run(load_config(None, [*FAST, f"output.dir={run}"])).execute()
    assert RunRegistry([tmp_path / "runs"]).labels == ["base", "tiny"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a bold handwritten 2\na thin handwritten 6\n")
    out = tmp_path / "eval"
    assert main(["eval", str(run), "--prompts", str(prompts), "--seeds", "2", "--steps", "3", "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert [c["label"] for c in report["checkpoints"]] == ["base", "tiny"]
    assert report["checkpoints"][1]["drift_from_base"]["n"] == 4
    gallery = tmp_path / "gallery"
    assert main(["gallery", str(run), "--out", str(gallery), "--benchmarks", "--seeds", "1", "--prompts", "2"]) == 0
    assert {p.name for p in gallery.iterdir()} == {"tiny-before-after.png", "tiny-reward-curve.png"}
