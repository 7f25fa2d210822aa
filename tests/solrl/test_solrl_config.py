"""The ``solrl`` config section: defaults off, and one-line errors for impossible combinations."""

from __future__ import annotations

import pytest
from solrl_setup import ROOT

from flowrl.config import ConfigError, load_config, unused_solrl_line


def test_off_by_default_and_the_digits_recipe_loads():
    assert load_config(None).solrl.mode == "off"
    cfg = load_config(ROOT / "configs/solrl/digits.yaml")
    assert cfg.solrl.mode == "regenerate" and cfg.solrl.candidates >= cfg.prompts.group_size


@pytest.mark.parametrize(
    "path, overrides, words",
    [
        ("configs/solrl/digits.yaml", ["solrl.candidates=1"], ["prompts.group_size", "solrl.candidates", "K=2"]),
        ("configs/solrl/digits.yaml", ["solrl.mode=correct"], ["solrl.mode=correct", "diffusion_nft", "regenerate"]),
        ("configs/grpo/digits.yaml", ["solrl.mode=regenerate"], ["solrl.mode=regenerate", "flow_grpo", "correct"]),
        ("configs/solrl/digits.yaml", ["sampler.solver=tree"], ["sampler.solver=tree"]),
        ("configs/solrl/digits.yaml", ["solrl.activations=true"], ["solrl.activations", "int8_dynamic"]),
        ("configs/solrl/digits.yaml", ["solrl.selection=top"], ["solrl.selection", "best_worst"]),
        ("configs/solrl/digits.yaml", ["solrl.explore_steps=0"], ["solrl.explore_steps", ">= 1"]),
        ("configs/solrl/digits.yaml", ["solrl.is_clip=0.5"], ["solrl.is_clip", ">= 1"]),
        ("configs/solrl/digits.yaml", ["model.dtype=bfloat16"], ["int8_dynamic", "model.dtype=float32", "bf16"]),
        ("configs/solrl/digits.yaml", ["solrl.fp8_fast_accum=true"], ["solrl.fp8_fast_accum", "int8_dynamic"]),
        ("configs/solrl/digits.yaml", ["solrl.fp8_scaling=block"], ["solrl.fp8_scaling", "row"]),
        ("configs/solrl/digits.yaml", ["solrl.fp8_scaling=tensor"], ["solrl.fp8_scaling", "applies to fp8_e4m3"]),
    ],
)
def test_bad_combinations_are_one_line_errors(path, overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / path, overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    "path, overrides, line",
    [
        ("configs/solrl/digits.yaml", [], None),
        ("configs/grpo/digits.yaml", ["solrl.mode=correct", "solrl.is_clip=3", "solrl.precision=bf16"], None),
        (
            "configs/nft/digits.yaml",  # a file that forgot solrl.mode trained plain single-stage, and said nothing
            ["solrl.candidates=64"],
            "solrl.mode=off, so solrl.candidates=64 is not read and this run trains single-stage; set solrl.mode=",
        ),
        (
            "configs/solrl/digits.yaml",  # the single-stage baseline of a Sol-RL file: runs, and says so
            ["solrl.mode=off"],
            "solrl.precision=int8_dynamic, solrl.candidates=8, solrl.explore_steps=3 are not read",
        ),
        (
            "configs/grpo/digits.yaml",
            ["solrl.mode=correct", "solrl.selection=random", "solrl.seed=7"],
            "solrl.mode=correct does not read solrl.selection=random, solrl.seed=7 (docs/solrl.md)",
        ),
        ("configs/solrl/digits.yaml", ["solrl.is_clip=3"], "solrl.mode=regenerate does not read solrl.is_clip=3.0"),
    ],
)
def test_keys_the_mode_does_not_read_are_named_in_one_warning(path, overrides, line):
    unused = unused_solrl_line(load_config(ROOT / path, overrides).solrl)
    assert unused == line if line is None else line in unused and "\n" not in unused


def test_train_check_prints_the_warning(capsys):
    from flowrl.cli import main

    assert main(["train", "--check", str(ROOT / "configs/nft/digits.yaml"), "solrl.candidates=64"]) == 0
    err = capsys.readouterr().err
    assert "flowrl: warning: solrl.mode=off, so solrl.candidates=64 is not read" in err


def test_the_keys_a_mode_reads_load():
    cfg = load_config(
        ROOT / "configs/grpo/digits.yaml", ["solrl.mode=correct", "solrl.is_clip=3", "solrl.precision=bf16"]
    )
    assert (cfg.solrl.is_clip, cfg.solrl.precision) == (3.0, "bf16")
    cfg = load_config(ROOT / "configs/solrl/digits.yaml", ["solrl.seed=7", "solrl.selection=random"])
    assert (cfg.solrl.seed, cfg.solrl.selection) == (7, "random")
