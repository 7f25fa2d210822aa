"""bench/attention_ratio.py: the first-update ratio with the rollout on each attention kernel, on the CPU."""

from __future__ import annotations

import pytest
import torch

from bench import attention_ratio

SMALL = ["prompts.per_iteration=2", "prompts.group_size=4", "sampler.chunk_size=4"]


def test_the_trainers_kernels_keep_the_ratio_one_and_a_switched_kernel_moves_it(capsys, keep_threads):
    attention_ratio.main(["--set", *SMALL])
    rows = {
        cells[0]: cells[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| rollout")
        for cells in [[c.strip() for c in line.split("|")[1:-1]]]
    }
    assert list(rows) == ["trainer", "flash", "math"]  # the CPU's kernels
    assert rows["trainer"] == rows["flash"] == ["1.00000000", "0.0e+00"]  # flash is what training runs here
    assert float(rows["math"][0]) != 1.0  # bf16: another kernel, other last bits, another ratio


def test_cuda_rows_without_cuda_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device; the default runs on the CPU"):
        attention_ratio.main(["--device", "cuda"])
