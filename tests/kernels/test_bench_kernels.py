"""``bench.kernels``: the FP8 quantiser's launch configurations (bit-identical codes under each) and the CPU tables."""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, cpu_scaled_mm_supports

from bench import kernels as bench
from flowrl.kernels.fp8 import fp8_quantize_rows


@pytest.mark.parametrize("K", [17, 1536, 6144, 8195])
def test_the_sweep_starts_at_the_default_and_every_config_covers_the_row(K):
    from flowrl.kernels.fp8_triton import launch_config

    configs = bench.fp8_configs(21712, K)
    assert configs[0] == launch_config(21712, K)
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs) > 4
    for config in configs:
        assert config["CHUNKS"] * config["BLOCK_K"] >= K > (config["CHUNKS"] - 1) * config["BLOCK_K"]
        assert config["BLOCK_K"] & (config["BLOCK_K"] - 1) == 0 and config["num_warps"] in (4, 8, 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [17, 1536])
def test_every_swept_launch_config_gives_the_same_codes_and_scales(device, K):
    from flowrl.kernels.fp8 import scale_by_reciprocal
    from flowrl.kernels.fp8_triton import quantize_triton

    x = (torch.randn(9, K, generator=torch.Generator().manual_seed(K)) * 3).to(torch.bfloat16).to(device)
    reference = fp8_quantize_rows(x, backend="triton")
    for config in bench.fp8_configs(*x.shape):
        q, scale = quantize_triton(x, None, reciprocal=scale_by_reciprocal(x), config=config)
        assert torch.equal(q.view(torch.uint8), reference[0].view(torch.uint8)), bench.config_name(config)
        assert torch.equal(scale, reference[1]), bench.config_name(config)
    names = [name for _, name, _ in bench.sweep_cases(x)]  # the bench's own check agrees
    assert len(names) == len(bench.fp8_configs(*x.shape)) - 1 and not any("DIFFERENT" in n for n in names)


@pytest.mark.parametrize("device", DEVICES)
def test_a_launch_config_that_does_not_cover_the_row_is_refused(device):
    from flowrl.kernels.fp8_triton import quantize_triton

    x = torch.ones(4, 100, device=device)
    for bad in ({"BLOCK_K": 64, "CHUNKS": 1}, {"BLOCK_K": 96, "CHUNKS": 2}, {"BLOCK_K": 32, "CHUNKS": 5}):
        config = {"ROWS": 1, "num_warps": 4, **bad}
        with pytest.raises(ValueError, match="does not split rows of K=100 into CHUNKS"):
            quantize_triton(x, None, reciprocal=False, config=config)


def test_the_cpu_tables_print_one_row_per_case(monkeypatch):
    from flowrl.kernels import interpreting, triton_installed

    monkeypatch.setattr(bench, "FP8_SHAPES", [(8, 32)])
    monkeypatch.setattr(bench, "SDE_SHAPES", [(2, 4, 8, 8), (2, 64, 16)])
    cpu = torch.device("cpu")
    fp8 = list(bench.fp8_rows(cpu, ["torch"], 1))
    assert len(fp8) == 1 and "| 8x32 | bfloat16 | default | torch |" in fp8[0] and "| - |" in fp8[0]
    if triton_installed() and interpreting():  # the sweep runs where the kernel does: here, the interpreter
        swept = list(bench.fp8_rows(cpu, ["torch"], 1, sweep=True))
        assert len(swept) == len(bench.fp8_configs(8, 32)) and not any("DIFFERENT" in line for line in swept)
    sde = list(bench.sde_rows(cpu, ["torch"], 1))
    assert len(sde) == 2 * 2 * 2  # shapes x sigma forms x (sample, score)
    assert all(line.count("|") == bench.fp8_header(None)[1].count("|") for line in fp8)
    assert all(line.count("|") == bench.sde_header(None)[1].count("|") for line in sde)
    assert all(line.endswith(" us | - |") for line in fp8 + sde)  # a CPU has no share of a GPU's peak
    nvfp4 = list(bench.nvfp4_rows(cpu, ["torch"], 1))[:3]
    assert all(line.count("|") == bench.nvfp4_header(None)[1].count("|") for line in nvfp4)
    for header in (bench.nvfp4_header(None), bench.sde_header(None), bench.fp8_header(None)):
        assert header[0].count("|") == header[1].count("|") and "H100 SXM roofline" in header[0]


def test_the_roofline_columns_use_the_peaks_of_the_gpu_the_bench_runs_on():
    from flowrl.kernels.roofline import H200

    # 4.8 GB in 1 ms is an H200's whole datasheet bandwidth; the same bytes are 143 % of an H100 SXM's.
    assert bench.roof_cells(4_800_000_000, 0, 1e-3, H200) == "1000.0 us | 100% |"
    assert bench.roof_cells(4_800_000_000, 0, 1e-3, None) == "1432.8 us | - |"
    assert "H200 roofline | of peak BW" in bench.sde_header(H200)[0]


def test_the_fp8_linear_ledger_runs_each_part_on_the_cpus_scaled_mm(monkeypatch):
    """The ledger's seven parts per shape, on the CPU's ``_scaled_mm`` (the bench runs it on CUDA only)."""
    if not cpu_scaled_mm_supports("row"):
        pytest.skip("this torch's CPU _scaled_mm has no row scaling (2.11: per-tensor only)")
    monkeypatch.setattr(bench, "FP8_LINEARS", [(37, 32, 48)])
    lines = list(bench.fp8_linear_rows(torch.device("cpu"), 1))
    parts = [line.split(" | ")[1] for line in lines]
    assert parts == [
        "bf16 F.linear",
        "quantise (row)",
        "quantise (row), via the operator",
        "_scaled_mm (row, quantised input)",
        "_scaled_mm (row, quantised input), fast accumulation",
        "ScaledMMLinear row",
        "ScaledMMLinear tensor",
    ]
    tflops = [line.split(" | ")[-1].rstrip(" |") for line in lines]
    assert lines[0].split(" | ")[-2] == "1.00"  # the bf16 row is the ratio's base
    assert [t == "-" for t in tflops] == [False, True, True, False, False, False, False]  # the quantiser: no GEMM
    assert all(line.count("|") == bench.LEDGER_HEADER[1].count("|") for line in lines)
