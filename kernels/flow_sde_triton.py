"""Triton kernel for the fused Flow-SDE step (:mod:`flowrl.kernels.flow_sde`); imported only by its dispatcher.

Grid (B, ceil(N / BLOCK)): each program reads one BLOCK of sample ``b``'s x, v and noise (or the
stored x'), writes the mean (and the sample) and one partial log-prob sum; the host adds the
(B, chunks) partials, so the reduction is deterministic (no atomics).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@triton.jit
def _flow_sde_kernel(
    x_ptr,
    v_ptr,
    eps_ptr,
    sample_ptr,
    mean_ptr,
    partial_ptr,
    sigma_ptr,
    sigma_next_ptr,
    s_ptr,
    std_ptr,
    N,
    chunks,
    half_log_2pi,
    BLOCK: tl.constexpr,
    SCORE: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    at = b.to(tl.int64) * N + offs
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
    eps = tl.load(eps_ptr + at, mask=mask, other=0.0).to(tl.float32)
    sigma = tl.load(sigma_ptr + b)
    s = tl.load(s_ptr + b)
    std = tl.load(std_ptr + b)
    dt = tl.load(sigma_next_ptr + b) - sigma
    mean = x + (v + s * s / (2.0 * sigma) * (x + (1.0 - sigma) * v)) * dt
    if SCORE:
        sample = eps
    else:
        sample = mean + std * eps
        tl.store(sample_ptr + at, sample, mask=mask)
    tl.store(mean_ptr + at, mean, mask=mask)
    safe = tl.where(std > 0, std, 1.0)
    diff = sample - mean
    elem = -(diff * diff) / (2.0 * safe * safe) - tl.log(safe) - half_log_2pi
    elem = tl.where(mask, tl.where(std > 0, elem, 0.0), 0.0)
    tl.store(partial_ptr + b * chunks + c, tl.sum(elem, axis=0))


def flow_sde_triton(
    x: Tensor, v: Tensor, eps: Tensor, sigma: Tensor, sigma_next: Tensor, s: Tensor, std: Tensor, *, score: bool
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Launch the fused step on (B, N) views.

    Args:
        x: (B, N) latent (fp16 / bf16 / fp32), contiguous.
        v: (B, N) velocity, contiguous.
        eps: (B, N) standard-normal noise, or the stored x' when ``score``.
        sigma: (B,) fp32.
        sigma_next: (B,) fp32.
        s: (B,) fp32 diffusion coefficient.
        std: (B,) fp32 transition std.
        score: score the stored x' in ``eps`` instead of drawing a sample.

    Returns:
        sample (B, N) fp32 (None when scoring), mean (B, N) fp32, log-prob sums (B,) fp32.
    """
    B, N = x.shape
    chunks = triton.cdiv(N, BLOCK)
    mean = torch.empty((B, N), dtype=torch.float32, device=x.device)
    sample = mean if score else torch.empty_like(mean)
    partial = torch.empty((B, chunks), dtype=torch.float32, device=x.device)
    _flow_sde_kernel[(B, chunks)](
        x, v, eps, sample, mean, partial, sigma, sigma_next, s, std, N, chunks, HALF_LOG_2PI, BLOCK=BLOCK, SCORE=score
    )
    return (None if score else sample), mean, partial.sum(dim=1)
