"""bench/fsdp2_memory.py: the one-process FSDP2 training step against the unsharded one, tiny SD3 on gloo.

The full-size run needs CUDA (docs/gpu-session.md); here the same code path (accelerate's one-process
group, flowrl.sharding.shard_transformer, the autocast + backward + AdamW step) runs on the CPU, in a
child process so that its process group does not outlive the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import fsdp2_memory

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_fsdp2_step_runs_beside_the_unsharded_one():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "bench.fsdp2_memory", "--tiny", "--batch", "2", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| tiny SD3")]
    assert [r[2].strip() for r in rows] == ["unsharded", "FSDP2 (1 process)"]
    assert rows[0][3] == rows[1][3] and " of " in rows[1][3]  # one process holds every parameter
    assert all(float(r[5].replace(",", "")) > 0 for r in rows)  # both steps ran and were timed
    assert "fsdp2: rank 0 of 1 holds" in done.stderr  # flowrl's shard_transformer did the sharding


def test_accelerate_plugin_path_on_the_cpu_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="--via accelerate needs CUDA"):
        fsdp2_memory.main(["--tiny", "--via", "accelerate"])
