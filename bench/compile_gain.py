"""``memory.compile`` and torch threads on the CPU: compile time, speed-up and exactness of the embedded denoiser.

Usage: ``python -m bench.compile_gain [--mode default] [--scope blocks] [--chunk 40] [--repeats 7]
[--device cuda]``. Builds the embedded model's policy stack with a LoRA r8 (``flowrl.policy.build_policy``,
as training does), times the first compiled no-grad call and the first compiled training call (tracing
+ code generation), then alternates eager and compiled calls of one rollout chunk at 1 and 2 torch
threads: a no-grad forward (a rollout step) and a forward + backward of a squared-velocity loss
(a training micro-step). Prints the medians, each over eager at one thread, and the largest
difference between the eager and compiled velocities. On CUDA (``--device cuda``) every timed call
is synchronised and only one thread count runs (host threads do not run the kernels); the
``reduce-overhead`` mode (CUDA graphs) is the one to try there. ``--scope blocks`` compiles each
repeated block instead of the whole denoiser (``memory.compile_scope``). ``--mode cudagraphs`` (torch's
``cudagraphs`` backend, CUDA graphs of the traced eager kernels) is CUDA-only in training; on the CPU
torch traces and skips the capture, so there its first calls time the tracing alone and its calls equal
eager (difference 0).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import torch

from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.policy.memory import COMPILE_MODES, COMPILE_SCOPES, compile_denoiser, eager_calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", default="default", choices=[m for m in COMPILE_MODES if m != "none"])
    parser.add_argument("--scope", default="model", choices=COMPILE_SCOPES)
    parser.add_argument("--chunk", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy = build_policy(load_config(None, ["train.threads=1", f"model.device={args.device}"]), trainable=True)
    model, transformer = policy.model, policy.model.transformer
    x = torch.randn(args.chunk, *policy.latent_shape, generator=torch.Generator().manual_seed(0)).to(args.device)
    sigma = torch.full((args.chunk,), 0.5, device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    thread_counts = (1, 2) if args.device == "cpu" else (1,)
    cond = model.encode_prompt(["a bold handwritten 7"] * args.chunk)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model.velocity(x, sigma, cond)

    def step() -> None:
        model.velocity(x, sigma, cond).square().mean().backward()

    load = open("/proc/loadavg").read().split()[:3]
    eager = forward()
    compile_denoiser(transformer, args.mode, args.scope)
    first = {}
    for kind, fn in (("forward", forward), ("step", step)):
        first[kind] = _timed(fn, sync, calls=1)
    diff = (forward() - eager).abs().max().item()
    compiled_modules = sum(m._compiled_call_impl is not None for m in transformer.modules())
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.repeats):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for name in ("eager", "compiled"):
                with eager_calls(transformer) if name == "eager" else contextlib.nullcontext():
                    for kind, fn in (("forward", forward), ("step", step)):
                        times.setdefault((kind, name, threads), []).append(_timed(fn, sync))
    end = open("/proc/loadavg").read().split()[:3]
    print(
        f"load {' '.join(load)} -> {' '.join(end)}; {args.device}; mode {args.mode}, scope {args.scope} "
        f"({compiled_modules} compiled modules); chunk {args.chunk}; "
        f"{args.repeats} repeats"
    )
    print(f"first compiled call: forward {first['forward']:.1f} s, training step {first['step']:.1f} s")
    print(f"largest velocity difference compiled vs eager: {diff:.2e}")
    print("| call | variant | threads | median ms | / eager 1 thread |")
    print("|---|---|---|---|---|")
    for kind in ("forward", "step"):
        base = statistics.median(times[(kind, "eager", 1)])
        for (k, name, threads), values in times.items():
            if k == kind:
                med = statistics.median(values)
                print(f"| {kind} | {name} | {threads} | {1e3 * med:.1f} | {med / base:.3f} |")


def _timed(fn: Callable[[], object], sync: Callable[[], None], calls: int = 2) -> float:
    """Mean seconds of ``calls`` calls of ``fn``, the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


if __name__ == "__main__":
    main()
