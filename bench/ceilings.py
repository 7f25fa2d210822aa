"""The device's own ceilings: copy bandwidth and matrix rates, measured in the same call as the benches they bound.

Datasheet rates are leads (``/work/.library/device/METHOD.md``): an H200 of this workplace copied at about
4.3 TB/s against the datasheet's 4.8 and ran an 8192^3 bf16 product at 769-798 TFLOP/s against 989
(``KINDS.md``, 2026-11-04). ``bench/kernels.py`` and ``bench/gpu_measure.py`` report shares of the
datasheet peak (``flowrl.kernels.roofline``); this table says what share of it the card reaches at all.

Measured, each the median of ``--repeats`` timed calls after three warm-ups, with CUDA events (host
clocks on a CPU), on random data (never zeros, which some units run faster):

- ``copy``: one tensor copied into another, counting bytes read plus bytes written (2 x its size);
- ``bf16 matmul``: an N x N by N x N bf16 product, 2 N^3 FLOPs;
- ``fp8 _scaled_mm``: the same product in FP8 E4M3 with per-row / per-column fp32 scales, as
  ``flowrl.policy.fp8.ScaledMMLinear`` runs it (CUDA with compute capability >= 8.9 only), then again with
  ``use_fast_accum=True`` (``ScaledMMLinear(fast_accum=True)``).

Usage::

    python -m bench.ceilings [--copy-gib 2] [--matmul 8192] [--repeats 10] [--json PATH]
    python -m bench.ceilings --cpu   # the same table on the CPU (fp32 product), small sizes: a plumbing check
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from flowrl.kernels.roofline import GpuPeaks, peaks_for
from flowrl.policy.fp8 import check_scaled_mm

WARMUPS = 3


@dataclass(frozen=True)
class Ceiling:
    """One measured ceiling: ``rate`` in bytes/s (copy) or FLOP/s (products), against the datasheet's."""

    name: str
    size: str
    seconds: float
    rate: float
    unit: str
    datasheet: float | None


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` timed calls after :data:`WARMUPS` untimed ones."""
    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_ceiling(device: torch.device, gib: float, repeats: int, peaks: GpuPeaks | None) -> Ceiling:
    """Device-to-device copy of a ``gib`` GiB fp32 tensor: bytes read plus written over the median time."""
    numel = int(gib * 2**30) // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats)
    moved = 2 * numel * 4
    datasheet = peaks.hbm_bytes_per_s if peaks else None
    return Ceiling("copy", f"{gib:g} GiB fp32", seconds, moved / seconds, "GB/s", datasheet)


def matmul_ceiling(device: torch.device, n: int, repeats: int, peaks: GpuPeaks | None) -> Ceiling:
    """An n x n x n product of random matrices: bf16 on CUDA, fp32 on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
    name = f"{str(dtype).removeprefix('torch.')} matmul"
    datasheet = peaks.bf16_flops if peaks and device.type == "cuda" else None
    return Ceiling(name, f"{n}^3", seconds, 2 * n**3 / seconds, "TFLOP/s", datasheet)


def fp8_ceiling(
    device: torch.device, n: int, repeats: int, peaks: GpuPeaks | None, fast_accum: bool = False
) -> Ceiling:
    """An n x n x n FP8 E4M3 product with per-row (A) and per-column (B) fp32 scales, bf16 out.

    ``fast_accum``: ``use_fast_accum`` (the tensor cores' own accumulator, no periodic fp32 promotion).
    """
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, generator=g, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    scale_a = torch.rand(n, 1, generator=g, device=device) + 0.5
    scale_b = torch.rand(1, n, generator=g, device=device) + 0.5

    def product() -> torch.Tensor:
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )

    seconds = median_seconds(product, device, repeats)
    name = "fp8 _scaled_mm (row, fast accumulation)" if fast_accum else "fp8 _scaled_mm (row)"
    return Ceiling(name, f"{n}^3", seconds, 2 * n**3 / seconds, "TFLOP/s", peaks and peaks.fp8_flops)


def fp8_refusal(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` cannot run on ``device`` (:func:`flowrl.policy.fp8.check_scaled_mm`); None if it can."""
    try:
        check_scaled_mm(device, activations=False)
    except ValueError as err:
        return str(err)
    return None


def row(c: Ceiling) -> str:
    scale = 1e9 if c.unit == "GB/s" else 1e12
    share = "-" if c.datasheet is None else f"{c.rate / c.datasheet:.0%}"
    sheet = "-" if c.datasheet is None else f"{c.datasheet / scale:,.0f}"
    return f"| {c.name} | {c.size} | {c.seconds * 1e3:.3f} ms | {c.rate / scale:,.1f} {c.unit} | {sheet} | {share} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copied tensor (GiB)")
    parser.add_argument("--matmul", type=int, default=8192, help="N of the N x N x N products")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="measure the CPU (64 MiB copy, 512^3 fp32 product)")
    parser.add_argument("--json", type=Path, default=None, help="also write the ceilings here")
    args = parser.parse_args(argv)
    if args.cpu:
        device, gib, n = torch.device("cpu"), min(args.copy_gib, 1 / 16), min(args.matmul, 512)
    elif torch.cuda.is_available():
        device, gib, n = torch.device("cuda"), args.copy_gib, args.matmul
    else:
        raise SystemExit("bench.ceilings measures a CUDA GPU; pass --cpu to run its table on this CPU")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peaks = peaks_for(name) if device.type == "cuda" else None
    sheet = peaks.name if peaks else "none"
    print(f"# {name}, torch {torch.__version__}, datasheet: {sheet}, median of {args.repeats}")
    print("| ceiling | size | median time | measured | datasheet | measured / datasheet |")
    print("|---|---|---:|---:|---:|---:|")
    ceilings = []
    refusal = fp8_refusal(device)
    fp8_fast = functools.partial(fp8_ceiling, fast_accum=True)
    measures = [copy_ceiling, matmul_ceiling] + ([fp8_ceiling, fp8_fast] if refusal is None else [])
    for measure, size in zip(measures, (gib, n, n, n)):
        ceilings.append(measure(device, size, args.repeats, peaks))
        print(row(ceilings[-1]), flush=True)
    if refusal is not None:
        print(f"| fp8 _scaled_mm (row) | not run: {refusal} | | | | |")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "ceilings": [asdict(c) for c in ceilings]}, indent=1))


if __name__ == "__main__":
    main()
