"""FP8 E4M3 activation quantisation per row or per tensor: the dispatcher around one Triton kernel.

What is computed, exactly as :func:`fp8_quantize` (the torch reference, also the quantiser of the
weights in :mod:`flowrl.policy.fp8`) computes it on the tensor's device, bit for bit:

- **Compute dtype.** ``x`` (M, K) (fp16, bf16, fp32; fp64 is rounded to fp32 first) is upcast to
  fp32 (exact for fp16 / bf16).
- **Scale** (fp32): ``scale = amax / 448`` with ``amax = max |x|`` over each row (``"row"``: (M, 1))
  or over the tensor (``"tensor"``: ()); 1 where amax is 0 or NaN (the reference's
  ``where(amax > 0, ...)``), inf where amax is inf. On CUDA torch divides by a Python scalar as a
  multiplication by ``fp32(1 / 448)`` (ATen's ``div_true_kernel_cuda`` reciprocal shortcut), on CPU
  it divides; the kernel does the same on each device, so the scales match the reference there.
- **Values**: ``q = e4m3fn(clamp(x / scale, -448, 448))``, IEEE division, rounded to the nearest
  E4M3 value with ties to even, saturating at +-448; the sign of zero is kept (-0 -> 0x80). A NaN
  element gives a NaN code (0x7F with some sign bit; the sign of a NaN is not specified).

NaN and inf inputs are not rejected (the reference does not reject them; checking would cost a
device sync per call): they give the reference's scales and codes as above.

Costs per element (bf16 input, K <= 8192): the row kernel reads 2 B and writes 1 B, plus 4 B of
scale per row; the per-tensor variant adds one read of ``x`` by ``torch.aminmax`` (5 B in all).
About 25 integer / fp32 operations per element (one IEEE division, the rest integer rounding), so
~8 op/B, below an H100's ridge point (67 TFLOP/s / 3.35 TB/s = 20 FLOP/B): memory-bound, a
21712 x 6144 bf16 activation (400 MB moved) takes >= 119 us on an H100 SXM.

References:
    Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433, 2022 (E4M3: 4 exponent
    bits, bias 7, 3 mantissa bits, no infinities, max 448, NaN = S.1111.111).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import Backend, resolve_backend

FP8_MAX = 448.0
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fp8_quantize(x: Tensor, scaling: str) -> tuple[Tensor, Tensor]:
    """Quantise to FP8 E4M3: ``(q, scale)`` with ``x ~= q * scale``.

    Args:
        x: (..., K) floating tensor.
        scaling: "tensor" (one scale) or "row" (one per row of the last dim).

    Returns:
        q in ``float8_e4m3fn`` of x's shape, and the fp32 scale: () or (..., 1).
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True) if scaling == "row" else x32.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _check_input(x: Tensor, scaling: str) -> None:
    if not isinstance(x, Tensor) or x.dtype not in _DTYPES:
        raise TypeError(f"fp8 quantises fp16 / bf16 / fp32 / fp64 tensors; got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"fp8 {scaling} quantisation needs a 2-D (M, K) tensor with K > 0; got shape {tuple(x.shape)}")
    if scaling == "tensor" and x.shape[0] == 0:
        raise ValueError("fp8 tensor quantisation needs a non-empty tensor; got 0 rows")


def scale_by_reciprocal(x: Tensor) -> bool:
    """Whether torch computes ``amax / 448`` on ``x``'s device as ``amax * fp32(1 / 448)`` (CUDA) or divides (CPU)."""
    return x.is_cuda


def fp8_quantize_rows(x: Tensor, *, backend: Backend = "auto") -> tuple[Tensor, Tensor]:
    """Quantise each row of ``x`` to FP8 E4M3 with its own amax scale (module docstring), in one pass.

    Equals ``fp8_quantize(x, "row")`` bit for bit (codes and scales). The kernel
    reads each row once and writes its codes and scale: 3 B per bf16 element + 4 B per row
    (5 B fp32), against ~30 B for the eager reference.

    Args:
        x: (M, K) fp16 / bf16 / fp32 (fp64 is rounded to fp32) tensor; rows may be strided.
        backend: "auto", "torch" or "triton" (:func:`flowrl.kernels.dispatch.resolve_backend`).

    Returns:
        ``(q, scale)``: q (M, K) ``torch.float8_e4m3fn``, scale (M, 1) float32, ``x ~= q * scale``.

    Raises:
        TypeError: x is not an fp16 / bf16 / fp32 / fp64 tensor.
        ValueError: x is not 2-D, has K == 0, or the backend is unknown / cannot run.
    """
    _check_input(x, "row")
    if resolve_backend(backend, x) == "torch" or x.shape[0] == 0:
        return fp8_quantize(x, "row")
    from .fp8_triton import quantize_triton

    return quantize_triton(_as_kernel_input(x), None, reciprocal=scale_by_reciprocal(x))


def fp8_quantize_tensor(x: Tensor, *, backend: Backend = "auto") -> tuple[Tensor, Tensor]:
    """Quantise ``x`` to FP8 E4M3 with one amax scale for the whole tensor (module docstring).

    Equals ``fp8_quantize(x, "tensor")`` bit for bit. Two passes: ``torch.aminmax``
    reads ``x`` once for the amax (exact, NaN-propagating, no copy), then the row kernel runs with
    that one amax: 5 B per bf16 element moved (read, read, write), against ~30 B for the reference.

    Args:
        x: (M, K) fp16 / bf16 / fp32 (fp64 is rounded to fp32) tensor, M > 0.
        backend: "auto", "torch" or "triton".

    Returns:
        ``(q, scale)``: q (M, K) ``torch.float8_e4m3fn``, scale () float32.

    Raises:
        TypeError: x is not an fp16 / bf16 / fp32 / fp64 tensor.
        ValueError: x is not 2-D, is empty, or the backend is unknown / cannot run.
    """
    _check_input(x, "tensor")
    if resolve_backend(backend, x) == "torch":
        return fp8_quantize(x, "tensor")
    from .fp8_triton import quantize_triton

    xk = _as_kernel_input(x)
    low, high = torch.aminmax(xk)
    amax = torch.maximum(-low, high).float().reshape(1)  # exact: negation and max do not round
    return quantize_triton(xk, amax, reciprocal=scale_by_reciprocal(x))


@torch.library.custom_op("flowrl::fp8_quantize", mutates_args=())
def fp8_quantize_op(x: Tensor, scaling: str) -> tuple[Tensor, Tensor]:
    """:func:`fp8_quantize_rows` / :func:`fp8_quantize_tensor` as one opaque torch operator.

    ``torch.ops.flowrl.fp8_quantize(x, "row" | "tensor")``. ``torch.compile`` traces a call to it as a
    single node (its fake implementation gives the output shapes) instead of stepping into the
    dispatcher and the Triton launch, so an FP8 Linear compiles into one graph with no break, and its
    body runs the fused kernel on CUDA (the reference elsewhere) inside compiled code and CUDA graphs.

    Args:
        x: (M, K) fp16 / bf16 / fp32 / fp64 tensor (M > 0 for "tensor").
        scaling: "row" or "tensor".

    Returns:
        ``(q, scale)`` as the function it calls: q (M, K) ``float8_e4m3fn``; scale (M, 1) or () fp32.

    Raises:
        ValueError: an unknown ``scaling``, or what the function it calls raises.
    """
    if scaling not in ("row", "tensor"):
        raise ValueError(f"scaling must be 'row' or 'tensor'; got {scaling!r}")
    return fp8_quantize_rows(x) if scaling == "row" else fp8_quantize_tensor(x)


@fp8_quantize_op.register_fake
def _fp8_quantize_fake(x: Tensor, scaling: str) -> tuple[Tensor, Tensor]:
    """Output shapes and dtypes of :func:`fp8_quantize_op`, for tracing."""
    scale_shape = (x.shape[0], 1) if scaling == "row" else ()
    q = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return q, x.new_empty(scale_shape, dtype=torch.float32)


def _as_kernel_input(x: Tensor) -> Tensor:
    """fp64 rounds to fp32 (as the reference's ``x.float()``); other dtypes go to the kernel as they are."""
    return x.float() if x.dtype == torch.float64 else x


def fp8_bytes(rows: int, cols: int, itemsize: int, scaling: str = "row") -> int:
    """Bytes the fused quantiser moves for an (rows, cols) input of ``itemsize`` bytes per element.

    "row": read x, write the codes, write one fp32 scale per row; "tensor": one more read of x
    (the amax pass) and a single fp32 scale.
    """
    if scaling not in ("row", "tensor"):
        raise ValueError(f"scaling must be 'row' or 'tensor'; got {scaling!r}")
    numel = rows * cols
    if scaling == "row":
        return numel * (itemsize + 1) + 4 * rows
    return numel * (2 * itemsize + 1) + 4
