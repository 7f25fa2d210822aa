"""Triton kernel for the fused Flow-SDE step (:mod:`flowrl.kernels.flow_sde`); imported only by its dispatcher.

One launch does the whole step: each program derives sample ``b``'s coefficients (dt, the
diffusion ``s``, the transition std) from sigma, sigma_next and the level, which arrive as fp32
scalars or as per-sample fp32 tensors (a constexpr flag per value picks), then streams blocks of
x, v and the noise (or the stored x'), writes the mean (and the sample) and sums its elements'
log-probs. A row of at most ``ROW_BLOCKS`` blocks is one program, which writes the sample's
log-prob itself; a longer row is split one block per program into (B, chunks) partials that one
``sum`` adds on the host stream. Either way the order of the sums is fixed (no atomics), so the
result is deterministic.

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025, eq. (8)-(9).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
ROW_BLOCKS = 4  # rows of up to 4096 elements run as one program: one launch, no partials (not tuned on a GPU yet)
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

Coefficient = float | Tensor
"""A per-step value as the kernel takes it: a Python float, or an fp32 tensor on the latent's device
of shape () or (B,)."""


@triton.jit
def _per_sample(value, stride, b, VEC: tl.constexpr):
    """Sample ``b``'s value: loaded from a tensor when ``VEC``, else the fp32 scalar argument itself."""
    if VEC:
        out = tl.load(value + b * stride)
    else:
        out = value
    return out


@triton.jit
def _flow_sde_kernel(
    x_ptr,
    v_ptr,
    eps_ptr,
    sample_ptr,
    mean_ptr,
    std_ptr,
    out_ptr,
    sigma_arg,
    sigma_next_arg,
    level_arg,
    sigma_stride,
    sigma_next_stride,
    level_stride,
    x_stride,
    v_stride,
    eps_stride,
    N,
    blocks: tl.constexpr,  # 1 to ROW_BLOCKS: a static loop (Triton 3.6's interpreter cannot range over a runtime int)
    scale,
    half_log_2pi,
    BLOCK: tl.constexpr,
    SIGMA_VEC: tl.constexpr,
    SIGMA_NEXT_VEC: tl.constexpr,
    LEVEL_VEC: tl.constexpr,
    SCORE: tl.constexpr,
    WRITE_SAMPLE: tl.constexpr,
):
    b = tl.program_id(0)
    p = tl.program_id(1)
    sigma = _per_sample(sigma_arg, sigma_stride, b, SIGMA_VEC)
    sigma_next = _per_sample(sigma_next_arg, sigma_next_stride, b, SIGMA_NEXT_VEC)
    level = _per_sample(level_arg, level_stride, b, LEVEL_VEC)
    # flow_sde_diffusion / flow_sde_moments, IEEE-rounded like torch: s = a sqrt(sigma / (1 - sigma~))
    safe = tl.where(sigma >= 1.0, sigma_next, sigma)
    s = level * tl.sqrt_rn(tl.math.div_rn(sigma, 1.0 - safe))
    std = s * tl.sqrt_rn(sigma - sigma_next)
    dt = sigma_next - sigma
    drift = tl.math.div_rn(s * s, 2.0 * sigma)
    one_minus = 1.0 - sigma
    positive = std > 0
    std_safe = tl.where(positive, std, 1.0)
    two_var = 2.0 * (std_safe * std_safe)
    log_std = tl.log(std_safe)
    if p == 0:
        tl.store(std_ptr + b, std)
    b64 = b.to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, blocks):
        offs = (p * blocks + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + b64 * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b64 * v_stride + offs, mask=mask, other=0.0).to(tl.float32)
        eps = tl.load(eps_ptr + b64 * eps_stride + offs, mask=mask, other=0.0).to(tl.float32)
        mean = x + (v + drift * (x + one_minus * v)) * dt
        if SCORE:
            sample = eps
        else:
            sample = mean + std * eps
        out_at = b64 * N + offs
        if WRITE_SAMPLE:
            tl.store(sample_ptr + out_at, sample, mask=mask)
        tl.store(mean_ptr + out_at, mean, mask=mask)
        diff = sample - mean
        elem = -tl.math.div_rn(diff * diff, two_var + tl.zeros_like(diff)) - log_std - half_log_2pi  # same shapes
        acc += tl.where(mask, elem, 0.0)
    total = tl.where(positive, tl.sum(acc, axis=0), 0.0)  # std = 0 (the ODE step): log-prob 0, as the reference
    tl.store(out_ptr + b * tl.num_programs(1) + p, total * scale)


