"""Triton kernel for FP8 E4M3 row / tensor quantisation (format: :mod:`flowrl.kernels.fp8`); imported only by it.

One program quantises ``ROWS`` rows: it loads a (ROWS, BLOCK_K) tile, takes each row's amax, turns
it into the scale, divides, rounds to E4M3 and stores the codes and the scale. Rows longer than
8192 elements are read in chunks, twice (amax, then values; the second read mostly hits L2).

How it stays bit-exact with the torch reference (:func:`flowrl.kernels.fp8.fp8_quantize`):

- **The E4M3 rounding is done on the fp32 bits, not by Triton's fp8 cast.** Triton's interpreter
  (``TRITON_INTERPRET=1``, which the CPU tests run) casts fp32 to ``tl.float8e4nv`` by adding the
  first dropped bit (round half up, not to even) without saturation or a correct subnormal path, and
  the compiled cast's rounding and saturation depend on the target's ``cvt`` instruction. So the
  kernel builds the 8-bit pattern itself (:func:`_e4m3_code`: integer round-to-nearest-even on the
  bits for normals, one IEEE fp32 add for subnormals) and stores it as uint8, viewed as
  ``float8_e4m3fn`` on the host: the interpreter and every GPU compute the same bits by
  construction, and these are the bits of torch's ``float8_e4m3fn`` conversion.
- **The amax is an integer max of ``|x|``'s bits** (monotone in the magnitude; NaN patterns sort
  above inf, so a NaN row is found without relying on the NaN rules of float ``max``, which differ
  between numpy and PTX).
- **One IEEE division**: ``x / scale`` with ``tl.math.div_rn`` (round to nearest; Triton's ``/`` is
  approximate on CUDA). Rows whose scale is an fp32 subnormal are in the tests, so a compiled
  division that flushed subnormals to zero would show there. The scale is ``div_rn(amax, 448)`` on CPU and
  ``amax * fp32(1/448)`` on CUDA, as torch computes it on each (:mod:`flowrl.kernels.fp8`). No
  multiply feeds an add, so no FMA contraction can change a result.
- **bf16 is upcast from its bits** (``bits << 16``, :func:`~flowrl.kernels.triton_load.load_fp32`),
  because the interpreter's bf16 -> fp32 cast flushes bf16 subnormals; fp16 and fp32 load as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_load import load_fp32

MAX_BLOCK_K = 8192  # the longest row held in registers at once
TILE = 4096  # elements per program for short rows (ROWS = TILE // BLOCK_K rows)
# fp32(1 / 448): what torch's CUDA division by the Python scalar 448 multiplies by
RCP_FP8_MAX = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(448.0)))
FP32_448 = tl.constexpr(0x43E00000)  # the fp32 bit pattern of 448
FP32_2_M6 = tl.constexpr(121 << 23)  # 2^-6, the smallest E4M3 normal
FP32_2_14 = tl.constexpr(141 << 23)  # 2^14, whose fp32 ulp is 2^-9
FP32_INF = tl.constexpr(0x7F800000)


@triton.jit
def _e4m3_code(y):
    """fp32 -> E4M3-fn 8-bit pattern (int32 0..255): clamp to +-448, nearest with ties to even, sign kept.

    |y| >= 2^-6 (E4M3 normals): the fp32 bits are rounded at bit 20 (3 mantissa bits kept), adding
    0x7FFFF plus the kept lsb, so a tie goes to the even neighbour and a carry moves into the
    exponent; rebiasing the exponent (127 -> 7) gives the code. |y| < 2^-6 (subnormals, spacing
    2^-9): one fp32 add of 2^14, whose ulp is 2^-9, rounds |y| to a multiple of 2^-9 (IEEE round to
    nearest even, in numpy and in PTX alike; flushing a subnormal |y| to 0 first would give the same
    code 0); the sum's low bits are the code. |y| >= 448 (inf included) saturates to 0x7E; NaN
    gives 0x7F. The same steps as c10's ``fp8e4m3fn_from_fp32_value``, checked against torch's cast
    for every fp32 below 512 and every inf / NaN pattern.
    """
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    small = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - FP32_2_14
    code = tl.where(mag >= FP32_2_M6, normal, small)
    code = tl.where(mag >= FP32_448, 0x7E, code)
    code = tl.where(mag > FP32_INF, 0x7F, code)
    return code | tl.where(bits < 0, 0x80, 0)


@triton.jit
def _scale(amax_bits, RECIPROCAL: tl.constexpr):
    """Row amax (as |x| bits, int32) -> fp32 scale: amax / 448, or 1 where amax is 0 or NaN."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    if RECIPROCAL:
        scale = amax * RCP_FP8_MAX
    else:
        scale = tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0)
    return tl.where((amax_bits > 0) & (amax_bits <= FP32_INF), scale, 1.0)


