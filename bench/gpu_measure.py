"""Measured on a GPU: seconds and peak memory of the big denoisers' rollout and training passes.

``bench/gpu_plan.py`` counts FLOPs and estimates seconds from an assumed throughput; this script
checks those estimates on a real GPU. Each transformer is built from its published config (the
builders in ``bench/gpu_plan.py``) with random weights directly on the GPU in bf16 (nothing is
downloaded: speed and memory do not depend on the weight values), gets the LoRA of its shipped
config through ``flowrl.policy.lora.add_lora``, and runs the training geometry of docs/gpu-plan.md:

- ``rollout``: one no-grad forward of a batch (a sampling step);
- ``train``: forward + backward of a batch into the LoRA (a Flow-GRPO / NFT / AWM micro-batch),
  with and without per-block gradient checkpointing.

FLOPs are counted with ``FlopCounterMode`` on the same call, so the table gives the achieved
TFLOP/s to compare with the 400 TFLOP/s that docs/gpu-plan.md assumes, and the MFU: achieved over
the dense bf16 datasheet peak of the GPU it runs on (``flowrl.kernels.roofline.peaks_for``; 989
TFLOP/s on an H100 SXM and on an H200; "-" on a GPU that table does not hold).

``--compile MODE`` compiles each transformer with flowrl's ``memory.compile`` path
(``flowrl.policy.memory.compile_denoiser``) before timing; its FLOPs are counted on the eager call
(``FlopCounterMode`` does not see inside compiled kernels) and the first calls' compile time goes into
the warm-up, which is printed.

Run on a CUDA machine: ``python -m bench.gpu_measure [--batch 1 4] [--repeats 5] [--compile default]
[--compile-scope blocks]``.
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import time
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.gpu_plan import flux_transformer, sd3_transformer, wan_transformer
from flowrl.kernels.roofline import GpuPeaks, peaks_for
from flowrl.policy.memory import COMPILE_MODES, COMPILE_SCOPES, compile_denoiser, eager_calls, trainable_attention

GIB = 1024**3


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def _models() -> dict[str, tuple[Callable, Callable[[int], dict], tuple[str, ...], int]]:
    """Name -> (builder, inputs for a batch, LoRA targets, LoRA rank): the geometry of docs/gpu-plan.md."""
    from flowrl.models.flux import flux_lora_targets
    from flowrl.models.sd3 import SD3_LORA_TARGETS
    from flowrl.models.wan import WAN_LORA_TARGETS

    def sd3_inputs(b: int) -> dict:  # 512^2: 1024 image tokens + 333 text tokens
        return dict(
            hidden_states=_randn(b, 16, 64, 64),
            encoder_hidden_states=_randn(b, 333, 4096),
            pooled_projections=_randn(b, 2048),
            timestep=torch.full((b,), 500.0, device="cuda"),
        )

    def flux_inputs(b: int) -> dict:  # 512^2 packed 2x2: 1024 tokens of 64 channels + 512 T5 tokens
        return dict(
            hidden_states=_randn(b, 1024, 64),
            encoder_hidden_states=_randn(b, 512, 4096),
            pooled_projections=_randn(b, 768),
            timestep=torch.full((b,), 0.5, device="cuda"),
            guidance=torch.full((b,), 3.5, device="cuda"),
            img_ids=torch.zeros(1024, 3, device="cuda"),
            txt_ids=torch.zeros(512, 3, device="cuda"),
        )

    def wan_inputs(b: int) -> dict:  # 33 frames at 320^2: 3600 video tokens + 512 UMT5 tokens
        return dict(
            hidden_states=_randn(b, 16, 9, 40, 40),
            encoder_hidden_states=_randn(b, 512, 4096),
            timestep=torch.full((b,), 500.0, device="cuda"),
        )

    return {
        "SD3.5-M": (sd3_transformer, sd3_inputs, SD3_LORA_TARGETS, 32),
        "FLUX.1-dev": (flux_transformer, flux_inputs, flux_lora_targets(38), 64),
        "Wan2.1-1.3B": (wan_transformer, wan_inputs, WAN_LORA_TARGETS, 32),
    }


def _build(builder: Callable, targets: tuple[str, ...], rank: int) -> torch.nn.Module:
    from flowrl.policy.lora import add_lora

    with torch.device("meta"):
        model = builder().to(torch.bfloat16)  # bf16 before allocating: FLUX in fp32 alone would take 48 GB
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    add_lora(model, rank=rank, alpha=rank, targets=targets)
    return model


def _time(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(median seconds of ``repeats`` calls, seconds of the warm-up call before them)."""
    start = time.perf_counter()
    fn()  # warm-up (kernel selection, allocator; with --compile: tracing and code generation)
    torch.cuda.synchronize()
    warmup = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), warmup


