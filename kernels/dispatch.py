"""Which implementation a kernel call runs: the Triton kernel or its plain-torch reference.

``"auto"`` picks Triton for CUDA tensors when triton is installed, and also for CPU tensors when
``TRITON_INTERPRET=1`` is set (Triton's interpreter, used by the CPU tests); everything else runs
the torch reference. triton itself is never imported here: :func:`triton_installed` only looks
the package up, and the ``*_triton`` modules that ``import triton`` are imported by the
dispatchers on first use.

The interpreter is chosen when ``@triton.jit`` runs, i.e. when a ``*_triton`` module is first
imported, so ``TRITON_INTERPRET=1`` must be set before the first Triton call of the process.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import Literal

from torch import Tensor

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


@lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (looked up, not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is on, so Triton kernels run on CPU tensors in the interpreter.

    On means 1 / true / yes / on / y in any case: the spellings Triton itself reads as on.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def resolve_backend(backend: Backend, *tensors: Tensor) -> Literal["torch", "triton"]:
    """The backend a call on ``tensors`` runs.

    Args:
        backend: "auto" (Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``; else torch),
            "torch" (the reference) or "triton" (the kernel; an error where it cannot run).
        *tensors: the call's tensor inputs (all on one device).

    Returns:
        "torch" or "triton".

    Raises:
        ValueError: an unknown backend, or "triton" where it cannot run (one line with the fix).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "torch":
        return "torch"
    runnable = triton_installed() and all(t.is_cuda or interpreting() for t in tensors)
    if backend == "auto":
        return "triton" if runnable else "torch"
    if not triton_installed():
        raise ValueError("backend='triton' needs triton; install it with `pip install flowrl[kernels]`")
    if not runnable:
        raise ValueError(
            "backend='triton' on CPU tensors needs the Triton interpreter; set TRITON_INTERPRET=1 "
            "before the first kernel call, or pass CUDA tensors"
        )
    return "triton"
