"""FP8 E4M3 for explore models: fake quantisation (any device) and a ``torch._scaled_mm`` Linear (CUDA).

Scales are amax scales per tensor or per row (the last dim): ``scale = amax / 448`` (1 where amax
is 0); values are cast with torch's round-to-nearest-even ``float8_e4m3fn`` conversion after
clamping to +-448.

References:
    Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (E4M3).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

# the torch reference (fp8_quantize) lives beside its kernel; imported here for the weights and the emulation
from ..kernels.fp8 import FP8_MAX, fp8_quantize, fp8_quantize_op, fp8_quantize_rows, fp8_quantize_tensor
from .shared_input import SharedInput

__all__ = ["FP8_MAX", "ScaledMMLinear", "check_scaled_mm", "fp8_fake_quantize", "fp8_quantize"]


def check_scaled_mm(device: torch.device, activations: bool) -> None:
    """Raise a one-line ValueError unless ``torch._scaled_mm`` FP8 can run for a policy on ``device``."""
    if device.type != "cuda":
        raise ValueError(f"fp8_e4m3 with emulate=False needs CUDA (torch._scaled_mm); the policy is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"torch._scaled_mm needs compute capability >= 8.9; this GPU is {major}.{minor}; emulate=True")
    if activations:
        raise ValueError("fp8_e4m3 with emulate=False always quantises activations; leave activations=False")


def fp8_fake_quantize(x: Tensor, scaling: Literal["tensor", "row"] = "tensor") -> Tensor:
    """Quantise-dequantise through FP8 E4M3 with an amax scale per tensor or per row (last dim).

    ``scale = amax / 448`` (1 where amax is 0), ``q = e4m3(clamp(x / scale, -448, 448))`` (torch's
    round-to-nearest-even cast), ``x_hat = q * scale``; same shape and dtype as ``x``.

    Raises:
        ValueError: ``x`` holds NaN or inf.
    """
    if not bool(torch.isfinite(x).all()):  # a NaN amax would fall back to scale 1 and pass unseen
        raise ValueError("fp8_e4m3 input holds NaN or inf; check the tensor before quantising")
    q, scale = fp8_quantize(x, scaling)
    return (q.float() * scale).to(x.dtype)


class ScaledMMLinear(nn.Module):
    """An FP8 E4M3 Linear on ``torch._scaled_mm`` (CUDA, compute capability >= 8.9).

    Weights are quantised once per tensor or per output row (:func:`fp8_quantize`); inputs are
    quantised dynamically per tensor or per row by the fused kernel (bit-identical to
    :func:`fp8_quantize`: one read of the input instead of ~7 eager passes), called directly in eager
    code and through the operator ``torch.ops.flowrl.fp8_quantize``
    (:func:`flowrl.kernels.fp8.fp8_quantize_op`) when traced: ``torch.compile`` sees it as one node,
    so the Linear compiles into one graph. Rows are not padded:
    ``torch._scaled_mm`` needs K and N (not M) divisible by 16. The product comes back in bf16;
    for bf16 inputs the bias is added in ``_scaled_mm``'s epilogue (fp32, one rounding), for other
    inputs it is cast to the input's dtype and the bias added after, as before.

    ``fuse_under_compile``: inside ``torch.compile`` quantise with the torch reference's operators
    (:func:`fp8_quantize`) instead of the opaque kernel operator, so the compiler can fuse the
    quantisation into the operator that produced ``x`` (a norm, a modulation) rather than read ``x``
    back from memory; eager calls still run the kernel. Compiled code may round the scale or a
    quotient differently from eager in the last bit, as any compiled operator may. Off by default
    until measured on a GPU (docs/kernels.md).

    ``shared_input``: a :class:`~flowrl.policy.shared_input.SharedInput` shared by the model's FP8
    layers; a layer that reads the tensor the previous one quantised (q / k / v) takes its codes and
    scales instead of quantising again (eager only; bit for bit the same output).

    ``fast_accum``: ``torch._scaled_mm``'s ``use_fast_accum``: Hopper's FP8 tensor cores accumulate in
    their own reduced-precision accumulator without promoting partial sums to fp32 every few K-steps,
    as inference stacks do in the forward pass (Transformer Engine's fprop, torchao's float8
    inference). Faster GEMMs, a slightly less exact sum; off by default until measured on a GPU
    (``bench.fp8_explore``'s ``:fastacc`` variants, docs/gpu-session.md).
    """

    def __init__(
        self,
        linear: nn.Linear,
        scaling: str,
        *,
        fuse_under_compile: bool = False,
        shared_input: SharedInput | None = None,
        fast_accum: bool = False,
    ):
        super().__init__()
        self.scaling = scaling
        self.fuse_under_compile = fuse_under_compile
        self.shared_input = shared_input
        self.fast_accum = fast_accum
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = fp8_quantize(linear.weight.detach(), scaling)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale.reshape(1, -1) if scaling == "row" else scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_features) -> (..., out_features) in x's dtype."""
        if self.fuse_under_compile and torch.compiler.is_compiling():
            q, scale = fp8_quantize(x.reshape(-1, self.in_features), self.scaling)  # operators the compiler can fuse
        elif self.shared_input is None:
            q, scale = self._quantize(x)
        else:  # q / k / v read one tensor: quantise it once
            q, scale = self.shared_input.get(x, ("fp8_e4m3", self.scaling), self._quantize)
        fused = self.bias is not None and x.dtype == torch.bfloat16  # out_dtype bf16 takes only a bf16 bias
        bias = self.bias.to(torch.bfloat16) if fused else None
        out = torch._scaled_mm(
            q,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=bias,
            out_dtype=torch.bfloat16,
            use_fast_accum=self.fast_accum,
        )
        out = out.to(x.dtype)
        out = out if self.bias is None or fused else out + self.bias.to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(M, K) E4M3 codes and their scales of ``x`` as rows, by the fused kernel.

        Traced, through its registered operator (one graph node, no break); eager, by direct call: the
        operator's dispatch costs ~16 us a call on this project's CPU (28 against 45 us for a small input),
        for the same bits.
        """
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            return fp8_quantize_op(rows, self.scaling)
        return fp8_quantize_rows(rows) if self.scaling == "row" else fp8_quantize_tensor(rows)
