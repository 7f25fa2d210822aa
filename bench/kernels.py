"""Kernel timings: NVFP4 quantise / dequantise / fake-quantise, the FP8 row quantiser and the fused Flow-SDE step.

Usage::

    python -m bench.kernels [--repeats 5] [--threads N]

Prints a Markdown table: kernel, shape, dtype, backend, median time, the bytes the kernel
moves (its minimum traffic, the numbers in the kernels' docstrings), the effective bandwidth
(bytes / time) and the H100 SXM roofline time for the same bytes and FLOPs. On a CPU only the
torch reference runs; with CUDA both the reference and the Triton kernel run on the GPU.

The fused Flow-SDE step has its own table, for one sigma for the batch (Python floats) and for
per-sample (B,) tensors: the synchronised wall time per call (what a sampling loop pays, host work
included) and, on CUDA, the kernel-only GPU time per call (:func:`gpu_seconds`), from which its
"effective" bandwidth is computed (from the wall time on a CPU).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import platform
import statistics
import time
from typing import Callable, Iterator

import torch

from flowrl.kernels import fused_flow_sde_step, nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_quantize
from flowrl.kernels.flow_sde import FLOPS_PER_ELEMENT, flow_sde_bytes
from flowrl.kernels.fp8 import fp8_bytes, fp8_quantize_rows
from flowrl.kernels.nvfp4 import nvfp4_bytes
from flowrl.kernels.roofline import roofline_seconds
from flowrl.runtime import configure_threads

NVFP4_SHAPES = [(128, 512), (3072, 3072), (4096, 3072)]  # digits MLP weight, FLUX hidden weight, 4096 tokens
SDE_SHAPES = [(64, 4, 8, 8), (16, 16, 128, 128)]  # digits group, SD3 at 1024 px
NVFP4_OPS_PER_ELEMENT = {"quantize": 20, "dequantize": 6, "fake_quantize": 27}
FP8_SHAPES = [(21712, 1536), (21712, 6144)]  # SD3.5-M activations into ScaledMMLinear: hidden 1536, MLP 6144
FP8_OPS_PER_ELEMENT = 25  # abs-bits max, one division, integer E4M3 rounding (flowrl.kernels.fp8)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(kernel: str, shape: tuple, dtype: torch.dtype, backend: str, seconds: float, nbytes: int, flops: int) -> str:
    return (
        f"| {kernel} | {'x'.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | {backend} "
        f"| {seconds * 1e3:.3f} ms | {nbytes / 1e6:.1f} MB | {nbytes / seconds / 1e9:.2f} GB/s "
        f"| {roofline_seconds(nbytes, flops) * 1e6:.1f} us |"
    )


def nvfp4_rows(device: torch.device, backends: list[str], repeats: int) -> Iterator[str]:
    for shape in NVFP4_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
            numel = x.numel()
            for backend in backends:
                packed = nvfp4_quantize(x, backend=backend)
                calls = {
                    "quantize": lambda: nvfp4_quantize(x, backend=backend),
                    "dequantize": lambda: nvfp4_dequantize(packed, backend=backend),
                    "fake_quantize": lambda: nvfp4_fake_quantize(x, backend=backend),
                }
                for op, fn in calls.items():
                    seconds = timed(fn, device, repeats)
                    nbytes = nvfp4_bytes(numel, x.element_size(), op)
                    flops = NVFP4_OPS_PER_ELEMENT[op] * numel
                    yield row(f"nvfp4 {op}", shape, dtype, backend, seconds, nbytes, flops)


SDE_HEADER = (
    "| kernel | shape | dtype | sigma | backend | wall / call | GPU / call | bytes moved | effective | H100 roofline |",
    "|---|---|---|---|---|---|---|---|---|---|",
)


def gpu_seconds(fn: Callable[[], object], wall: float, calls: int = 20) -> float:
    """Kernel-only GPU seconds per call on CUDA: CUDA events around ``calls`` calls queued behind a spin.

    ``torch.cuda._sleep`` keeps the GPU busy (about 4 x the calls' wall time at <= 2 GHz) while the
    host queues the calls, so the events time their kernels back to back, without the host's launch
    gaps (an upper bound should the spin end first). Inputs that fit in L2 stay there between calls.
    """
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(min(int(4 * calls * wall * 2e9), 2**31 - 1))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def sde_row(case: tuple, backend: str, wall: float, gpu: float | None, nbytes: int, flops: int) -> str:
    """One flow_sde row; ``effective`` is bytes / GPU time on CUDA, bytes / wall time on a CPU."""
    mode, shape, form = case
    gpu_text = "-" if gpu is None else f"{gpu * 1e3:.3f} ms"
    return (
        f"| flow_sde {mode} | {'x'.join(map(str, shape))} | float32 | {form} | {backend} | {wall * 1e3:.3f} ms "
        f"| {gpu_text} | {nbytes / 1e6:.1f} MB | {nbytes / (gpu or wall) / 1e9:.2f} GB/s "
        f"| {roofline_seconds(nbytes, flops) * 1e6:.1f} us |"
    )


def sde_coefficients(form: str, batch: int, device: torch.device) -> tuple:
    """sigma, sigma_next, level: Python floats ("scalar", one sigma for the batch) or (B,) tensors."""
    if form == "scalar":
        return 0.7, 0.6, 0.7
    return tuple(torch.full((batch,), value, device=device) for value in (0.7, 0.6, 0.7))


def fp8_rows(device: torch.device, backends: list[str], repeats: int) -> Iterator[str]:
    for shape in FP8_SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
        nbytes = fp8_bytes(*shape, x.element_size())
        for backend in backends:
            seconds = timed(lambda: fp8_quantize_rows(x, backend=backend), device, repeats)
            yield row("fp8 quantize_rows", shape, x.dtype, backend, seconds, nbytes, FP8_OPS_PER_ELEMENT * x.numel())


def sde_rows(device: torch.device, backends: list[str], repeats: int) -> Iterator[str]:
    """flow_sde rows (:data:`SDE_HEADER`): per shape, scalar and (B,) sigmas, each backend, sampling and scoring."""
    for shape in SDE_SHAPES:
        g = torch.Generator().manual_seed(0)
        x, v, z = (torch.randn(shape, generator=g).to(device) for _ in range(3))
        for form, backend in itertools.product(("scalar", "(B,)"), backends):
            step = sde_coefficients(form, shape[0], device)
            stored = fused_flow_sde_step(x, v, *step, noise=z, backend=backend).sample
            for mode, kwargs in (("sample", {"noise": z}), ("score", {"prev_sample": stored})):
                fn = functools.partial(fused_flow_sde_step, x, v, *step, backend=backend, **kwargs)
                wall = timed(fn, device, repeats)
                gpu = gpu_seconds(fn, wall) if device.type == "cuda" else None
                nbytes = flow_sde_bytes(x.numel(), 4, score=mode == "score")
                flops = FLOPS_PER_ELEMENT[mode] * x.numel()
                yield sde_row((mode, shape, form), backend, wall, gpu, nbytes, flops)


def machine() -> str:
    if torch.cuda.is_available():
        where = torch.cuda.get_device_name()
    else:
        where = (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
        )
    return f"{datetime.date.today()}, torch {torch.__version__}, {where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    configure_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    print(f"Machine: {machine()}\n")
    print("| kernel | shape | dtype | backend | time | bytes moved | effective | H100 roofline |")
    print("|---|---|---|---|---|---|---|---|")
    for line in itertools.chain(nvfp4_rows(device, backends, args.repeats), fp8_rows(device, backends, args.repeats)):
        print(line, flush=True)  # each row as it is measured: a run cut short keeps its rows
    print("\n" + "\n".join(SDE_HEADER), flush=True)
    for line in sde_rows(device, backends, args.repeats):
        print(line, flush=True)


if __name__ == "__main__":
    main()
