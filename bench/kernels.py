"""Kernel timings: NVFP4 quantise / dequantise / fake-quantise, the FP8 row quantiser and the fused Flow-SDE step.

Usage::

    python -m bench.kernels [--repeats 5] [--threads N] [--fp8-sweep]

Prints a Markdown table: kernel, shape, dtype, backend, median time, the bytes the kernel
moves (its minimum traffic, the numbers in the kernels' docstrings), the effective bandwidth
(bytes / time), the roofline time for the same bytes and FLOPs and, on a GPU, the effective
bandwidth's share of the memory peak. Roofline and peak are the datasheet figures of the GPU the
bench runs on (``flowrl.kernels.roofline.peaks_for``: an H200's 4.8 TB/s, an H100 SXM's 3.35 TB/s);
on a CPU, or a GPU that table does not hold, the roofline is an H100 SXM's and the share is "-".
On a CPU only the torch reference runs; with CUDA both the reference and the Triton kernel run on
the GPU.

The fused Flow-SDE step has its own table, for one sigma for the batch (Python floats) and for
per-sample (B,) tensors: the synchronised wall time per call (what a sampling loop pays, host work
included) and, on CUDA, the kernel-only GPU time per call (:func:`gpu_seconds`), from which its
"effective" bandwidth is computed (from the wall time on a CPU).

On CUDA two more tables answer why FP8 explore is or is not faster than bf16 (issue 15's >= 1.5x):
the FP8 row quantiser's wall and GPU time per call, and a ledger per SD3.5-M Linear shape: bf16
``F.linear`` against the quantiser, ``torch._scaled_mm`` on quantised inputs and the whole
``ScaledMMLinear`` forward, in GPU time (kernels back to back) and wall time (what an eager
sampling loop pays). ``--fp8-sweep`` also times the quantiser's launch configurations
(:func:`fp8_configs`), each checked bit for bit against the default's output.
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
from flowrl.kernels.roofline import H100_SXM, GpuPeaks, peaks_for, roofline_seconds
from flowrl.runtime import configure_threads

NVFP4_SHAPES = [(128, 512), (3072, 3072), (4096, 3072)]  # digits MLP weight, FLUX hidden weight, 4096 tokens
SDE_SHAPES = [(64, 4, 8, 8), (16, 16, 128, 128), (16, 4096, 64)]  # digits group, SD3 and FLUX (packed) at 1024 px
NVFP4_OPS_PER_ELEMENT = {"quantize": 20, "dequantize": 6, "fake_quantize": 27}
FP8_SHAPES = [(21712, 1536), (21712, 6144)]  # SD3.5-M activations into ScaledMMLinear: hidden 1536, MLP 6144
FP8_OPS_PER_ELEMENT = 25  # abs-bits max, one division, integer E4M3 rounding (flowrl.kernels.fp8)
FP8_LINEARS = [(21712, 1536, 1536), (21712, 1536, 6144), (21712, 6144, 1536)]  # M x K -> N: attention, MLP up, down


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


def device_peaks(device: torch.device) -> GpuPeaks | None:
    """The datasheet peaks of the GPU the bench runs on; None on a CPU or a GPU the table does not hold."""
    return peaks_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def roof_label(peaks: GpuPeaks | None) -> str:
    """The roofline columns' header: the part whose figures they use."""
    return f"{(peaks or H100_SXM).name} roofline | of peak BW"


def roof_cells(nbytes: int, flops: int, seconds: float, peaks: GpuPeaks | None) -> str:
    """The roofline time on ``peaks`` (an H100 SXM's without) and bytes / ``seconds`` as a share of its bandwidth."""
    share = "-" if peaks is None else f"{nbytes / seconds / peaks.hbm_bytes_per_s:.0%}"
    return f"{roofline_seconds(nbytes, flops, peaks or H100_SXM) * 1e6:.1f} us | {share} |"


