"""The physical limit of the embedded model on this machine: FLOPs of an iteration over achieved matmul FLOP/s.

Two measurements, both on the real code:

- ``count_flops(fn)``: ``torch.utils.flop_counter.FlopCounterMode`` around a call (a whole
  rollout or training step through the trainer), split into the denoiser's FLOPs and the rest
  (VAE decode, reward models); torch.ao's dynamic int8 Linear (Sol-RL's CPU explore copy) is
  counted too, as the matmul it computes;
- ``matmul_rate(shapes, threads)``: achieved FLOP/s of ``torch.mm`` on the denoiser's own linear
  shapes (``linear_shapes`` reads them from the transformer's config: tokens from the latent
  shape and patch size, widths from heads x head dim), FLOP-weighted, at a given thread count.

The floor of a phase is its FLOPs divided by the achieved rate: no implementation on this CPU
and these shapes can be faster than that with the same arithmetic. ``bench/profile.py`` prints
measured time over floor per objective. Standalone:
``python -m bench.flop_floor [--model flowrl-digits] [--chunk 40]`` prints the rates.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

DENOISER = "SD3Transformer2DModel"


def _int8_linear_flops(x_shape: torch.Size, *_: Any, out_shape: torch.Size, **__: Any) -> int:
    """``quantized::linear_dynamic``: x (..., K) times a packed (N, K) int8 weight, 2 K N per row."""
    return 2 * x_shape.numel() * out_shape[-1]


QUANTISED_MATMULS = {torch.ops.quantized.linear_dynamic: _int8_linear_flops}  # FlopCounterMode keys: op packets


def count_flops(fn: Callable[[], Any], denoiser: str = DENOISER) -> tuple[Any, float, float]:
    """Run ``fn`` under ``FlopCounterMode``; returns (its result, all FLOPs, the denoiser's FLOPs).

    FLOPs are counted for matmuls (torch's own, and the dynamic int8 Linear's), convolutions and
    attention (forward and backward), the ops that dominate a transformer; elementwise ops are not
    counted (they are memory-bound).
    """
    with FlopCounterMode(display=False, custom_mapping=QUANTISED_MATMULS) as counter:
        out = fn()
    counts = counter.get_flop_counts()
    total = float(sum(counts.get("Global", {}).values()))
    model = float(sum(v for k, per in counts.items() if k.split(".")[-1] == denoiser for v in per.values()))
    return out, total, model


def linear_shapes(
    transformer: torch.nn.Module, latent_shape: tuple[int, ...], chunk: int
) -> list[tuple[int, int, int]]:
    """(M, K, N) of the denoiser's token-wise linear layers for a chunk of ``chunk`` samples.

    Read from an ``SD3Transformer2DModel`` config: D = heads x head dim; image tokens
    (H / p) x (W / p); q/k/v and output projections D x D, feed-forward D x 4D and 4D x D.
    """
    c = transformer.config
    width = c.num_attention_heads * c.attention_head_dim
    tokens = (latent_shape[-2] // c.patch_size) * (latent_shape[-1] // c.patch_size)
    m = chunk * tokens
    return [(m, width, width), (m, width, 4 * width), (m, 4 * width, width)]


def matmul_rate(shapes: list[tuple[int, int, int]], threads: int, repeats: int = 20) -> float:
    """Achieved FLOP/s of fp32 ``torch.mm`` over ``shapes`` (FLOP-weighted: total FLOPs / total median time)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = seconds = 0.0
        for m, k, n in shapes:
            a, b = torch.randn(m, k), torch.randn(k, n)
            torch.mm(a, b)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - t0)
            flops += 2.0 * m * k * n
            seconds += statistics.median(times)
        return flops / seconds
    finally:
        torch.set_num_threads(old)


def main(argv: list[str] | None = None) -> None:
    from flowrl.models import load_adapter

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="flowrl-digits")
    parser.add_argument("--chunk", type=int, default=40)
    args = parser.parse_args(argv)
    model = load_adapter(args.model)
    shapes = linear_shapes(model.transformer, model.latent_shape(*model.default_resolution), args.chunk)
    print("| threads | shapes (M, K, N) | achieved GFLOP/s |")
    print("|---|---|---|")
    for n in (1, 2):
        print(f"| {n} | {shapes} | {matmul_rate(shapes, n) / 1e9:.1f} |")


if __name__ == "__main__":
    main()
