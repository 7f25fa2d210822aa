"""``flowrl pretrain-digits`` as a user runs it: options and ``--out`` checked before training, no folder replaced
without ``--overwrite``, an atomic swap at the end, and no non-finite model saved."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from flowrl.cli import main as flowrl_main
from flowrl.models.digits.model import DIGITS_DIR, build_digits_pipeline
from flowrl.models.digits.pretrain import build_parser, pretrain_digits
from flowrl.models.digits.pretrain_output import check_out, save_model
from flowrl.runtime import max_threads

TINY = ["--vae-steps", "1", "--flow-steps", "1", "--eval-per-class", "0", "--batch-size", "2"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = flowrl_main(["pretrain-digits", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(code: int, out: str, err: str) -> str:
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("flowrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "vae step" not in out + err  # refused before any training
    return lines[0]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) by relative path, with its content hash."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _old_model(folder: Path) -> Path:
    """A folder that holds a (stand-in) model, plus a file of the user's that is not the model's."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"old weights")
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}\n')
    (folder / "notes.txt").write_text("mine\n")
    return folder


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--logit-normal-mean", "nan"], "--logit-normal-mean must be a finite number; got nan"),
        (["--logit-normal-mean=-inf"], "--logit-normal-mean must be a finite number; got -inf"),
        (["--seed", "-1"], "--seed must be >= 0; got -1"),
        (["--seed", str(2**64)], "--seed must be <= 18446744073709551615"),
        (["--eval-per-class", "-3"], "--eval-per-class must be >= 0; got -3"),
        (["--vae-steps", "0"], "--vae-steps must be >= 1; got 0"),
        (["--flow-steps", "0"], "--flow-steps must be >= 1; got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1; got 0"),
        (["--batch-size", "1798"], "--batch-size must be <= 1797"),
        (["--threads", "0"], "--threads must be >= 1; got 0"),
        (["--threads", str(max_threads() + 1)], f"CPU cores; use at most {max_threads()} (default 1)"),
    ],
)
def test_a_bad_option_is_refused_by_name_before_training(args, fragment, tmp_path, capsys):
    out = tmp_path / "model"
    line = _one_error_line(*_run(capsys, "--out", str(out), *TINY, *args))
    assert fragment in line, line
    assert not out.exists()


def test_an_out_that_is_a_file_or_under_one_is_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    line = _one_error_line(*_run(capsys, "--out", str(afile), *TINY))
    assert f"--out {afile} is an existing file, not a folder" in line, line
    line = _one_error_line(*_run(capsys, "--out", str(afile / "sub"), *TINY))
    assert f"{afile} is a file, not a folder" in line, line
    assert afile.read_text() == "keep\n"


def test_a_folder_holding_a_model_is_not_replaced_without_overwrite(tmp_path, capsys):
    old = _old_model(tmp_path / "model")
    before = _snapshot(old)
    line = _one_error_line(*_run(capsys, "--out", str(old), *TINY))
    assert f"--out {old} already holds a model; pass --overwrite" in line, line
    other = tmp_path / "other"
    other.mkdir()
    (other / "photo.png").write_bytes(b"png")
    line = _one_error_line(*_run(capsys, "--out", str(other), *TINY))
    assert f"--out {other} is not empty; pass --overwrite" in line, line
    assert _snapshot(old) == before and _snapshot(other) == {"photo.png": hashlib.sha256(b"png").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "other"]


def test_the_default_out_is_the_shipped_model_and_needs_overwrite():
    assert build_parser().parse_args([]).out == DIGITS_DIR
    with pytest.raises(FileExistsError, match="shipped flowrl-digits model every default job uses.*--overwrite"):
        check_out(DIGITS_DIR, overwrite=False)


def test_overwrite_swaps_in_a_loadable_model_and_keeps_the_users_files(tmp_path, capsys):
    from diffusers import StableDiffusion3Pipeline

    old = _old_model(tmp_path / "model")
    old.chmod(0o750)
    code, out, err = _run(capsys, "--out", str(old), "--overwrite", *TINY)
    assert code == 0, err[-2000:]
    assert (old / "notes.txt").read_text() == "mine\n"
    assert (old / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != b"old weights"
    assert (old / "flowrl.json").is_file() and old.stat().st_mode & 0o777 == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no partial or previous folder left
    pipe = StableDiffusion3Pipeline.from_pretrained(str(old), local_files_only=True)
    assert all(torch.isfinite(p).all() for p in pipe.transformer.parameters())


def test_a_save_that_fails_midway_leaves_the_old_model(tmp_path):
    old = _old_model(tmp_path / "model")
    before = _snapshot(old)
    pipe = build_digits_pipeline(0)
    blocks = pipe.transformer.transformer_blocks
    blocks[1].attn.to_q.weight = blocks[0].attn.to_q.weight  # safetensors refuses shared tensors: the
    with pytest.raises(RuntimeError, match="share memory"):  # text encoders and vae are written by then
        save_model(pipe, {}, old, overwrite=True, log=lambda _: None)
    assert _snapshot(old) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize("where", ["transformer", "text_encoder_3", "vae"])
def test_a_model_with_non_finite_weights_is_not_saved(where, tmp_path):
    old = _old_model(tmp_path / "model")
    before = _snapshot(old)
    pipe = build_digits_pipeline(0)
    with torch.no_grad():
        next(getattr(pipe, where).parameters()).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=f"the trained {where} has NaN or infinite weights .*; nothing was saved"):
        save_model(pipe, {}, old, overwrite=True, log=lambda _: None)
    assert _snapshot(old) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_an_infinite_vae_scaling_is_not_saved(tmp_path):
    pipe = build_digits_pipeline(0)
    pipe.vae.register_to_config(scaling_factor=float("inf"))
    with pytest.raises(ValueError, match="the trained vae's scaling_factor is inf"):
        save_model(pipe, {}, tmp_path / "model", overwrite=False, log=lambda _: None)
    assert not list(tmp_path.iterdir())


def test_the_python_api_refuses_a_bad_type_by_flag_name(tmp_path):
    with pytest.raises(TypeError, match=r"--seed must be an integer; got 1\.5"):
        pretrain_digits(tmp_path / "m", seed=1.5, vae_steps=1, flow_steps=1, eval_per_class=0, batch_size=2)
    with pytest.raises(TypeError, match="--vae-steps must be an integer; got True"):
        pretrain_digits(tmp_path / "m", vae_steps=True, flow_steps=1, eval_per_class=0, batch_size=2)
    assert not list(tmp_path.iterdir())


def test_a_kill_while_saving_leaves_the_old_model(tmp_path):
    """SIGKILL as soon as the new model's hidden partial folder appears: the old folder is intact."""
    old = _old_model(tmp_path / "model")
    before = _snapshot(old)
    cmd = [sys.executable, "-m", "flowrl", "pretrain-digits", "--out", str(old), "--overwrite", *TINY]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(p.name.startswith(".model.partial-") for p in tmp_path.iterdir()):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        pytest.fail(f"the run ended ({proc.returncode}) before it was killed while saving")
    assert _snapshot(old) == before