def _flops(fn: Callable[[], None], model: torch.nn.Module) -> float:
    """FLOPs of one call, counted eagerly: FlopCounterMode does not see inside compiled kernels.

    Every compiled module (the model, or its blocks under ``--compile-scope blocks``) runs eager for the count.
    """
    with eager_calls(model), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def release(model: torch.nn.Module) -> None:
    """Free what a failed pass left on the GPU; called after its ``except`` block has ended (also on a CPU run).

    Inside that block the exception's traceback still holds the failed pass's frames and their
    activations, so ``empty_cache`` there frees nothing. Likely why FLUX.1's checkpointed training pass at
    batch 16 ran out of memory right after the plain one did (2026-11-27, H100; at batch 4 it peaked at
    26.9 GiB, about 0.9 GiB a sample). Rerun in round 2 with this release: it ran out again, so the row
    now also prints the failed allocation's size and what is still allocated after the release.
    """
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()


def oom_reason(err: BaseException) -> str:
    """'out of memory' with what the failed allocation asked for, from torch's message when it says."""
    asked = re.search(r"Tried to allocate ([\d.]+ [KMG]iB)", str(err))
    return "out of memory" + (f" (tried to allocate {asked.group(1)})" if asked else "")


def _peak(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB


def mfu(flops_per_s: float, peaks: GpuPeaks | None) -> str:
    """Achieved FLOP/s over the GPU's dense bf16 datasheet peak, as a percentage; "-" for a GPU not in the table."""
    return "-" if peaks is None else f"{flops_per_s / peaks.bf16_flops:.1%}"


def measure(
    name: str,
    builder: Callable,
    inputs: Callable[[int], dict],
    targets: tuple[str, ...],
    rank: int,
    batches: list[int],
    repeats: int,
    compile_mode: str = "none",
    compile_scope: str = "model",
    peaks: GpuPeaks | None = None,
) -> None:
    model = _build(builder, targets, rank)
    compile_denoiser(model, compile_mode, compile_scope)
    weights = torch.cuda.memory_allocated() / GIB
    for b in batches:
        x = inputs(b)

        def rollout() -> None:
            with torch.no_grad(), trainable_attention():  # the kernels of Trainer.collect (no cuDNN, since round 2)
                with torch.autocast("cuda", dtype=torch.bfloat16):  # as memory.autocast: bf16
                    model(**x, return_dict=False)

        def train() -> None:
            with trainable_attention():  # around forward and backward, as Trainer.update: a
                with torch.autocast(
                    "cuda", dtype=torch.bfloat16
                ):  # checkpointed block recomputes with the same kernels
                    out = model(**x, return_dict=False)[0]
                out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)

        for ckpt in (False, True):
            if ckpt:
                model.enable_gradient_checkpointing()
            else:
                model.disable_gradient_checkpointing()
            cases = [("rollout", rollout)] if not ckpt else []
            cases.append(("train, checkpointing" if ckpt else "train", train))
            for case, fn in cases:
                why = None
                try:
                    seconds, warmup = _time(fn, repeats)
                    flops = _flops(fn, model)
                    peak = _peak(fn)
                except (
                    torch.cuda.OutOfMemoryError,
                    RuntimeError,
                ) as err:  # cuBLAS reports some OOMs as internal errors
                    why = (
                        oom_reason(err)
                        if isinstance(err, torch.cuda.OutOfMemoryError)
                        else str(err).splitlines()[0][:60]
                    )
                if why is not None:
                    release(model)
                    held = torch.cuda.memory_allocated() / GIB
                    why += f"; {held:.1f} GiB still allocated after release"  # the next pass starts from this
                    print(f"| {name} | {b} | {case} | {why} | | | | | {weights:.1f} | | |", flush=True)
                    continue
                print(
                    f"| {name} | {b} | {case} | {seconds * 1e3:,.1f} | {seconds * 1e3 / b:,.1f} | "
                    f"{flops / 1e12:,.2f} | "
                    f"{flops / seconds / 1e12:,.0f} | {mfu(flops / seconds, peaks)} | {weights:.1f} | {peak:.1f} "
                    f"| {warmup:.1f} |",
                    flush=True,
                )
    # Free the weights before empty_cache. Rebinding (not ``del``) clears the cell that the closures above share,
    # without leaving them pointing at an unbound name.
    model = None
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=None, help="subset of SD3.5-M FLUX.1-dev Wan2.1-1.3B")
    parser.add_argument("--compile", default="none", choices=COMPILE_MODES, help="memory.compile mode of the denoiser")
    parser.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES, help="memory.compile_scope")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_measure needs a CUDA GPU; bench.gpu_plan gives the counted estimates without one")
    torch.backends.cuda.matmul.allow_tf32 = True
    peaks = peaks_for(torch.cuda.get_device_name())
    peak_name = "unknown peak" if peaks is None else f"{peaks.name} bf16 {peaks.bf16_flops / 1e12:,.0f}"

    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 weights, random init, LoRA as shipped, "
        f"median of {args.repeats}, memory.compile={args.compile}, memory.compile_scope={args.compile_scope}"
    )
    print(
        f"| model | batch | pass | ms | ms per sample | TFLOP | achieved TFLOP/s | MFU ({peak_name}) | weights GiB "
        "| peak GiB | first call s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (builder, inputs, targets, rank) in _models().items():
        if args.models is None or name in args.models:
            measure(
                name, builder, inputs, targets, rank, args.batch, args.repeats, args.compile, args.compile_scope, peaks
            )


if __name__ == "__main__":
    main()
