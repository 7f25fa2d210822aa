"""The H100 numbers the kernels' docstrings and ``bench/kernels.py`` compute their roofline from."""

from __future__ import annotations

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM, HBM3
H100_FP32_FLOPS = 67e12  # H100 SXM, fp32 without tensor cores


def roofline_seconds(bytes_moved: float, flops: float) -> float:
    """Lower bound on an H100 SXM: the larger of memory time and fp32 compute time."""
    return max(bytes_moved / H100_HBM_BYTES_PER_S, flops / H100_FP32_FLOPS)