def flow_sde_triton(
    x: Tensor,
    v: Tensor,
    eps: Tensor,
    sigma: Coefficient,
    sigma_next: Coefficient,
    level: Coefficient,
    *,
    score: bool,
    write_sample: bool,
    mean_reduce: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the fused step: one kernel, plus one ``sum`` for rows longer than ``ROW_BLOCKS`` blocks.

    Args:
        x: (B, ...) latent (fp16 / bf16 / fp32); read in place when each sample is one contiguous run (any
            batch stride), else copied once.
        v: (B, ...) velocity, any dtype and layout ``x`` may have.
        eps: (B, ...) standard-normal noise, or the stored x' when ``score`` (any float dtype, same layout rule).
        sigma: float, or fp32 tensor () or (B,) on x's device.
        sigma_next: same forms as ``sigma``.
        level: the noise knob, same forms as ``sigma``.
        score: score the stored x' in ``eps`` instead of drawing a sample.
        write_sample: write ``eps`` (or the drawn sample) to the fp32 sample output.
        mean_reduce: average the element log-probs instead of summing them.

    Returns:
        sample (B, ...) fp32 (unwritten unless ``write_sample``), mean (B, ...) fp32, std (B,) fp32,
        log-prob (B,) fp32.
    """
    B = x.shape[0]
    N = x.numel() // B
    (x, x_stride), (v, v_stride), (eps, eps_stride) = (_sample_runs(t) for t in (x, v, eps))
    chunks = triton.cdiv(N, BLOCK)
    blocks, programs = (chunks, 1) if chunks <= ROW_BLOCKS else (1, chunks)
    mean = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    sample = torch.empty_like(mean) if write_sample else mean
    std = torch.empty(B, dtype=torch.float32, device=x.device)
    out = torch.empty((B, programs) if programs > 1 else B, dtype=torch.float32, device=x.device)
    coefficients = [(c, c.stride(0) if isinstance(c, Tensor) and c.ndim else 0) for c in (sigma, sigma_next, level)]
    flags = [isinstance(c, Tensor) for c in (sigma, sigma_next, level)]
    _flow_sde_kernel[(B, programs)](
        x,
        v,
        eps,
        sample,
        mean,
        std,
        out,
        *(c for c, _ in coefficients),
        *(stride for _, stride in coefficients),
        x_stride,
        v_stride,
        eps_stride,
        N,
        blocks,
        1.0 / N if mean_reduce else 1.0,
        HALF_LOG_2PI,
        BLOCK=BLOCK,
        SIGMA_VEC=flags[0],
        SIGMA_NEXT_VEC=flags[1],
        LEVEL_VEC=flags[2],
        SCORE=score,
        WRITE_SAMPLE=write_sample,
    )
    return sample, mean, std, (out if programs == 1 else out.sum(dim=1))


def _sample_runs(t: Tensor) -> tuple[Tensor, int]:
    """``t`` and its batch stride in elements; copied only when a sample is not one contiguous run.

    A batch slice (``x[::2]``) or a broadcast batch (stride 0) is read in place; anything else
    (a permuted or sliced sample, e.g. channels-last) costs one ``contiguous`` copy.
    """
    if t.is_contiguous():
        return t, t.stride(0)
    run = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != run:
            t = t.contiguous()
            return t, t.stride(0)
        run *= size
    return t, t.stride(0)
