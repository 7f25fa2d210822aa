"""Importing flowrl.kernels stays cheap and safe: no triton import, and no crash when the checkout's
``kernels/`` folder is imported under the bare name ``kernels``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_importing_kernels_does_not_import_triton():
    code = "import sys, flowrl.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_folder_imports_under_its_bare_name_from_the_repo_root():
    # `python -m ...` from a checkout puts the repo root on sys.path; transformers' probe for Hugging
    # Face's `kernels` package then imports this folder as `kernels` (diffusers pipelines trigger it)
    code = "import kernels, sys; assert 'triton' not in sys.modules; print(kernels.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == str(REPO / "kernels" / "__init__.py")
