"""Every shipped GPU config trains one iteration on the CPU through ``flowrl train``, on a tiny model of its family.

tests/test_configs.py only validates these configs; a combination of keys that breaks at run time (memory
settings, sampler windows, tree and Sol-RL settings, LoRA targets, evaluation, reward options, guidance,
resolution and frames) would otherwise first show on a scarce GPU. Each run keeps every key as shipped except
what this machine and the tiny models need (:func:`_cpu_overrides`):

- ``model.path``: a saved tiny pipeline of the same family (SD3, FLUX.1-dev, FLUX.1-schnell, Wan2.1), built
  once per session; ``model.device=cpu``; ``model.resolution`` / ``model.num_frames``: the tiny model's
  (16 px, 5 frames); the model keeps its shipped ``dtype`` (bfloat16 runs on the CPU);
- prompts: two local prompt files in the shipped layout (a train/test folder or one file), a per-run prompt
  cache folder when the config names one, 2 prompts per iteration; ``train.iterations=1``,
  ``train.eval_seeds=1``, ``train.threads=1`` (the suite's one thread);
- model rewards (PickScore, CLIPScore) keep their options (dtype, scale, video) and load tiny random CLIP
  weights saved in the published layout (tests/rewards/tiny_reward_weights.py), on the CPU;
- Sol-RL: ``solrl.precision=nvfp4`` (the emulated numerics; ``native_nvfp4`` needs a Blackwell GPU) and
  ``solrl.min_features=0`` (the tiny models' layers are all narrower than the shipped 1000, which would
  quantise nothing and is refused).

Each GPU preset also runs stacked on every recipe of its model (configs/presets/<model>/).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
GPU_FOLDERS = ("grpo", "nft", "awm", "branch", "sage", "solrl")
RECIPES = sorted(
    p.relative_to(ROOT)
    for folder in GPU_FOLDERS
    for p in (ROOT / "configs" / folder).glob("*.yaml")
    if not p.name.startswith("digits")  # the embedded model's configs train in their own tests
)
PRESETS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs" / "presets").rglob("*.yaml"))
PROMPTS = ("a red fox running", "a blue cat jumping slowly", "a bold handwritten 3", "the green dog")


PRESET_MODELS = {"sd3.5m": "sd3.5-medium", "flux1dev": "flux.1-", "wan2.1-1.3b": "wan2.1-t2v-1.3b"}


def _stacks_on(preset: Path) -> list[Path]:
    """The recipes a preset stacks on: every recipe whose ``model.path`` is the preset folder's model."""
    model = PRESET_MODELS[preset.parent.name]
    return [r for r in RECIPES if Path(yaml.safe_load((ROOT / r).read_text())["model"]["path"]).name.startswith(model)]


STACKS = [(recipe, None) for recipe in RECIPES] + [(r, preset) for preset in PRESETS for r in _stacks_on(preset)]


def _family(model_path: str) -> str:
    """The tiny family standing in for a config's ``model.path``."""
    name = Path(model_path).name.lower()
    for prefix, family in (("flux.1-schnell", "flux-schnell"), ("flux.1-dev", "flux-dev"), ("wan2.1", "wan")):
        if name.startswith(prefix):
            return family
    if name.startswith("sd3.5"):
        return "sd3"
    raise ValueError(f"no tiny model stands in for model.path={model_path}; add its family to tiny_models")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """Saved tiny pipelines (one per family), tiny reward weights and local prompts, built once per session."""
    sys.path[:0] = [str(TESTS / "models"), str(TESTS / "rewards")]
    try:
        from conftest import tiny_sd3_pipeline
        from tiny_flow_pipelines import tiny_flux_pipeline
        from tiny_reward_weights import build_tiny_weights
        from tiny_wan import tiny_wan_pipeline
    finally:
        del sys.path[:2]
    root = tmp_path_factory.mktemp("gpu_configs")
    image = {"resolution": 16, "max_sequence_length": 8}
    builders = {
        "sd3": (lambda: tiny_sd3_pipeline(size=16), image),
        "flux-dev": (tiny_flux_pipeline, image),
        "flux-schnell": (lambda: tiny_flux_pipeline(guidance_embeds=False), image),
        "wan": (tiny_wan_pipeline, {**image, "num_frames": 5}),
    }
    models = {}
    for family, (build, card) in builders.items():
        folder = root / family
        build().save_pretrained(str(folder))
        (folder / "flowrl.json").write_text(json.dumps(card))
        models[family] = (folder, card)
    folder = root / "prompts"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.txt").write_text("\n".join(PROMPTS) + "\n")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return {
        "root": root,
        "models": models,
        "rewards": build_tiny_weights(root / "rewards"),
        "prompt_folder": folder,
        "prompt_file": root / "prompts.txt",
    }


def _cpu_overrides(files: list[Path], tiny: dict, run: Path) -> list[str]:
    """The overrides a GPU config needs to train on this machine's CPU with a tiny model (module docstring)."""
    recipe = yaml.safe_load((ROOT / files[0]).read_text())
    rewards = recipe["rewards"]
    for path in files[1:]:  # a later file's rewards replace the earlier ones whole
        rewards = yaml.safe_load((ROOT / path).read_text()).get("rewards", rewards)
    folder, card = tiny["models"][_family(recipe["model"]["path"])]
    out = [f"model.path={folder}", "model.device=cpu", f"model.resolution={card['resolution']}"]
    if "num_frames" in recipe["model"]:
        out.append(f"model.num_frames={card['num_frames']}")
    for key in ("train", "eval"):
        shipped = recipe["prompts"][key]
        out.append(f"prompts.{key}={tiny['prompt_file'] if shipped.endswith('.txt') else tiny['prompt_folder']}")
    if "cache_dir" in recipe["prompts"]:
        out.append(f"prompts.cache_dir={run.parent / (run.name + '-prompt-cache')}")
    out += ["prompts.per_iteration=2", "train.iterations=1", "train.eval_seeds=1", "train.threads=1"]
    for label, options in rewards.items():
        weights = tiny["rewards"].get(options.get("reward", label))
        if weights is None:
            continue  # a reward that needs no weights runs as shipped
        out += [f"rewards.{label}.{key}={value}" for key, value in weights.items()]
        if "device" in options:
            out.append(f"rewards.{label}.device=cpu")
    if "solrl" in recipe:
        out += ["solrl.precision=nvfp4", "solrl.min_features=0"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "preset"), STACKS, ids=[str(r) + ("" if p is None else f"+{p.parent.name}/{p.stem}") for r, p in STACKS]
)
def test_gpu_config_trains_one_iteration_on_a_tiny_model(recipe, preset, tiny_models, tmp_path, keep_threads):
    files = [recipe] if preset is None else [recipe, preset]
    run = tmp_path / "run"
    overrides = _cpu_overrides(files, tiny_models, run)
    assert main(["train", *(str(ROOT / f) for f in files), *overrides, "--output", str(run)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("iteration") == 1.0]
    assert trained and all(v == v for v in trained[0].values()), trained  # one iteration, no NaN in its metrics
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[-1]  # evaluated before and after
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
