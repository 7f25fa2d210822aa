"""`flowrl train --check` counts Sol-RL: the explore copy's bytes and stage 1's memory and work."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.models.digits.model import DIGITS_DIR
from flowrl.models.geometry import read_geometry
from flowrl.policy import build_policy
from flowrl.resources import MAX_SAMPLE_STEPS, check_machine, check_work, estimate_memory, sample_sizes

ROOT = Path(__file__).resolve().parents[2]
SOLRL = ROOT / "configs/solrl/digits.yaml"


def _estimate(*overrides: str):
    cfg = load_config(SOLRL, list(overrides))
    return estimate_memory(cfg, read_geometry(DIGITS_DIR, cfg.lora.targets), train_prompts=20, eval_prompts=20)


def _part(est, prefix: str):
    return next(p for p in est.parts if p.name.startswith(prefix))


@pytest.mark.parametrize("precision, per_param", [("fp32", 4.0), ("bf16", 2.0), ("int8_dynamic", 1.0)])
def test_the_explore_copy_counts_every_denoiser_parameter_at_its_precision(precision, per_param):
    est = _estimate(f"solrl.precision={precision}")
    transformer = build_policy(load_config(SOLRL), trainable=False).model.transformer
    denoiser = sum(t.numel() for t in [*transformer.parameters(), *transformer.buffers()])  # the copy holds both
    part = _part(est, "Sol-RL explore copy of the denoiser")
    assert part.nbytes == denoiser * per_param and f"solrl.precision={precision}" in part.name
    off = _estimate("solrl.mode='off'")
    assert not any(p.name.startswith("Sol-RL") for p in off.parts)


def test_the_estimate_grows_with_the_candidates():
    small, large = _estimate("solrl.candidates=16"), _estimate("solrl.candidates=100000")
    assert sum(large.need.values()) > sum(small.need.values())
    latents = _part(large, "Sol-RL stage-1 latents")
    cfg = load_config(SOLRL)
    latent = sample_sizes(cfg, read_geometry(DIGITS_DIR, cfg.lora.targets)).latent
    assert (
        "solrl.candidates=100000" in latents.name and latents.nbytes == 40 * 100_000 * latent * 4
    )  # final fp32 latents
    assert not any(p.name.startswith("Sol-RL stage-1") for p in _estimate("solrl.mode='off'").parts)


def test_stage_one_work_is_checked():
    cfg = load_config(SOLRL, ["solrl.candidates=100000", "solrl.explore_steps=10", "prompts.per_iteration=100"])
    with pytest.raises(ValueError, match="Sol-RL stage 1 of one iteration .* is 100,000,000 sample-steps") as err:
        check_work(cfg, eval_prompts=20)
    assert f"above the limit of {MAX_SAMPLE_STEPS:,}" in str(err.value) and "lower solrl.candidates" in str(err.value)
    check_work(load_config(SOLRL, ["solrl.candidates=100000", "solrl.explore_steps=10", "solrl.mode='off'"]), 20)


def test_check_refuses_an_absurd_pool_in_one_line(capsys):
    code = main(["train", "--check", str(SOLRL), "solrl.candidates=100000", "prompts.per_iteration=1000"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and "solrl.candidates=100000" in err


def test_an_explore_precision_the_device_cannot_run_is_refused_before_the_model_loads(capsys):
    """native_nvfp4 off a Blackwell GPU (the lent H200 is a Hopper) failed only when the trainer built the explore
    copy, after the whole model had loaded; now --check and the start refuse it in one line."""
    message = "solrl.precision=native_nvfp4: native_nvfp4 needs a Blackwell GPU (compute capability >= 10.0)"
    code = main(["train", "--check", str(SOLRL), "solrl.precision=native_nvfp4"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and message in err, err
    with pytest.raises(ValueError, match=r"needs a Blackwell GPU .*; use precision='bf16' on a Hopper"):
        check_machine(load_config(SOLRL, ["solrl.precision=native_nvfp4"]))


def test_correct_mode_on_several_processes_is_refused_before_any_process_starts(capsys):
    """solrl.mode=correct runs on one process: --check and --processes refuse two in one line, before the model
    loads (SolRL refused it only once each rank had built its trainer); one process passes the check."""
    grpo = str(ROOT / "configs/grpo/digits.yaml")
    args = [grpo, "solrl.mode=correct", "--processes", "2"]
    for argv in (["train", "--check", *args], ["train", *args, "output.dir=/nonexistent/never-written"]):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code != 0 and len(err.splitlines()) == 1, err
        assert "solrl.mode=correct runs on one process, not 2; launch one process (--processes 1)" in err, err
    assert main(["train", "--check", grpo, "solrl.mode=correct", "--processes", "1"]) == 0
    with pytest.raises(ValueError, match="solrl.mode=correct runs on one process, not 3"):
        check_machine(load_config(grpo, ["solrl.mode=correct"]), processes=3)


def test_fp8_fast_accumulation_off_cuda_is_refused_before_the_model_loads(capsys):
    """solrl.fp8_fast_accum needs torch._scaled_mm: on a CPU (emulated FP8) --check refuses it in one line."""
    args = ["train", "--check", str(SOLRL), "solrl.precision=fp8_e4m3", "model.dtype=float32"]
    code = main([*args, "solrl.fp8_fast_accum=true"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1, err
    assert "solrl.fp8_fast_accum=true needs fp8_e4m3 on torch._scaled_mm" in err and "=false" in err, err
    assert main(args) == 0
