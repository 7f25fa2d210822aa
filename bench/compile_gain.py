"""``memory.compile`` on the CPU: compile time, speed-up and exactness of the embedded denoiser.

Usage: ``python -m bench.compile_gain [--mode default] [--chunk 40] [--repeats 10]``. Builds the
embedded model's policy stack with a LoRA r8 (``flowrl.policy.build_policy``, as training does),
times the first compiled call (tracing + code generation), then alternates eager and compiled
no-grad forwards of one rollout chunk, and prints the medians, the ratio and the largest
difference between the two velocities.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.policy.memory import compile_denoiser


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead", "max-autotune"])
    parser.add_argument("--chunk", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    policy = build_policy(load_config(None, ["train.threads=1"]), trainable=True)
    model, transformer = policy.model, policy.model.transformer
    x = torch.randn(args.chunk, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((args.chunk,), 0.5)
    cond = model.encode_prompt(["a bold handwritten 7"] * args.chunk)
    load = open("/proc/loadavg").read().split()[:3]
    with torch.no_grad():
        eager = model.velocity(x, sigma, cond)
        compile_denoiser(transformer, args.mode)
        t0 = time.perf_counter()
        compiled = model.velocity(x, sigma, cond)
        compile_s = time.perf_counter() - t0
        impl = transformer._compiled_call_impl
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for name, fn in (("eager", None), ("compiled", impl)):
                transformer._compiled_call_impl = fn
                t0 = time.perf_counter()
                model.velocity(x, sigma, cond)
                times[name].append(time.perf_counter() - t0)
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    print(f"load {' '.join(load)} -> {' '.join(open('/proc/loadavg').read().split()[:3])}; 1 thread; mode {args.mode}")
    print("| chunk | first compiled call s | eager median ms | compiled median ms | compiled / eager | max abs diff |")
    print("|---|---|---|---|---|---|")
    diff = (compiled - eager).abs().max().item()
    print(f"| {args.chunk} | {compile_s:.1f} | {1e3 * e:.1f} | {1e3 * c:.1f} | {c / e:.3f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
