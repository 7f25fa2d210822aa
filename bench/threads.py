"""Torch intra-op threads on the embedded model: rollout and train-step time at 1 vs 2 threads.

Usage: ``python -m bench.threads [--repeats 7]``. Alternates thread counts within one process
so both see the same host load; prints median / min / max seconds and the ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def _setup():
    from flowrl.models import load_adapter
    from flowrl.policy.lora import add_lora

    model = load_adapter("flowrl-digits")
    params = add_lora(model.transformer, rank=8, alpha=16, targets=model.lora_target_modules)
    return model, params


def _rollout(model, cond, x):
    from flowrl.rollouts.chunked import chunked_rollout
    from flowrl.samplers import linear_sigmas, sde_noise_levels

    chunked_rollout(model, cond, x, linear_sigmas(10), sde_noise_levels(10, 0.7), chunk_size=40)


def _train_step(model, params, cond, x):
    sigma = torch.full((x.shape[0],), 0.5)
    v = model.velocity(x, sigma, cond)
    v.float().pow(2).mean().backward()
    for p in params:
        p.grad = None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    model, params = _setup()
    cond160 = model.encode_prompt(["a bold handwritten 7"] * 160)
    cond40 = {k: v[:40] for k, v in cond160.items()}
    x160 = torch.randn(160, 4, 8, 8)
    cases = {
        "rollout 160 x 10 steps": lambda: _rollout(model, cond160, x160),
        "train micro-step B40 (fwd+bwd)": lambda: _train_step(model, params, cond40, x160[:40]),
    }
    times = {(name, n): [] for name in cases for n in (1, 2)}
    for name, fn in cases.items():
        fn()  # warm-up
        for _ in range(args.repeats):
            for n in (1, 2):
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                fn()
                times[(name, n)].append(time.perf_counter() - t0)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{args.repeats} alternating repeats"
    )
    print("| case | threads | median s | min s | max s | max/median |")
    print("|---|---|---|---|---|---|")
    for (name, n), ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {n} | {med:.3f} | {min(ts):.3f} | {max(ts):.3f} | {max(ts) / med:.2f} |")
    for name in cases:
        ratio = statistics.median(times[(name, 2)]) / statistics.median(times[(name, 1)])
        print(f"{name}: median(2 threads) / median(1 thread) = {ratio:.2f}")


if __name__ == "__main__":
    main()
