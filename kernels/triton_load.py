"""Triton load helper of the bit-exact kernels (:mod:`~flowrl.kernels.fp8_triton`, ``nvfp4_triton``).

Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU tests run) flushes bf16 subnormals to
zero when it casts bf16 to fp32, so a kernel that must match its torch reference bit for bit takes
bf16 inputs as int16 bits and widens them by a shift, which is exact for every bf16 value
(subnormals, infinities and NaNs included). fp16 and fp32 load as they are.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_fp32(x_ptr, offsets, mask, BF16_BITS: tl.constexpr):
    """Load x as fp32 (masked lanes 0); with ``BF16_BITS`` x_ptr points at bf16 bits viewed as int16."""
    if BF16_BITS:
        raw = tl.load(x_ptr + offsets, mask=mask, other=0).to(tl.int32)
        return (raw << 16).to(tl.float32, bitcast=True)
    return tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
