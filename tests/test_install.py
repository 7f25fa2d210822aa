"""Packaging: samplers/, rewards/ and kernels/ install only as flowrl.* sub-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, flowrl.samplers, flowrl.rewards, flowrl.kernels;"
    "print(flowrl.samplers.__file__);"
    "print([importlib.util.find_spec(n) is None for n in ('samplers', 'rewards', 'kernels')])"
)


@pytest.mark.install
def test_wheel_maps_top_level_folders_under_flowrl(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO)],
        check=True,
        capture_output=True,
        text=True,
    )
    (wheel,) = (tmp_path / "dist").glob("flowrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "flowrl/samplers/flow_sde.py" in names
    assert "flowrl/rewards/__init__.py" in names and "flowrl/kernels/__init__.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"samplers", "rewards", "kernels", "configs", "tests", "gallery"}, tops
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": ""},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert out[0].startswith(str(site / "flowrl" / "samplers"))
    assert out[1] == "[True, True, True]"


def test_editable_install_imports_from_the_checkout(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, check=True, capture_output=True, text=True)
    lines = out.stdout.splitlines()
    assert lines[0] == str(REPO / "samplers" / "__init__.py"), "run `pip install -e .` from the repo root"
    assert lines[1] == "[True, True, True]"