def row(
    kernel: str,
    shape: tuple,
    dtype: torch.dtype,
    backend: str,
    seconds: float,
    cost: tuple[int, int],
    peaks: GpuPeaks | None,
) -> str:
    """One NVFP4 row; ``cost`` is (bytes moved, FLOPs)."""
    nbytes, flops = cost
    return (
        f"| {kernel} | {'x'.join(map(str, shape))} | {str(dtype).removeprefix('torch.')} | {backend} "
        f"| {ms(seconds)} | {nbytes / 1e6:.1f} MB | {nbytes / seconds / 1e9:.2f} GB/s "
        f"| {roof_cells(nbytes, flops, seconds, peaks)}"
    )


def nvfp4_header(peaks: GpuPeaks | None) -> tuple[str, str]:
    """The NVFP4 table's header and separator, its roofline columns for ``peaks``."""
    return (
        f"| kernel | shape | dtype | backend | time | bytes moved | effective | {roof_label(peaks)} |",
        "|---|---|---|---|---|---|---|---|---|",
    )


def nvfp4_rows(device: torch.device, backends: list[str], repeats: int) -> Iterator[str]:
    """NVFP4 rows (:func:`nvfp4_header`): per shape and dtype, each backend's quantise, dequantise, fake-quantise."""
    peaks = device_peaks(device)
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
                    yield row(f"nvfp4 {op}", shape, dtype, backend, seconds, (nbytes, flops), peaks)


