"""bench/attention_backends.py: every SDPA backend pinned in turn around the embedded denoiser's passes, on the CPU.

The full-size rows need CUDA (docs/gpu-session.md); here the same measuring code runs on the shipped
model, where torch has a flash and a math kernel and no memory-efficient or cuDNN one.
"""

from __future__ import annotations

import pytest
import torch

from bench import attention_backends


def _rows(out: str) -> dict[str, list[str]]:
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| flowrl-digits")]
    return {r[2].strip(): [c.strip() for c in r] for r in rows}


def test_cpu_table_times_the_kernels_that_exist_and_names_the_ones_that_do_not(capsys, keep_threads):
    attention_backends.main(["--cpu", "--batch", "3", "--repeats", "2"])
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == ["auto", "flash", "efficient", "cudnn", "math"]
    for label in ("auto", "flash", "math"):
        rollout_ms, train_ms = float(rows[label][3]), float(rows[label][5])
        assert rollout_ms > 0 and train_ms > 0
        assert float(rows[label][7]) < 1e-4  # the same attention up to fp32 rounding
    assert rows["auto"][4] == rows["auto"][6] == "1.00"
    assert rows["math"][7] == "0.0e+00"  # the reference itself
    for label in ("efficient", "cudnn"):
        assert rows[label][3] == rows[label][5] == "no such kernel here"


def test_training_pass_leaves_no_gradient_behind():
    case = attention_backends.cpu_cases([2])[0]
    out = attention_backends.run_pass(case, attention_backends.BACKENDS["math"], train=True)
    assert out.shape[0] == 2 and not out.requires_grad
    assert all(p.grad is None for p in case.module.parameters())


def test_full_size_run_without_cuda_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA for the full-size models; --cpu runs the embedded one"):
        attention_backends.main([])


def test_a_subset_of_backends_is_read_against_the_first_one_listed(capsys, keep_threads):
    attention_backends.main(["--cpu", "--batch", "2", "--repeats", "1", "--backends", "flash", "math", "xformers"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["flash", "math"]  # no xformers row off CUDA
    assert "| rollout ms | / flash | train ms | / flash |" in out
    assert rows["flash"][4] == rows["flash"][6] == "1.00" and float(rows["math"][4]) > 0
    assert float(rows["flash"][7]) < 1e-4  # still compared with the math kernel's rollout
