"""``bench.ceilings``: the device's own copy bandwidth and matrix rates, run here on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_devices import cpu_scaled_mm_supports

from bench import ceilings
from flowrl.kernels.roofline import H200


def test_the_cpu_table_measures_a_copy_and_a_product_and_writes_them(tmp_path, capsys):
    out = tmp_path / "ceilings.json"
    ceilings.main(["--cpu", "--repeats", "2", "--json", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| copy", "| float32 matmul", "| fp8 _scaled_mm (row)"]
    assert "not run: fp8_e4m3 with emulate=False needs CUDA" in lines[-1]
    saved = json.loads(out.read_text())
    copy, product = saved["ceilings"]
    assert saved["device"] == "cpu" and copy["datasheet"] is None  # no datasheet share for a CPU
    numel = 2**30 // 16 // 4  # --cpu copies 1/16 GiB of fp32
    assert copy["rate"] == pytest.approx(2 * 4 * numel / copy["seconds"])  # bytes read + written
    assert product["rate"] == pytest.approx(2 * 512**3 / product["seconds"]) and product["rate"] > 1e9


def test_the_fp8_product_runs_as_scaled_mm_linear_runs_it():
    if not cpu_scaled_mm_supports("row"):
        pytest.skip("this torch's CPU _scaled_mm has no row scaling (2.11: per-tensor only)")
    got = ceilings.fp8_ceiling(torch.device("cpu"), 64, 1, H200)
    assert got.rate == pytest.approx(2 * 64**3 / got.seconds) and got.datasheet == H200.fp8_flops
    fast = ceilings.fp8_ceiling(torch.device("cpu"), 64, 1, H200, fast_accum=True)
    assert fast.name == "fp8 _scaled_mm (row, fast accumulation)" and got.name == "fp8 _scaled_mm (row)"
    assert "needs CUDA" in ceilings.fp8_refusal(torch.device("cpu"))  # the bench runs it on CUDA >= 8.9 only


def test_a_row_gives_the_share_of_the_datasheet_figure():
    copy = ceilings.Ceiling("copy", "2 GiB fp32", 1e-3, 4.3e12, "GB/s", H200.hbm_bytes_per_s)
    assert ceilings.row(copy) == "| copy | 2 GiB fp32 | 1.000 ms | 4,300.0 GB/s | 4,800 | 90% |"
    unknown = ceilings.Ceiling("bf16 matmul", "8192^3", 1.4e-3, 7.85e14, "TFLOP/s", None)
    assert ceilings.row(unknown).endswith("| 785.0 TFLOP/s | - | - |")
