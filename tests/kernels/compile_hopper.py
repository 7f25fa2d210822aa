"""Compile the fused Triton kernels for the H100 (sm_90) without a GPU; print what came out as JSON.

Run as a script by ``test_compile_hopper.py`` in a process without ``TRITON_INTERPRET`` (with it set,
``@triton.jit`` builds interpreted functions, which cannot be lowered). One JSON object on stdout:
variant name -> {"cubin_bytes": int, "ops": sorted division / square-root / reciprocal PTX opcodes}.
"""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flowrl.kernels import flow_sde_triton, fp8_triton

OPS = re.compile(r"\b((?:div|sqrt|rcp)\.[a-z]+(?:\.ftz)?\.f32)")
FP8_SIGNATURE = {
    "q_ptr": "*u8",
    "scale_ptr": "*fp32",
    "amax_ptr": "*fp32",
    "M": "i32",
    "K": "i32",
    "stride_xm": "i64",
    **dict.fromkeys(("BLOCK_K", "ROWS", "CHUNKS", "PER_TENSOR", "RECIPROCAL", "BF16_BITS"), "constexpr"),
}
SDE_SIGNATURE = {
    **dict.fromkeys(("x_ptr", "v_ptr", "eps_ptr", "sample_ptr", "mean_ptr", "std_ptr", "out_ptr"), "*fp32"),
    **dict.fromkeys(("sigma_stride", "sigma_next_stride", "level_stride"), "i32"),
    **dict.fromkeys(("x_stride", "v_stride", "eps_stride"), "i64"),
    "N": "i32",
    "scale": "fp32",
    "half_log_2pi": "fp32",
    **dict.fromkeys(
        ("blocks", "BLOCK", "SIGMA_VEC", "SIGMA_NEXT_VEC", "LEVEL_VEC", "SCORE", "WRITE_SAMPLE"), "constexpr"
    ),
}


def compiled(fn: object, signature: dict, constexprs: dict) -> dict:
    """Cubin size and the fp32 division / square-root / reciprocal opcodes of ``fn`` built for sm_90."""
    asm = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    ).asm
    return {"cubin_bytes": len(asm["cubin"]), "ops": sorted(set(OPS.findall(asm["ptx"])))}


def fp8_variant(shape: tuple[int, int], per_tensor: bool, bf16: bool) -> dict:
    config = fp8_triton.launch_config(*shape)
    config.pop("num_warps")
    signature = {"x_ptr": "*i16" if bf16 else "*fp32", **FP8_SIGNATURE}
    flags = {**config, "PER_TENSOR": per_tensor, "RECIPROCAL": True, "BF16_BITS": bf16}
    return compiled(fp8_triton._quantize_kernel, signature, flags)


def sde_variant(per_sample: bool, score: bool, blocks: int) -> dict:
    coefficient = "*fp32" if per_sample else "fp32"
    signature = {**SDE_SIGNATURE, **dict.fromkeys(("sigma_arg", "sigma_next_arg", "level_arg"), coefficient)}
    vec = dict.fromkeys(("SIGMA_VEC", "SIGMA_NEXT_VEC", "LEVEL_VEC"), per_sample)
    flags = {"blocks": blocks, "BLOCK": flow_sde_triton.BLOCK, **vec, "SCORE": score, "WRITE_SAMPLE": not score}
    return compiled(flow_sde_triton._flow_sde_kernel, signature, flags)


VARIANTS = {
    "fp8 row bf16 21712x1536": lambda: fp8_variant((21712, 1536), False, True),
    "fp8 tensor bf16 21712x6144": lambda: fp8_variant((21712, 6144), True, True),
    "fp8 row fp32 3x8195 (two passes)": lambda: fp8_variant((3, 8195), False, False),
    "flow_sde sample, float sigma": lambda: sde_variant(False, False, 1),
    "flow_sde score, (B,) sigma, 4 blocks": lambda: sde_variant(True, True, 4),
}

if __name__ == "__main__":
    print(json.dumps({name: build() for name, build in VARIANTS.items()}))
