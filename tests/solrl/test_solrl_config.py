"""The ``solrl`` config section: defaults off, and one-line errors for impossible combinations."""

from __future__ import annotations

import pytest
from solrl_setup import ROOT

from flowrl.config import ConfigError, load_config


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
    ],
)
def test_bad_combinations_are_one_line_errors(path, overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / path, overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
