"""The native NVFP4 path's weight encoding (torchao) against our NVFP4 reference, on the CPU.

``precision="native_nvfp4"`` hands the explore copy's Linear layers to torchao's
``NVFP4DynamicActivationNVFP4WeightConfig``, whose weights are ``NVFP4Tensor.to_nvfp4`` of the weight with a
per-tensor scale ``amax / (448 * 6)``, computed in torch. This script encodes the same tensors both ways and
counts where the E2M1 codes, the E4M3 block scales and the fp32 tensor scale differ, and each side's relative
L2 error (docs/kernels.md, "The native path's encoding against our NVFP4 reference").
``tests/core/test_native_nvfp4.py`` pins what the table shows.

Usage (torchao is not in the main venv: put it on the path, as README command (b) does)::

    .venv/bin/pip install -q --no-deps --target .venv/torchao torchao==0.18.0
    PYTHONPATH=.venv/torchao python -m bench.nvfp4_torchao [--seeds 0 1]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from torch import Tensor

from flowrl.kernels import nvfp4_dequantize, nvfp4_quantize, unpack_fp4
from flowrl.kernels.nvfp4 import BLOCK_SIZE, E2M1_BOUNDS

NEGATIVE_ZERO = 8  # E2M1 code of -0, which torchao writes for a negative value that rounds to zero

CASES: dict[str, Callable[[torch.Generator], Tensor]] = {
    "N(0, 1), 1536 x 1536 fp32": lambda g: torch.randn(1536, 1536, generator=g),
    "N(0, 0.02), 3072 x 1536 fp32": lambda g: torch.randn(3072, 1536, generator=g) * 0.02,
    "N(0, 1), 1536 x 1536 bf16": lambda g: torch.randn(1536, 1536, generator=g).to(torch.bfloat16),
    "N(0, 1), 512 x 1536 bf16": lambda g: torch.randn(512, 1536, generator=g).to(torch.bfloat16),
    "N(0, 1), one channel x 300, 512 x 1536": lambda g: (
        torch.randn(512, 1536, generator=g) * torch.where(torch.arange(1536) == 7, 300.0, 1.0)
    ),
    "Student-t (2 d.o.f.), 1024 x 1024": lambda g: (
        torch.randn(1024, 1024, generator=g) / torch.sqrt(-torch.log1p(-torch.rand(1024, 1024, generator=g)))
    ),  # chi2(2) / 2 = Exp(1) = -log(1 - U)
    "N(0, 1), 256 x 1536, one entry 1e5": lambda g: torch.randn(256, 1536, generator=g).index_put_(
        (torch.tensor([0]), torch.tensor([0])), torch.tensor([1e5])
    ),
}


def at_ties(w: Tensor, scales: Tensor, rel: float = 1e-6) -> Tensor:
    """Where ``|w| / block scale`` (scales: (M, K / 16) fp32) is on an E2M1 rounding boundary: ``w.shape`` bool."""
    y = (w.float().reshape(*scales.shape, BLOCK_SIZE) / scales.unsqueeze(-1)).abs().reshape(w.shape)
    return torch.stack([(y - b).abs() <= rel * b for b, _ in E2M1_BOUNDS]).any(dim=0)


def torchao_encode(w: Tensor, swizzled: bool = False) -> Any:
    """Torchao's NVFP4Tensor of ``w`` (M, K) as its dynamic weight config stores it (two-level scales, torch path)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    scale = per_tensor_amax_to_scale(w.abs().max())
    return NVFP4Tensor.to_nvfp4(w, per_tensor_scale=scale, is_swizzled_scales=swizzled, use_triton_kernel=False)


def torchao_codes(t: Any) -> Tensor:
    """E2M1 codes of a torchao NVFP4Tensor, its shape, with its -0 (code 8) read as +0 as ours writes it."""
    codes = unpack_fp4(t.qdata.contiguous().view(torch.uint8)).reshape(t.shape)
    return torch.where(codes == NEGATIVE_ZERO, torch.zeros_like(codes), codes)


def compare(w: Tensor) -> dict[str, object]:
    """Encode ``w`` (M, K) with torchao and with ``nvfp4_quantize``; the counts and errors of one table row."""
    theirs, ours = torchao_encode(w), nvfp4_quantize(w, backend="torch")
    scale = theirs.per_tensor_scale
    their_scales, our_scales = theirs.scale.view(torch.uint8).reshape(-1), ours.scales.view(torch.uint8).reshape(-1)
    reference = w.float()

    def error(x_hat: Tensor) -> float:
        return float((x_hat - reference).norm() / reference.norm())

    differ = torchao_codes(theirs) != unpack_fp4(ours.codes).reshape(w.shape)
    ties = at_ties(w, ours.scales.float() * ours.tensor_scale)
    return {
        "codes": (int(differ.sum()), int(ties.sum()), int((differ & ~ties).sum()), w.numel()),
        "scales": (int((their_scales != our_scales).sum()), our_scales.numel()),
        "tensor_scale": bool(torch.equal(scale.view(torch.int32), ours.tensor_scale.view(torch.int32))),
        "error": (error(theirs.dequantize(torch.float32)), error(nvfp4_dequantize(ours, backend="torch"))),
    }


def main(argv: list[str] | None = None) -> None:
    """Print the table (markdown) for every case."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of each case's generator")
    args = parser.parse_args(argv)
    import torchao

    print(f"torchao {torchao.__version__}, torch {torch.__version__}\n")
    print(
        "| data | seed | codes that differ | codes at E2M1 ties | differ off a tie | block scales that differ "
        "| tensor scale | rel. L2 error, torchao / ours |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, make in CASES.items():
        for seed in args.seeds:
            row = compare(make(torch.Generator().manual_seed(seed)))
            (codes, ties, off_tie, n), (scales, m), (e_theirs, e_ours) = row["codes"], row["scales"], row["error"]
            same = "equal" if row["tensor_scale"] else "differs"
            print(
                f"| {name} | {seed} | {codes:,} of {n:,} | {ties:,} | {off_tie:,} | {scales:,} of {m:,} | {same} "
                f"| {e_theirs:.5f} / {e_ours:.5f} |"
            )


if __name__ == "__main__":
    main()
