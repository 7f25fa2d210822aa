"""Triton kernels for NVFP4 (format: :mod:`flowrl.kernels.nvfp4`); imported only by its dispatchers.

One program handles ``BLOCKS`` 16-element blocks, loaded as two (BLOCKS, 8) tiles (even and odd
elements), so a packed byte is built from one element of each tile. bf16 is loaded from its bits
(:func:`~flowrl.kernels.triton_load.load_fp32`: the interpreter's cast flushes bf16 subnormals). All divisions are
``div_rn`` (IEEE round-to-nearest; Triton's ``/`` is approximate on CUDA), and the value path has
no multiply-add pair a compiler could contract into an FMA, so results match the torch reference
bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_load import load_fp32

BLOCKS = 64  # 16-element blocks per program: 1024 elements


@triton.jit
def _e4m3_round(r):
    """fp32 in [2^-9, 448] -> nearest E4M3 value, ties to even (the reference's bit trick)."""
    bits = r.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    shift = 23 - tl.minimum(exponent + 9, 3)
    lsb = ((bits >> shift) & 1) | (shift == 23).to(tl.int32)  # no mantissa bit kept: the implicit 1
    bits = (bits + (1 << (shift - 1)) - 1 + lsb) & -(1 << shift)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(q):
    """Positive E4M3 value -> its 8-bit pattern (as int32)."""
    bits = q.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 7)
    return tl.where(q >= 0.015625, normal, (q * 512.0).to(tl.int32))


@triton.jit
def _e4m3_value(b):
    """8-bit E4M3 pattern (int32, sign bit clear) -> fp32."""
    exponent = (b >> 3) & 15
    mantissa = (b & 7).to(tl.float32)
    power = ((exponent + 117) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 10)
    return tl.where(exponent == 0, mantissa * 0.001953125, (8.0 + mantissa) * power)


@triton.jit
def _e2m1_magnitude(a):
    """|y| -> E2M1 magnitude index 0..7, nearest with ties to even (see E2M1_BOUNDS)."""
    m = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    m += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    return m + (a > 5.0).to(tl.int32)


@triton.jit
def _e2m1_value(code):
    """4-bit code (int32) -> fp32 E2M1 value."""
    m = code & 7
    e = m >> 1
    power = tl.where(e == 1, 0.5, tl.where(e == 2, 1.0, 2.0))
    value = tl.where(m < 2, m.to(tl.float32) * 0.5, (2.0 + (m & 1).to(tl.float32)) * power)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _code(y):
    """fp32 scaled element -> 4-bit code (int32); values that round to 0 get +0."""
    m = _e2m1_magnitude(tl.abs(y))
    return m | (((y < 0) & (m > 0)).to(tl.int32) << 3)


@triton.jit
def _quantize_kernel(
    x_ptr,
    scale_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    K,
    row_blocks,
    BLOCKS: tl.constexpr,
    WRITE_CODES: tl.constexpr,
    WRITE_VALUES: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = blk < n_blocks
    row = blk // row_blocks
    kb = blk % row_blocks
    pair = tl.arange(0, 8)
    col = kb[:, None] * 16 + 2 * pair[None, :]
    even = live[:, None] & (col < K)
    odd = live[:, None] & (col + 1 < K)
    src = row[:, None] * K + col
    xe = load_fp32(x_ptr, src, even, BF16_BITS)
    xo = load_fp32(x_ptr, src + 1, odd, BF16_BITS)
    s = tl.load(scale_ptr)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    r = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), s + tl.zeros_like(amax))
    q = _e4m3_round(tl.minimum(tl.maximum(r, 0.001953125), 448.0))
    scale = (q * s)[:, None]
    ce = _code(tl.math.div_rn(xe, scale + tl.zeros_like(xe)))
    co = _code(tl.math.div_rn(xo, scale + tl.zeros_like(xo)))
    if WRITE_CODES:
        dst = codes_ptr + row[:, None] * (row_blocks * 8) + kb[:, None] * 8 + pair[None, :]
        tl.store(dst, (ce | (co << 4)).to(tl.uint8), mask=live[:, None])
        tl.store(scales_ptr + blk, _e4m3_bits(q).to(tl.uint8), mask=live)
    if WRITE_VALUES:
        dst = out_ptr + row[:, None] * K + col
        tl.store(dst, (_e2m1_value(ce) * q[:, None]) * s, mask=even)
        tl.store(dst + 1, (_e2m1_value(co) * q[:, None]) * s, mask=odd)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, scale_ptr, out_ptr, n_blocks, K, row_blocks, BLOCKS: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = blk < n_blocks
    row = blk // row_blocks
    kb = blk % row_blocks
    pair = tl.arange(0, 8)
    packed = tl.load(codes_ptr + blk[:, None] * 8 + pair[None, :], mask=live[:, None], other=0).to(tl.int32)
    q = _e4m3_value(tl.load(scales_ptr + blk, mask=live, other=0).to(tl.int32))[:, None]
    s = tl.load(scale_ptr)
    col = kb[:, None] * 16 + 2 * pair[None, :]
    dst = out_ptr + row[:, None] * K + col
    tl.store(dst, (_e2m1_value(packed & 15) * q) * s, mask=live[:, None] & (col < K))
    tl.store(dst + 1, (_e2m1_value(packed >> 4) * q) * s, mask=live[:, None] & (col + 1 < K))


