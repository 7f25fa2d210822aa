"""Scaling of a rollout's cost with batch (group size x prompts), steps and tokens, against the FLOP model.

Usage: ``python -m bench.scaling [--rounds 3] [--plot docs/benchmarks-scaling.png]``. Every point is
a no-grad Flow-SDE rollout through ``flowrl.rollouts.chunked.chunked_rollout`` (chunks of 40) with a
LoRA r8 on the denoiser; points alternate within each round (so they share the host's load) and the
median over rounds is reported. Sweeps:

- samples per rollout (the group size times prompts) on the embedded model, 5 steps;
- steps on the embedded model, 20 samples;
- tokens: random-init SD3 transformers of the embedded model's width and depth at latent sizes
  8, 16 and 32 (16, 64 and 256 image tokens), 8 samples, 5 steps (the embedded VAE and text
  encoders, so only the transformer changes).

FLOPs of each point are counted with ``FlopCounterMode`` on the same call. The fitted growth is
the slope of log(time) against log(x) (1 = linear); the FLOP model's slope is printed beside it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.flop_floor import count_flops
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels


def _model(latent: int | None = None) -> Any:
    """The embedded adapter with a LoRA r8; with ``latent``, its transformer re-built at that latent size (random)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.models import load_adapter
    from flowrl.policy.lora import add_lora

    model = load_adapter("flowrl-digits")
    if latent is not None:
        cfg = dict(model.transformer.config)
        cfg.update(sample_size=latent, pos_embed_max_size=latent // cfg["patch_size"])
        torch.manual_seed(0)
        keep = {k: v for k, v in cfg.items() if not k.startswith("_")}
        model.pipe.transformer = SD3Transformer2DModel(**keep).requires_grad_(False)
        model.transformer = model.pipe.transformer
    add_lora(model.transformer, rank=8, alpha=16, targets=model.lora_target_modules)
    return model


def _rollout(model: Any, samples: int, steps: int, latent: int) -> Callable[[], Any]:
    cond = model.encode_prompt(["a bold handwritten 7"] * samples)
    x = torch.randn(samples, model.transformer.config.in_channels, latent, latent)
    sigmas, levels = linear_sigmas(steps), sde_noise_levels(steps, 0.7)
    return lambda: chunked_rollout(
        model, cond, x, sigmas, levels, chunk_size=40, generator=torch.Generator().manual_seed(0)
    )


def _slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = _model()
    side = base.latent_shape(*base.default_resolution)[-1]
    points: dict[tuple[str, int], Callable[[], Any]] = {}
    for samples in (5, 10, 20, 40, 80):
        points[("samples", samples)] = _rollout(base, samples, 5, side)
    for steps in (2, 5, 10, 20):
        points[("steps", steps)] = _rollout(base, 20, steps, side)
    for latent in (8, 16, 32):
        tokens = (latent // base.transformer.config.patch_size) ** 2
        points[("tokens", tokens)] = _rollout(_model(latent), 8, 5, latent)
    flops = {key: count_flops(fn)[2] for key, fn in points.items()}  # also the warm-up
    load = open("/proc/loadavg").read().split()[:3]
    times: dict[tuple[str, int], list[float]] = {key: [] for key in points}
    for _ in range(args.rounds):
        for key, fn in points.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    load_end = open("/proc/loadavg").read().split()[:3]
    print(f"{args.rounds} interleaved rounds, 1 thread, load {' '.join(load)} -> {' '.join(load_end)}")
    print("| sweep | x | median s | denoiser GFLOP | s per GFLOP |")
    print("|---|---|---|---|---|")
    med = {key: statistics.median(ts) for key, ts in times.items()}
    for (sweep, x), s in med.items():
        print(f"| {sweep} | {x} | {s:.3f} | {flops[(sweep, x)] / 1e9:.2f} | {s / (flops[(sweep, x)] / 1e9):.3f} |")
    print("\n| sweep | fitted growth of time (log-log slope) | FLOP model's slope |")
    print("|---|---|---|")
    for sweep in ("samples", "steps", "tokens"):
        xs = [x for (sw, x) in med if sw == sweep]
        ts = [med[(sweep, x)] for x in xs]
        fs = [flops[(sweep, x)] for x in xs]
        print(f"| {sweep} | {_slope(xs, ts):.2f} | {_slope(xs, fs):.2f} |")
    if args.plot is not None:
        _plot(med, flops, args.plot)


def _plot(med: dict[tuple[str, int], float], flops: dict[tuple[str, int], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, sweep in zip(axes, ("samples", "steps", "tokens")):
        xs = [x for (sw, x) in med if sw == sweep]
        ts = [med[(sweep, x)] for x in xs]
        fs = [flops[(sweep, x)] for x in xs]
        ax.loglog(xs, ts, "o-", label="measured")
        ax.loglog(xs, [ts[0] * f / fs[0] for f in fs], "--", label="FLOP model (through the first point)")
        ax.set_xlabel(sweep)
        ax.set_ylabel("rollout s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Rollout cost vs batch, steps and tokens (no-grad Flow-SDE, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
