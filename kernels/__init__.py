"""Fused kernels (installed as ``flowrl.kernels``), each a Triton kernel beside its plain-torch reference.

- :mod:`~flowrl.kernels.nvfp4`: NVFP4 quantise / dequantise / fake-quantise (emulated E2M1 values
  with E4M3 block scales and an fp32 tensor scale), bit-exact between Triton and torch, plus
  packing of two 4-bit codes per byte. Used by the Sol-RL explore model
  (:mod:`flowrl.policy.precision`).
- :mod:`~flowrl.kernels.fp8`: FP8 E4M3 quantisation of activations per row or per tensor in one
  read, bit-exact against :func:`flowrl.kernels.fp8.fp8_quantize`; the input side of
  ``ScaledMMLinear`` (Sol-RL's FP8 explore copy on ``torch._scaled_mm``).
- :mod:`~flowrl.kernels.flow_sde`: the Flow-SDE step and its log-prob in one pass, against
  :data:`flowrl.samplers.flow_sde_step`.

Every public function takes ``backend="auto" | "torch" | "triton"``
(:func:`~flowrl.kernels.dispatch.resolve_backend`): Triton on CUDA tensors, or on CPU tensors in
Triton's interpreter when ``TRITON_INTERPRET=1`` is set; the torch reference everywhere else.
triton is imported lazily, so importing this package never imports it and CPU installs need no
triton. Costs and H100 rooflines are in each function's docstring; measurements in ``docs/kernels.md``.
"""

from .dispatch import Backend, interpreting, resolve_backend, triton_installed
from .flow_sde import fused_flow_sde_step
from .fp8 import fp8_quantize_op, fp8_quantize_rows, fp8_quantize_tensor
from .nvfp4 import (
    NVFP4Tensor,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    nvfp4_tensor_scale,
    pack_fp4,
    unpack_fp4,
)

__all__ = [
    "Backend",
    "NVFP4Tensor",
    "fp8_quantize_op",
    "fp8_quantize_rows",
    "fp8_quantize_tensor",
    "fused_flow_sde_step",
    "interpreting",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
    "nvfp4_quantize",
    "nvfp4_tensor_scale",
    "pack_fp4",
    "resolve_backend",
    "triton_installed",
    "unpack_fp4",
]
