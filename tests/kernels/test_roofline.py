"""``flowrl.kernels.roofline``: the datasheet peaks, found from the name torch gives the GPU."""

from __future__ import annotations

import pytest

from flowrl.kernels.roofline import B200, H100_PCIE, H100_SXM, H200, peaks_for, roofline_seconds


@pytest.mark.parametrize(
    ("name", "peaks"),
    [
        ("NVIDIA H100 80GB HBM3", H100_SXM),  # the H100 of rounds 1 and 2 (docs/gpu-runs)
        ("NVIDIA H100 PCIe", H100_PCIE),
        ("NVIDIA H200", H200),  # the name KINDS.md records for the nvidia-h200 kind
        ("NVIDIA B200", B200),
        ("NVIDIA A100-SXM4-80GB", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_a_gpu_is_known_by_the_name_torch_gives_it(name, peaks):
    assert peaks_for(name) is peaks


def test_an_h200_has_an_h100s_arithmetic_and_more_bandwidth():
    assert (H200.bf16_flops, H200.fp8_flops, H200.fp32_flops) == (
        H100_SXM.bf16_flops,
        H100_SXM.fp8_flops,
        H100_SXM.fp32_flops,
    )
    assert H200.hbm_bytes_per_s / H100_SXM.hbm_bytes_per_s == pytest.approx(1.433, abs=1e-3)
    assert B200.fp4_flops == 2 * B200.fp8_flops and H100_SXM.fp4_flops is None  # FP4 tensor cores: Blackwell only


def test_the_roofline_is_the_larger_of_memory_and_arithmetic_time():
    # The fused Flow-SDE step at SD3 1024 px (kernels/flow_sde.py): 83.9 MB and 58.7 MFLOP -> 25 us on an H100 SXM.
    assert roofline_seconds(83.9e6, 58.7e6) == pytest.approx(25.04e-6, rel=1e-3)
    assert roofline_seconds(83.9e6, 58.7e6, H200) == pytest.approx(83.9e6 / 4.8e12)
    assert roofline_seconds(0, 67e12) == pytest.approx(1.0)  # arithmetic-bound: fp32 rate