def quantize_triton(
    x: Tensor, tensor_scale: Tensor, *, write_codes: bool, write_values: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Launch the quantise kernel on ``x`` (..., K).

    Args:
        x: (..., K) fp16 / bf16 / fp32 tensor (CUDA, or CPU under TRITON_INTERPRET=1).
        tensor_scale: () fp32 tensor scale from :func:`flowrl.kernels.nvfp4.nvfp4_tensor_scale`.
        write_codes: write the packed codes and E4M3 scale bits.
        write_values: write the dequantised values (fp32).

    Returns:
        codes (..., Kp / 2) uint8, scale bits (..., Kp / 16) uint8, values fp32 of x's shape;
        ``None`` for the parts not written.
    """
    K = x.shape[-1]
    rows = x.numel() // K
    row_blocks = triton.cdiv(K, 16)
    n_blocks = rows * row_blocks
    lead = x.shape[:-1]
    codes = x.new_empty((*lead, row_blocks * 8), dtype=torch.uint8) if write_codes else None
    scales = x.new_empty((*lead, row_blocks), dtype=torch.uint8) if write_codes else None
    out = x.new_empty(x.shape, dtype=torch.float32) if write_values else None
    dummy = x.new_empty(1, dtype=torch.uint8)
    grid = (triton.cdiv(n_blocks, BLOCKS),)
    bf16 = x.dtype == torch.bfloat16
    x = x.contiguous()
    _quantize_kernel[grid](
        x.view(torch.int16) if bf16 else x,
        tensor_scale.to(device=x.device, dtype=torch.float32).reshape(1),
        codes if write_codes else dummy,
        scales if write_codes else dummy,
        out if write_values else x.new_empty(1, dtype=torch.float32),
        n_blocks,
        K,
        row_blocks,
        BLOCKS=BLOCKS,
        WRITE_CODES=write_codes,
        WRITE_VALUES=write_values,
        BF16_BITS=bf16,
    )
    return codes, scales, out


def dequantize_triton(codes: Tensor, scale_bits: Tensor, tensor_scale: Tensor, shape: torch.Size) -> Tensor:
    """Launch the dequantise kernel; returns fp32 of ``shape``.

    Args:
        codes: (..., Kp / 2) uint8 packed codes.
        scale_bits: (..., Kp / 16) uint8 E4M3 bit patterns.
        tensor_scale: () fp32.
        shape: the original (..., K).
    """
    K = shape[-1]
    row_blocks = scale_bits.shape[-1]
    n_blocks = scale_bits.numel()
    out = codes.new_empty(shape, dtype=torch.float32)
    _dequantize_kernel[(triton.cdiv(n_blocks, BLOCKS),)](
        codes.contiguous(),
        scale_bits.contiguous(),
        tensor_scale.to(device=codes.device, dtype=torch.float32).reshape(1),
        out,
        n_blocks,
        K,
        row_blocks,
        BLOCKS=BLOCKS,
    )
    return out
