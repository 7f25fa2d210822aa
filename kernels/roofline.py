"""Datasheet peaks of the GPUs flowrl is measured on, and the roofline time the kernels' costs give on them.

The kernels' docstrings state their roofline on an H100 SXM (:data:`H100_SXM`, the issue's reference
machine). ``bench/kernels.py`` and ``bench/gpu_measure.py`` use the peaks of the GPU they actually run
on (:func:`peaks_for`, from ``torch.cuda.get_device_name()``): an H200 has an H100's arithmetic but
1.43x its memory bandwidth, so a memory-bound kernel's share of peak read against the H100's figure
would be 1.43x too high. Datasheet rates are leads: ``bench/ceilings.py`` measures the device's own
copy bandwidth and matrix rates in the same call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuPeaks:
    """One GPU's dense datasheet peaks (sparse tensor-core figures are 2x these).

    Attributes:
        name: the part, as tables print it.
        hbm_bytes_per_s: device-memory bandwidth, bytes/s.
        fp32_flops: fp32 FLOP/s without tensor cores (the elementwise kernels' ceiling).
        bf16_flops: dense bf16 tensor-core FLOP/s (the MFU denominator).
        fp8_flops: dense FP8 tensor-core FLOP/s.
        fp4_flops: dense FP4 (NVFP4) tensor-core FLOP/s; None for a part without FP4 tensor cores.
    """

    name: str
    hbm_bytes_per_s: float
    fp32_flops: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float | None = None


# NVIDIA datasheets: H100 SXM5 80 GB (HBM3), H100 PCIe 80 GB (HBM2e), H200 SXM 141 GB (HBM3e; the H100's SM
# array and clocks), B200 (HGX, HBM3e).
H100_SXM = GpuPeaks("H100 SXM", 3.35e12, 67e12, 989e12, 1979e12)
H100_PCIE = GpuPeaks("H100 PCIe", 2.0e12, 51e12, 756e12, 1513e12)
H200 = GpuPeaks("H200", 4.8e12, 67e12, 989e12, 1979e12)
B200 = GpuPeaks("B200", 8.0e12, 75e12, 2250e12, 4500e12, 9000e12)


def peaks_for(device_name: str) -> GpuPeaks | None:
    """The datasheet peaks of a GPU named as ``torch.cuda.get_device_name()`` names it.

    Args:
        device_name: e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA B200".

    Returns:
        Its :class:`GpuPeaks`, or None for a GPU this table does not hold (tables then print "-" for a share of
        peak rather than a share of some other part's peak).
    """
    name = device_name.upper()
    if "H200" in name:
        return H200
    if "B200" in name:
        return B200
    if "H100" in name:
        return H100_PCIE if "PCIE" in name else H100_SXM
    return None


def roofline_seconds(bytes_moved: float, flops: float, peaks: GpuPeaks = H100_SXM) -> float:
    """Lower bound on ``peaks``' GPU (an H100 SXM by default): the larger of memory time and fp32 compute time."""
    return max(bytes_moved / peaks.hbm_bytes_per_s, flops / peaks.fp32_flops)
