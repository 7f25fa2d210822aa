"""Where the kernel tests run each Triton kernel: on CPU tensors in Triton's interpreter, and compiled
on CUDA (``cuda`` marker) where a GPU is present. Test modules parametrize ``device`` with ``DEVICES``.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and torch's ``FlopCounterMode`` (which
bench modules imported by other tests use) imports triton, so the root ``tests/conftest.py`` sets the
variable before any test module is collected; it is set here too for a run of this folder alone. On a
CUDA machine it is left unset, so the kernels compile for the GPU and the interpreter cases skip
(export TRITON_INTERPRET=1 to run them).
(A plain module, not a conftest.py: tests import the root conftest by the bare name ``conftest``.)
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flowrl.kernels import interpreting, triton_installed  # noqa: E402

_NO_TRITON = pytest.mark.skipif(not triton_installed(), reason="needs triton (pip install flowrl[kernels])")

DEVICES = [
    pytest.param(
        "cpu",
        id="interpreter",
        marks=[_NO_TRITON, pytest.mark.skipif(not interpreting(), reason="set TRITON_INTERPRET=1 for the interpreter")],
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[_NO_TRITON, pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def cpu_scaled_mm_supports(scaling: str) -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes ``scaling`` (2.13 takes both; 2.11 per-tensor only)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale = torch.ones(16, 1) if scaling == "row" else torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True
