"""NVFP4 quantise-dequantise, emulated in fp32: the torch reference, packing, and the dispatcher.

The format, exactly as computed here (the torch reference) and by the Triton kernel
(``nvfp4_triton.py``), bit for bit:

- **Blocks.** ``x`` (..., K) is cut into blocks of 16 consecutive elements along the last
  (reduction) dimension. When K is not a multiple of 16 the last block is padded with zeros
  (zeros never change a block's amax); codes and scales cover the padded length
  ``Kp = 16 * ceil(K / 16)``, and dequantisation drops the padding again.
- **Compute dtype.** Inputs (fp16, bf16, fp32; fp64 is rounded to fp32 first) are quantised in
  fp32; every division is IEEE round-to-nearest (``div_rn`` in the kernel; in the reference a
  divisor is a tensor on x's device, never a Python number, which torch's CUDA kernel would turn
  into a multiplication by its fp32 reciprocal: :func:`_divide`).
- **Tensor scale** (fp32): ``s = max(amax(|x|) / (6 * 448), 2^-117)``. The floor keeps every block
  scale ``q * s`` a normal fp32 number; an all-zero tensor gets ``s = 2^-117`` and all codes 0.
  A NaN or inf anywhere in ``x`` raises ``ValueError`` (the format has no encoding for them).
- **Block scale** (E4M3-fn, in units of ``s``): ``q = e4m3(clamp(amax_b / 6 / s, 2^-9, 448))``,
  rounded to the nearest E4M3 value, ties to even, saturating at 448. The lower clamp (the
  smallest E4M3 subnormal) keeps ``q > 0``, so an all-zero block gets ``q = 2^-9`` and codes 0.
- **Elements** (E2M1): ``y = x / fp32(q * s)``, rounded to the nearest of
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating at 6. A code is 4 bits: sign (bit 3) and
  the magnitude's index 0..7 in that list. Values that round to 0 get code 0 (+0), never -0.
- **Packing.** Two codes per uint8: element ``2i`` in the low nibble, ``2i + 1`` in the high one.
- **Dequantisation:** ``x_hat = (e2m1 * q) * s`` in fp32 (``e2m1 * q`` is exact).

References:
    NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", 2025;
    OCP Microscaling Formats (MX) Specification v1.0, 2023 (E2M1, E4M3); Li et al.,
    "FP4 Explore, BF16 Train: Diffusion Reinforcement Learning via Efficient Rollout Scaling"
    (Sol-RL), arXiv 2604.06916, 2026.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .dispatch import Backend, resolve_backend

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # smallest positive E4M3 (subnormal); block scales are clamped up to it
TENSOR_SCALE_MIN = 2.0**-117  # so that E4M3_MIN * s >= 2^-126, the smallest normal fp32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
# E2M1 rounding boundaries: magnitude index = number of boundaries |y| passes; at a tie the even
# neighbour wins, so the boundary counts as passed (>=) exactly when the upper neighbour is even
E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class NVFP4Tensor(NamedTuple):
    """A tensor in NVFP4: packed E2M1 codes, E4M3 block scales, an fp32 tensor scale.

    Attributes:
        codes: (..., Kp // 2) uint8, two 4-bit codes per byte (even element in the low nibble).
        scales: (..., Kp // 16) ``torch.float8_e4m3fn`` block scales, in units of ``tensor_scale``.
        tensor_scale: () float32 per-tensor scale.
        shape: the original shape (..., K).
    """

    codes: Tensor
    scales: Tensor
    tensor_scale: Tensor
    shape: torch.Size


# --------------------------------------------------------------------------- reference pieces


def _divide(a: Tensor, d: float) -> Tensor:
    """``a / d`` in fp32, rounded once on every device.

    torch's CUDA division by a Python number (a CPU scalar) multiplies by ``fp32(1 / d)``, which can
    round differently (``amax = 0.11132812`` gives ``amax / 6`` on one side of an E4M3 midpoint and
    ``amax * fp32(1 / 6)`` on the other); a 0-d tensor on ``a``'s device takes the true division.
    """
    return a / torch.tensor(d, dtype=torch.float32, device=a.device)


def nvfp4_tensor_scale(x: Tensor) -> Tensor:
    """The fp32 per-tensor scale ``max(amax(|x|) / 2688, 2^-117)``.

    Args:
        x: any floating tensor.

    Returns:
        () float32 on x's device.

    Raises:
        ValueError: x holds NaN or inf.
    """
    amax = x.detach().abs().amax().float()
    if not bool(torch.isfinite(amax)):
        raise ValueError("nvfp4 input holds NaN or inf, which NVFP4 cannot encode; check the tensor before quantising")
    return torch.clamp(_divide(amax, E2M1_MAX * E4M3_MAX), min=TENSOR_SCALE_MIN)


def e4m3_round(r: Tensor) -> Tensor:
    """Round fp32 values in [2^-9, 448] to the nearest E4M3-fn value, ties to even.

    Done on the fp32 bits: keep ``min(3, e + 9)`` mantissa bits (3 for normals, fewer for
    subnormals, whose spacing is 2^-9), adding half an ulp minus one plus the kept lsb. With no
    mantissa bit kept (r in [2^-9, 2^-8)) the kept significand is the implicit 1, so its lsb is 1.

    Args:
        r: float32 tensor, every value in [2^-9, 448].

    Returns:
        float32 tensor of E4M3 values, same shape.
    """
    bits = r.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    shift = 23 - torch.clamp(exponent + 9, max=3)
    lsb = ((bits >> shift) & 1) | (shift == 23).to(torch.int32)
    bits = (bits + (1 << (shift - 1)) - 1 + lsb) & -(1 << shift)
    return bits.view(torch.float32)


def e4m3_bits(q: Tensor) -> Tensor:
    """Encode positive E4M3 values (as from :func:`e4m3_round`) as their uint8 bit patterns."""
    bits = q.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    normal = ((exponent + 7) << 3) | ((bits >> 20) & 7)
    return torch.where(q >= 2.0**-6, normal, (q * 512).to(torch.int32)).to(torch.uint8)


def e2m1_codes(y: Tensor) -> Tensor:
    """Round fp32 ``y`` to E2M1 (nearest, ties to even, saturating at 6) and return 4-bit codes as uint8."""
    a = y.abs()
    magnitude = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for bound, tie_up in E2M1_BOUNDS:
        magnitude += (a >= bound if tie_up else a > bound).to(torch.int32)
    negative = (y < 0) & (magnitude > 0)
    return (magnitude | (negative.to(torch.int32) << 3)).to(torch.uint8)


def e2m1_values(codes: Tensor) -> Tensor:
    """Decode 4-bit E2M1 codes (uint8, values 0..15) to float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([table, -table])
    return table[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack 4-bit codes (..., 2n) uint8 into (..., n) uint8: element 2i low nibble, 2i + 1 high.

    Raises:
        ValueError: the last dimension is odd, or the dtype is not uint8.
    """
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs uint8 codes with an even last dim; got {codes.dtype} {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Unpack (..., n) uint8 into (..., 2n) uint8 4-bit codes; the inverse of :func:`pack_fp4`."""
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise ValueError(f"unpack_fp4 needs a uint8 tensor with at least one dim; got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: Tensor) -> Tensor:
    """(..., K) -> (..., Kp / 16, 16) float32, zero-padded to a multiple of 16."""
    x32 = F.pad(x.float(), (0, (-x.shape[-1]) % BLOCK_SIZE))
    return x32.reshape(*x32.shape[:-1], -1, BLOCK_SIZE)


def nvfp4_quantize_reference(x: Tensor) -> NVFP4Tensor:
    """Plain-torch NVFP4 quantisation (the format in the module docstring).

    Args:
        x: (..., K) floating tensor, at least 1-d, finite.

    Returns:
        The :class:`NVFP4Tensor`.
    """
    s = nvfp4_tensor_scale(x)
    xb = _blocks(x)
    r = torch.clamp(_divide(xb.abs().amax(dim=-1), E2M1_MAX) / s, E4M3_MIN, E4M3_MAX)
    q = e4m3_round(r)
    codes = e2m1_codes(xb / (q * s).unsqueeze(-1))
    return NVFP4Tensor(pack_fp4(codes.flatten(-2)), e4m3_bits(q).view(torch.float8_e4m3fn), s, x.shape)


def nvfp4_dequantize_reference(q: NVFP4Tensor) -> Tensor:
    """Plain-torch NVFP4 dequantisation: ``(e2m1 * block_scale) * tensor_scale``, float32 of ``q.shape``."""
    values = e2m1_values(unpack_fp4(q.codes)).reshape(*q.scales.shape, BLOCK_SIZE)
    out = (values * q.scales.float().unsqueeze(-1)) * q.tensor_scale
    return out.flatten(-2)[..., : q.shape[-1]].reshape(q.shape)


# --------------------------------------------------------------------------- dispatchers


def _check_input(x: Tensor) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"nvfp4 quantises floating tensors; got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"nvfp4 needs a non-empty tensor with at least 1 dim; got shape {tuple(x.shape)}")


def nvfp4_quantize(x: Tensor, *, backend: Backend = "auto") -> NVFP4Tensor:
    """Quantise ``x`` to NVFP4 (module docstring), with the Triton kernel or the torch reference.

    Cost per element of fp32 input (K a multiple of 16), with ``b`` the input's bytes per element:
    bytes moved ``2b + 9/16`` (the tensor-amax pass reads x, the kernel reads x and writes codes
    and scales: 8.56 B fp32, 4.56 B bf16); about 20 ALU operations (abs, max, one division,
    7 comparisons and adds, sign, pack). Intensity ~2.3 op/B is far below an H100's ridge point
    (67 TFLOP/s / 3.35 TB/s = 20 FLOP/B), so the kernel is memory-bound: a 3072 x 3072 fp32
    weight (80.8 MB) takes >= 24 us, bf16 (43.1 MB) >= 12.9 us on an H100 SXM.

    Args:
        x: (..., K) fp16 / bf16 / fp32 (fp64 is rounded to fp32) tensor, finite, at least 1-d.
        backend: "auto", "torch" or "triton" (:func:`flowrl.kernels.dispatch.resolve_backend`).

    Returns:
        :class:`NVFP4Tensor` with codes (..., Kp / 2) uint8, scales (..., Kp / 16) float8_e4m3fn.

    Raises:
        TypeError: x is not a floating tensor.
        ValueError: x is empty, 0-d, or holds NaN/inf.
    """
    _check_input(x)
    if resolve_backend(backend, x) == "torch":
        return nvfp4_quantize_reference(x)
    from .nvfp4_triton import quantize_triton

    s = nvfp4_tensor_scale(x)
    codes, scales, _ = quantize_triton(_as_kernel_input(x), s, write_codes=True, write_values=False)
    return NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), s, x.shape)


def nvfp4_dequantize(q: NVFP4Tensor, *, dtype: torch.dtype = torch.float32, backend: Backend = "auto") -> Tensor:
    """Dequantise an :class:`NVFP4Tensor` (from :func:`nvfp4_quantize`) to ``dtype``.

    Bytes moved per element: 9/16 read + 4 written (fp32) = 4.56 B; ~6 ALU operations. An
    H100 SXM writes a 3072 x 3072 fp32 tensor (43.1 MB) in >= 12.9 us (memory-bound).

    Args:
        q: the quantised tensor.
        dtype: output dtype (values are computed in fp32 and then cast).
        backend: "auto", "torch" or "triton".

    Returns:
        Tensor of ``q.shape`` in ``dtype``.
    """
    if resolve_backend(backend, q.codes) == "torch":
        return nvfp4_dequantize_reference(q).to(dtype)
    from .nvfp4_triton import dequantize_triton

    return dequantize_triton(q.codes, q.scales.view(torch.uint8), q.tensor_scale, q.shape).to(dtype)


def nvfp4_fake_quantize(x: Tensor, *, backend: Backend = "auto") -> Tensor:
    """Quantise-dequantise ``x`` through NVFP4 in one pass; same shape and dtype as ``x``.

    Equals ``nvfp4_dequantize(nvfp4_quantize(x)).to(x.dtype)`` bit for bit. Bytes moved per element:
    ``3b`` (amax pass, read, write: 12 B fp32, 6 B bf16); ~27 ALU operations; memory-bound on an
    H100 SXM: a 3072 x 3072 bf16 weight (56.6 MB) in >= 16.9 us.

    Args:
        x: (..., K) floating tensor, finite, at least 1-d.
        backend: "auto", "torch" or "triton".

    Returns:
        The NVFP4-representable tensor nearest to ``x`` under the format, in ``x.dtype``.
    """
    _check_input(x)
    if resolve_backend(backend, x) == "torch":
        return nvfp4_dequantize_reference(nvfp4_quantize_reference(x)).to(x.dtype)
    from .nvfp4_triton import quantize_triton

    kernel_input = _as_kernel_input(x)
    _, _, out = quantize_triton(kernel_input, nvfp4_tensor_scale(x), write_codes=False, write_values=True)
    return out.to(x.dtype)


def _as_kernel_input(x: Tensor) -> Tensor:
    """fp64 rounds to fp32 (the compute dtype); other float dtypes go to the kernel as they are."""
    return x.float() if x.dtype == torch.float64 else x


def nvfp4_bytes(numel: int, itemsize: int, op: str) -> int:
    """Bytes an NVFP4 op moves for ``numel`` elements of ``itemsize`` bytes (K a multiple of 16).

    ``op`` is "quantize" (amax read + read + codes + scales), "dequantize" (codes + scales read,
    fp32 written) or "fake_quantize" (amax read + read + write).
    """
    meta = numel // 2 + numel // BLOCK_SIZE
    sizes = {
        "quantize": 2 * numel * itemsize + meta,
        "dequantize": meta + 4 * numel,
        "fake_quantize": 3 * numel * itemsize,
    }
    if op not in sizes:
        raise ValueError(f"op must be one of {sorted(sizes)}; got {op!r}")
    return sizes[op]
