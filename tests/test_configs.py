"""Every config under configs/ validates (no weights needed), and its header's launch command is true."""

import shlex
from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.config import ConfigError, load_config
from flowrl.config_files import split_config_args

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(
    p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "accelerate"
)  # configs/accelerate holds accelerate's launcher configs (tests/scale/test_accelerate_configs.py)
RECIPES = [p for p in CONFIGS if p.parts[1] != "presets"]
PRESETS = [p for p in CONFIGS if p.parts[1] == "presets"]


def _launch_commands(path: Path) -> list[list[str]]:
    """The command lines in a config header's ``# Launch`` block (accelerate or flowrl)."""
    lines = (ROOT / path).read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    text = [h.split("Launch:", 1)[-1].strip() for h in header]
    return [shlex.split(t) for t in text if t.startswith(("accelerate launch", "flowrl train"))]


def _train_args(command: list[str]) -> list[str]:
    if command[0] == "accelerate":
        assert command[1] == "launch" and "-m" in command, command
        module = command[command.index("-m") + 1]
        assert module == "flowrl" and command[command.index("-m") + 2] == "train", command
        assert command[command.index("--num_processes") + 1] == "1", "a header launches one process on one GPU"
        return command[command.index("-m") + 3 :]
    return command[2:]


def test_there_are_configs_for_each_model_and_algorithm():
    names = {str(p) for p in RECIPES}
    for algo in ("grpo", "nft", "awm"):
        for model in ("sd3.5m", "flux1dev", "wan2.1-1.3b"):
            assert f"configs/{algo}/{model}_pickscore.yaml" in names, (algo, model)
    for model, sizes in {"sd3.5m": (24, 48, 80), "flux1dev": (48, 80), "wan2.1-1.3b": (24, 48, 80)}.items():
        for gb in sizes:
            assert Path(f"configs/presets/{model}/gpu{gb}.yaml") in PRESETS


@pytest.mark.parametrize("path", CONFIGS, ids=str)
def test_config_validates_alone(path):
    cfg = load_config(ROOT / path)
    assert cfg.memory.attention_backend in ("sdpa", "xformers")


@pytest.mark.parametrize("path", RECIPES, ids=str)
def test_header_names_weights_and_a_launch_command_that_validates(path, monkeypatch):
    text = (ROOT / path).read_text()
    assert text.startswith("# "), "a config starts with a header comment"
    cfg = load_config(ROOT / path)
    if cfg.model.path != "flowrl-digits":
        assert "# Weights:" in text and "hf download" in text
    commands = _launch_commands(path)
    assert commands, f"{path} has no launch command in its header"
    monkeypatch.chdir(ROOT)  # the commands name configs relative to the repository root
    for command in commands:
        files, overrides = split_config_args([a for a in _train_args(command) if not a.startswith("--")])
        assert files[0] == str(path)
        load_config(files, overrides)


@pytest.mark.parametrize("preset", PRESETS, ids=str)
def test_presets_stack_on_their_model_configs(preset):
    family = preset.parts[2]
    stems = {"sd3.5m": ("sd3.5m",), "flux1dev": ("flux1dev", "flux1schnell"), "wan2.1-1.3b": ("wan2.1-1.3b",)}[family]
    recipes = [p for p in RECIPES if p.name.startswith(stems)]
    assert recipes
    for recipe in recipes:
        base, stacked = load_config(ROOT / recipe), load_config([ROOT / recipe, ROOT / preset])
        assert stacked.rewards == base.rewards and stacked.objective == base.objective
        assert stacked.sampler.chunk_size == load_config(ROOT / preset).sampler.chunk_size


def test_stacked_configs_merge_in_order_and_errors_name_the_file(tmp_path):
    a, b, bad = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "bad.yaml"
    a.write_text("sampler: {num_steps: 7, chunk_size: 5}\nrewards: {ink: {weight: 2.0}}\n")
    b.write_text("sampler: {chunk_size: 3}\nmemory: {gradient_checkpointing: true}\n")
    bad.write_text("memory: {autocast: fp8}\n")
    cfg = load_config([a, b], ["sampler.chunk_size=2"])
    assert (cfg.sampler.num_steps, cfg.sampler.chunk_size) == (7, 2) and cfg.memory.gradient_checkpointing
    assert cfg.rewards == {"ink": {"weight": 2.0}}
    with pytest.raises(ConfigError, match=r"bad.yaml: 'memory.autocast' must be one of 'none', 'bf16', 'fp16'"):
        load_config([a, bad])


def test_train_refuses_world_size_without_a_launcher(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert main(["train", "configs/grpo/digits.yaml"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 but no launcher set MASTER_ADDR" in err and "accelerate launch --num_processes 2" in err


@pytest.mark.slow
def test_the_header_accelerate_command_trains_and_the_run_exports(tmp_path):
    """The launch prefix every GPU config header uses, on the embedded model: 1 iteration, then export."""
    import os
    import subprocess
    import sys

    import torch

    header = (ROOT / "configs/grpo/sd3.5m_pickscore.yaml").read_text()
    command = next(c for c in _launch_commands(Path("configs/grpo/sd3.5m_pickscore.yaml")) if c[0] == "accelerate")
    prefix = command[: command.index("train") + 1]
    assert " ".join(prefix) in header
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    run = tmp_path / "run"
    overrides = [
        "train.iterations=1",
        "prompts.per_iteration=2",
        "prompts.group_size=2",
        "sampler.chunk_size=4",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
        "train.progress=false",
        f"output.dir={run}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [accelerate, *prefix[1:], "configs/grpo/digits.yaml", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()

    from flowrl.export import export_merged
    from flowrl.models import load_adapter

    merged = load_adapter(str(export_merged(run, tmp_path / "merged")))
    trained = load_adapter("flowrl-digits")
    trained.pipe.load_lora_weights(str(run / "lora"))
    x = torch.randn((2, *trained.latent_shape(*trained.default_resolution)), generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.8, 0.3]), trained.encode_prompt(["a bold handwritten 4", "a thin handwritten 8"])
    with torch.no_grad():
        torch.testing.assert_close(
            merged.velocity(x, sigma, cond), trained.velocity(x, sigma, cond), rtol=1e-4, atol=1e-4
        )
