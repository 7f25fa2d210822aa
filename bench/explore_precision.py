"""Explore-model precisions on the embedded digits model: sampling speed and reward agreement (Sol-RL stage 1).

Usage::

    python -m bench.explore_precision [--prompts 8] [--seeds 24] [--threads N]

For each explore precision (``flowrl.policy.precision.build_explore``), the same seeds are sampled
with the deterministic Euler ODE of ``flowrl.rollouts.chunked.sample_images`` and scored with the
project's default rewards (``ink`` toward the prompt's style + 0.5 ``digit_correctness``). Printed
per precision: samples/s (sampling only; prompts encoded once), the time to build and to
``refresh`` the explore model, and how well its rewards rank the seeds like the fp32 policy's:
Spearman rho and Kendall tau over all samples, the mean per-prompt Spearman, and the overlap of
Sol-RL's ``best_worst`` selection (top and bottom quarter of each prompt's seeds, 6 of 24).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from scipy.stats import kendalltau, spearmanr

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.policy import build_policy
from flowrl.policy.precision import build_explore, refresh
from flowrl.prompts.batch import collate
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward
from flowrl.rollouts.chunked import sample_images
from flowrl.runtime import configure_threads

UNSHARED = {"activations": True, "share_inputs": False}  # quantise each Linear's input again (before 2026-11-29)
VARIANTS = [  # name, precision, options, ODE steps
    ("fp32 policy (reference)", None, {}, 10),
    ("fp32 merged copy", "fp32", {}, 10),
    ("bf16", "bf16", {}, 10),
    ("int8_dynamic (W8A8 int)", "int8_dynamic", {}, 10),
    ("fp8_e4m3 emulated, W8", "fp8_e4m3", {}, 10),
    ("nvfp4 emulated, W4", "nvfp4", {}, 10),
    ("nvfp4 emulated, W4A4", "nvfp4", {"activations": True}, 10),
    ("nvfp4 emulated, W4A4, each Linear quantises its input", "nvfp4", UNSHARED, 10),
    ("nvfp4 emulated, W4A4, 6 steps", "nvfp4", {"activations": True}, 6),
]


@contextmanager
def swapped_transformer(adapter: Any, module: torch.nn.Module | None) -> Iterator[None]:
    """Run the adapter (and the policy wrapping it) through ``module`` for a while."""
    original = adapter.transformer
    adapter.transformer = module if module is not None else original
    try:
        yield
    finally:
        adapter.transformer = original


def sample(policy: Any, texts: list[str], seeds: list[int], cond: Any, steps: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        images = sample_images(
            policy.model,
            texts,
            seeds,
            policy.sigmas(steps),
            resolution=policy.resolution,
            chunk_size=64,
            encode=lambda _: cond,
        )
    return images, time.perf_counter() - start


def agreement(explore: torch.Tensor, reference: torch.Tensor, prompts: int) -> dict[str, float]:
    """Rank agreement of two reward vectors laid out prompt-major (prompts x seeds)."""
    pairs = list(zip(explore.view(prompts, -1), reference.view(prompts, -1)))
    per_prompt = [spearmanr(e, r).statistic for e, r in pairs]
    overlap = [len(best_worst(e) & best_worst(r)) / len(best_worst(r)) for e, r in pairs]
    return {
        "spearman": spearmanr(explore, reference).statistic,
        "kendall": kendalltau(explore, reference).statistic,
        "per_prompt": statistics.mean(per_prompt),
        "selection": statistics.mean(overlap),
    }


def best_worst(rewards: torch.Tensor) -> set[int]:
    """Sol-RL's best_worst rule with K = a quarter of the seeds: the K/2 highest and K/2 lowest."""
    half = max(1, len(rewards) // 8)
    order = torch.argsort(rewards, stable=True).tolist()
    return set(order[:half]) | set(order[-half:])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    return f"{datetime.date.today()}, torch {torch.__version__}, {cpu}, {os.cpu_count()} cores, {threads} threads"


def build_variants(policy: Any) -> dict[str, tuple[Any, int, str, str]]:
    """Each variant by name: (explore model, None for the policy itself; steps; build time; refresh time)."""
    out = {}
    for name, precision, options, steps in VARIANTS:
        if precision is None:
            out[name] = (None, steps, "-", "-")
            continue
        start = time.perf_counter()
        explore = build_explore(policy, precision, **options)
        build = time.perf_counter() - start
        start = time.perf_counter()
        refresh(explore, policy)
        out[name] = (explore, steps, f"{build * 1e3:.0f} ms", f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    return out


def speeds(policy: Any, adapter: Any, variants: dict, batch: Any, cond: Any, rounds: int) -> dict[str, list[float]]:
    """samples/s of 64 samples per variant, the variants interleaved round by round (shared-machine load)."""
    texts, seeds, sub = batch.texts[:64], list(range(64)), {k: v[:64] for k, v in cond.items()}
    out: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (explore, steps, _, _) in variants.items():
            with swapped_transformer(adapter, explore.module if explore else None):
                out[name].append(len(texts) / sample(policy, texts, seeds, sub, steps)[1])
    return {name: values[1:] for name, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds of 64 samples")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    configure_threads(args.threads)
    cfg = load_config(None, [])
    adapter = load_adapter(cfg.model.path)
    policy = build_policy(cfg, model=adapter, trainable=True)
    chosen = load_prompts(cfg.prompts.train)[: args.prompts]
    batch = collate(chosen, repeats=args.seeds)
    seeds = [1000 + j for _ in chosen for j in range(args.seeds)]
    cond = policy.model.encode_prompt(batch.texts)
    reward = build_reward(cfg)
    variants = build_variants(policy)
    speed = speeds(policy, adapter, variants, batch, cond, args.rounds)
    print(f"Machine: {machine()}; {len(seeds)} samples ({args.prompts} prompts x {args.seeds} seeds), Euler ODE")
    print(f"samples/s: median (min-max) of {args.rounds} interleaved rounds of 64 samples\n")
    print(
        "| explore model | steps | quantised layers | samples/s | build | refresh | mean reward "
        "| Spearman | Kendall | per-prompt Spearman | best_worst overlap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    reference = None
    for name, (explore, steps, build, refreshed) in variants.items():
        with swapped_transformer(adapter, explore.module if explore else None):
            images, _ = sample(policy, batch.texts, seeds, cond, steps)
        total = reward(images, batch.texts, **batch.metadata).total
        reference = total if reference is None else reference
        agree = agreement(total, reference, args.prompts)
        layers = len(explore.quantised) if explore else 0
        rate = f"{statistics.median(speed[name]):.1f} ({min(speed[name]):.1f}-{max(speed[name]):.1f})"
        print(
            f"| {name} | {steps} | {layers} | {rate} | {build} | {refreshed} "
            f"| {total.mean():.4f} | {agree['spearman']:.3f} | {agree['kendall']:.3f} | {agree['per_prompt']:.3f} "
            f"| {agree['selection']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