def sde_header(peaks: GpuPeaks | None) -> tuple[str, str]:
    """The fused Flow-SDE step table's header and separator, its roofline columns for ``peaks``."""
    return (
        "| kernel | shape | dtype | sigma | backend | wall / call | GPU / call | bytes moved | effective "
        f"| {roof_label(peaks)} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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


def wall_and_gpu(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float | None]:
    """Median wall seconds per call (:func:`timed`) and, on CUDA, kernel-only GPU seconds (:func:`gpu_seconds`)."""
    wall = timed(fn, device, repeats)
    return wall, gpu_seconds(fn, wall) if device.type == "cuda" else None


def ms(seconds: float | None) -> str:
    """Seconds as 'x.xxx ms'; '-' for a time not measured (GPU time off CUDA)."""
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def sde_row(
    case: tuple, backend: str, times: tuple[float, float | None], cost: tuple[int, int], peaks: GpuPeaks | None
) -> str:
    """One flow_sde row; ``effective`` is bytes / GPU time on CUDA, bytes / wall time on a CPU.

    Args:
        case: (mode, shape, sigma form).
        backend: "torch" or "triton".
        times: (wall, GPU) seconds per call; GPU None off CUDA.
        cost: (bytes moved, FLOPs) per call.
        peaks: the GPU's datasheet peaks (:func:`device_peaks`).
    """
    (mode, shape, form), (wall, gpu), (nbytes, flops) = case, times, cost
    return (
        f"| flow_sde {mode} | {'x'.join(map(str, shape))} | float32 | {form} | {backend} | {ms(wall)} "
        f"| {ms(gpu)} | {nbytes / 1e6:.1f} MB | {nbytes / (gpu or wall) / 1e9:.2f} GB/s "
        f"| {roof_cells(nbytes, flops, gpu or wall, peaks)}"
    )


def sde_coefficients(form: str, batch: int, device: torch.device) -> tuple:
    """sigma, sigma_next, level: Python floats ("scalar", one sigma for the batch) or (B,) tensors."""
    if form == "scalar":
        return 0.7, 0.6, 0.7
    return tuple(torch.full((batch,), value, device=device) for value in (0.7, 0.6, 0.7))


def fp8_header(peaks: GpuPeaks | None) -> tuple[str, str]:
    """The FP8 quantiser table's header and separator, its roofline columns for ``peaks``."""
    return (
        "| kernel | shape | dtype | config | backend | wall / call | GPU / call | bytes moved | effective "
        f"| {roof_label(peaks)} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    )


def fp8_configs(M: int, K: int) -> list[dict[str, int]]:
    """Launch configurations of the FP8 quantiser to sweep for an (M, K) input, the default first.

    Args:
        M: rows (the default caps its rows per program by M).
        K: row length.

    Returns:
        The default (:func:`flowrl.kernels.fp8_triton.launch_config`), then each distinct config with
        BLOCK_K the row's power of two (one chunk) or 1024 (several), 1-8 rows a program holding at
        most 16384 elements, and 4 or 8 warps.
    """
    from flowrl.kernels.fp8_triton import launch_config

    configs = [launch_config(M, K)]
    full = configs[0]["BLOCK_K"]  # the row's power of two, at most MAX_BLOCK_K
    for block_k, rows, warps in itertools.product(sorted({full, min(full, 1024)}), (1, 2, 4, 8), (4, 8)):
        config = {"BLOCK_K": block_k, "ROWS": rows, "CHUNKS": -(-K // block_k), "num_warps": warps}
        if rows * block_k <= 16384 and config not in configs:
            configs.append(config)
    return configs


def config_name(config: dict[str, int]) -> str:
    """'ROWS x BLOCK_K / CHUNKS, W warps', as the sweep's rows print a launch config."""
    return f"{config['ROWS']}x{config['BLOCK_K']}/{config['CHUNKS']}, {config['num_warps']} warps"


def sweep_cases(x: torch.Tensor) -> Iterator[tuple[str, str, Callable[[], object]]]:
    """(backend, config name, call) for every non-default launch config, each checked against the default's bits.

    A config whose codes or scales differ from the default's is named "(DIFFERENT BITS)".
    """
    from flowrl.kernels.fp8 import scale_by_reciprocal
    from flowrl.kernels.fp8_triton import quantize_triton

    reference = fp8_quantize_rows(x, backend="triton")
    for config in fp8_configs(*x.shape)[1:]:
        fn = functools.partial(quantize_triton, x, None, reciprocal=scale_by_reciprocal(x), config=config)
        q, scale = fn()
        same = torch.equal(q.view(torch.uint8), reference[0].view(torch.uint8)) and torch.equal(scale, reference[1])
        yield "triton", config_name(config) + ("" if same else " (DIFFERENT BITS)"), fn


def fp8_rows(device: torch.device, backends: list[str], repeats: int, sweep: bool = False) -> Iterator[str]:
    """FP8 quantiser rows (:func:`fp8_header`): each backend and, with ``sweep``, every launch config.

    The sweep runs where the Triton kernel does: compiled on CUDA, or in the interpreter (a test).
    """
    from flowrl.kernels import interpreting, triton_installed

    peaks = device_peaks(device)
    for shape in FP8_SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(device)
        nbytes = fp8_bytes(*shape, x.element_size())
        flops = FP8_OPS_PER_ELEMENT * x.numel()
        cases = [(backend, "default", functools.partial(fp8_quantize_rows, x, backend=backend)) for backend in backends]
        if sweep and triton_installed() and (device.type == "cuda" or interpreting()):
            cases.extend(sweep_cases(x))
        for backend, name, fn in cases:
            wall, gpu = wall_and_gpu(fn, device, repeats)
            yield (
                f"| fp8 quantize_rows | {'x'.join(map(str, shape))} | bfloat16 | {name} | {backend} "
                f"| {ms(wall)} | {ms(gpu)} | {nbytes / 1e6:.1f} MB "
                f"| {nbytes / (gpu or wall) / 1e9:.2f} GB/s | {roof_cells(nbytes, flops, gpu or wall, peaks)}"
            )


NO_GEMM = {"quantise (row)", "quantise (row), via the operator"}  # ledger parts without a matrix product: no TFLOP/s
LEDGER_HEADER = (
    "| Linear M x K -> N | part | wall / call | GPU / call | time x bf16 (GPU on CUDA) | TFLOP/s |",
    "|---|---|---|---|---|---|",
)


def fp8_linear_rows(device: torch.device, repeats: int) -> Iterator[str]:
    """Per SD3.5-M Linear shape: bf16 F.linear, quantiser, _scaled_mm (default, fast accumulation), ScaledMMLinear.

    On CUDA the ratio and TFLOP/s use the GPU time; elsewhere (a test on the CPU's ``_scaled_mm``) the wall time.
    """
    from flowrl.kernels.fp8 import fp8_quantize_op, fp8_quantize_rows
    from flowrl.policy.fp8 import ScaledMMLinear

    g = torch.Generator().manual_seed(0)
    for M, K, N in FP8_LINEARS:
        linear = torch.nn.Linear(K, N).to(torch.bfloat16).to(device).requires_grad_(False)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
        fp8 = {scaling: ScaledMMLinear(linear, scaling) for scaling in ("row", "tensor")}
        q, scale = fp8_quantize_op(x, "row")
        by_row = fp8["row"]

        def scaled_mm(fast: bool) -> torch.Tensor:
            return torch._scaled_mm(
                q,
                by_row.weight.t(),
                scale_a=scale,
                scale_b=by_row.weight_scale,
                bias=by_row.bias,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            )

        parts = {
            "bf16 F.linear": lambda: torch.nn.functional.linear(x, linear.weight, linear.bias),
            "quantise (row)": lambda: fp8_quantize_rows(x),  # as ScaledMMLinear calls it in eager code
            "quantise (row), via the operator": lambda: fp8_quantize_op(x, "row"),  # as traced code does
            "_scaled_mm (row, quantised input)": functools.partial(scaled_mm, fast=False),
            "_scaled_mm (row, quantised input), fast accumulation": functools.partial(scaled_mm, fast=True),
            "ScaledMMLinear row": lambda: fp8["row"](x),
            "ScaledMMLinear tensor": lambda: fp8["tensor"](x),
        }
        base = None
        for part, fn in parts.items():
            wall, gpu = wall_and_gpu(fn, device, repeats)
            seconds = gpu or wall
            base = base or seconds
            tflops = "-" if part in NO_GEMM else f"{2 * M * K * N / seconds / 1e12:.1f}"
            yield f"| {M}x{K} -> {N} | {part} | {ms(wall)} | {ms(gpu)} | {seconds / base:.2f} | {tflops} |"


def sde_rows(device: torch.device, backends: list[str], repeats: int) -> Iterator[str]:
    """flow_sde rows (:func:`sde_header`): per shape, scalar and (B,) sigmas, each backend, sampling and scoring."""
    peaks = device_peaks(device)
    for shape in SDE_SHAPES:
        g = torch.Generator().manual_seed(0)
        x, v, z = (torch.randn(shape, generator=g).to(device) for _ in range(3))
        for form, backend in itertools.product(("scalar", "(B,)"), backends):
            step = sde_coefficients(form, shape[0], device)
            stored = fused_flow_sde_step(x, v, *step, noise=z, backend=backend).sample
            for mode, kwargs in (("sample", {"noise": z}), ("score", {"prev_sample": stored})):
                fn = functools.partial(fused_flow_sde_step, x, v, *step, backend=backend, **kwargs)
                times = wall_and_gpu(fn, device, repeats)
                cost = flow_sde_bytes(x.numel(), 4, score=mode == "score"), FLOPS_PER_ELEMENT[mode] * x.numel()
                yield sde_row((mode, shape, form), backend, times, cost, peaks)


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
    parser.add_argument("--fp8-sweep", action="store_true", help="CUDA: time the FP8 quantiser's launch configs")
    args = parser.parse_args()
    configure_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    peaks = device_peaks(device)
    print(f"Machine: {machine()}\n")
    print("\n".join(nvfp4_header(peaks)))
    for line in nvfp4_rows(device, backends, args.repeats):
        print(line, flush=True)  # each row as it is measured: a run cut short keeps its rows
    tables = [(sde_header(peaks), sde_rows(device, backends, args.repeats))]
    if device.type == "cuda":  # before the sweep, whose Triton compiles take the longest
        tables.append((LEDGER_HEADER, fp8_linear_rows(device, args.repeats)))
    tables.append((fp8_header(peaks), fp8_rows(device, backends, args.repeats, sweep=args.fp8_sweep)))
    for header, lines in tables:
        print("\n" + "\n".join(header), flush=True)
        for line in lines:
            print(line, flush=True)


if __name__ == "__main__":
    main()
