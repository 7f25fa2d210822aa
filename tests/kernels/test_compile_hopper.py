"""The fused Triton kernels compile for the H100 (sm_90) on a machine without a GPU, with IEEE-rounded arithmetic.

Triton's interpreter (the other CPU tests) runs the kernels in NumPy and never lowers them, so an error that
only compiling shows (a type the backend refuses, a loop it cannot lower) would first appear on a GPU, where
device time is scarce. ``compile_hopper.py`` lowers them ahead of time with ``triton.compile`` and a
``GPUTarget`` (PTX, then a cubin by the ptxas that ships with triton), in a process without
``TRITON_INTERPRET``. The kernels' bit-exactness also rests on IEEE-rounded division and square root
(``div_rn``, ``sqrt_rn``): the PTX must hold no approximate ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (flowrl[kernels])")

SCRIPT = Path(__file__).with_name("compile_hopper.py")
EXACT = {"div.rn.f32", "sqrt.rn.f32"}


@pytest.fixture(scope="module")
def built() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_variant_compiles_to_a_cubin(built):
    assert len(built) == 5
    assert all(out["cubin_bytes"] > 1000 for out in built.values()), built


def test_only_ieee_rounded_division_and_square_root(built):
    for name, out in built.items():
        assert set(out["ops"]) <= EXACT, f"{name}: {out['ops']}"
    assert all("div.rn.f32" in out["ops"] for out in built.values())
    assert all("sqrt.rn.f32" in out["ops"] for name, out in built.items() if name.startswith("flow_sde"))