@triton.jit
def _store_codes(q_ptr, offsets, mask, x, scale):
    y = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
    tl.store(q_ptr + offsets, _e4m3_code(y).to(tl.uint8), mask=mask)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    M,
    K,
    stride_xm,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    PER_TENSOR: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < M
    cols = tl.arange(0, BLOCK_K)
    src = rows[:, None] * stride_xm
    dst = rows[:, None] * K
    if PER_TENSOR:
        tensor_bits = tl.load(amax_ptr).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        scale = _scale(tensor_bits + tl.zeros([ROWS], tl.int32), RECIPROCAL)
    if CHUNKS == 1:
        mask = live[:, None] & (cols[None, :] < K)
        x = load_fp32(x_ptr, src + cols[None, :], mask, BF16_BITS)
        if not PER_TENSOR:
            scale = _scale(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), RECIPROCAL)
        _store_codes(q_ptr, dst + cols[None, :], mask, x, scale)
    else:
        if not PER_TENSOR:
            amax_bits = tl.zeros([ROWS], tl.int32)
            for c in range(CHUNKS):
                k = c * BLOCK_K + cols[None, :]
                x = load_fp32(x_ptr, src + k, live[:, None] & (k < K), BF16_BITS)
                amax_bits = tl.maximum(amax_bits, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
            scale = _scale(amax_bits, RECIPROCAL)
        for c in range(CHUNKS):
            k = c * BLOCK_K + cols[None, :]
            mask = live[:, None] & (k < K)
            _store_codes(q_ptr, dst + k, mask, load_fp32(x_ptr, src + k, mask, BF16_BITS), scale)
    if PER_TENSOR:
        tl.store(scale_ptr + tl.arange(0, ROWS), scale, mask=(tl.arange(0, ROWS) == 0) & (pid == 0))
    else:
        tl.store(scale_ptr + rows, scale, mask=live)


def launch_config(M: int, K: int) -> dict[str, int]:
    """BLOCK_K (a power of two >= min(K, 8192)), ROWS per program, CHUNKS per row and num_warps (untuned)."""
    block_k = min(triton.next_power_of_2(K), MAX_BLOCK_K)
    rows = max(1, min(TILE // block_k, triton.next_power_of_2(M)))
    return {
        "BLOCK_K": block_k,
        "ROWS": rows,
        "CHUNKS": triton.cdiv(K, block_k),
        "num_warps": max(4, min(16, rows * block_k // 512)),
    }


def quantize_triton(
    x: Tensor, amax: Tensor | None, *, reciprocal: bool, config: dict[str, int] | None = None
) -> tuple[Tensor, Tensor]:
    """Launch the kernel on ``x`` (M, K), M > 0.

    Args:
        x: (M, K) fp16 / bf16 / fp32 (CUDA, or CPU under TRITON_INTERPRET=1); rows may be strided.
        amax: None for a scale per row, or (1,) fp32 holding the tensor's amax for one scale.
        reciprocal: compute ``amax / 448`` as ``amax * fp32(1/448)`` (torch on CUDA) instead of dividing.
        config: a launch configuration (``BLOCK_K``, ``ROWS``, ``CHUNKS``, ``num_warps``) in place of
            :func:`launch_config`'s, for ``bench.kernels --fp8-sweep``; the codes do not depend on it.

    Returns:
        ``(q, scale)``: q (M, K) ``float8_e4m3fn``; scale (M, 1) fp32 per row, or () per tensor.

    Raises:
        ValueError: a ``config`` whose ``CHUNKS`` blocks of a power-of-two ``BLOCK_K`` do not split the row.
    """
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = x.new_empty((M, K), dtype=torch.uint8)
    scale = x.new_empty((M, 1) if amax is None else (), dtype=torch.float32)
    config = config or launch_config(M, K)
    block_k, chunks = config["BLOCK_K"], config["CHUNKS"]
    if block_k & (block_k - 1) or not (chunks - 1) * block_k < K <= chunks * block_k:
        raise ValueError(f"fp8 launch config {config} does not split rows of K={K} into CHUNKS power-of-two blocks")
    bf16 = x.dtype == torch.bfloat16
    _quantize_kernel[(triton.cdiv(M, config["ROWS"]),)](
        x.view(torch.int16) if bf16 else x,
        q,
        scale,
        scale if amax is None else amax,
        M,
        K,
        x.stride(0),
        PER_TENSOR=amax is not None,
        RECIPROCAL=reciprocal,
        BF16_BITS=bf16,
        **config,
    )
    return q.view(torch.float8_e4m3fn), scale
