"""FSDP2 sharding on 2 CPU processes (gloo) against one unsharded process: LoRA difference and wall time.

For every case of ``tests/scale/test_launch.py`` (the five objectives, ``spread`` placement) and a
tree frontier chunk split over the ranks, trains the embedded flowrl-digits model for 2 iterations
once as one plain process and once under ``ACCELERATE_USE_CPU=true accelerate launch
--config_file configs/accelerate/cpu_gloo.yaml ... train.sharding=fsdp2``, and prints a table of
the largest difference between the two final LoRAs and both wall times (launch and evaluation
included). The 1-minute load average is printed: on a shared host the times move with other jobs.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.sharding [--cases flow_grpo diffusion_nft]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scale"))

from test_launch import OBJECTIVES, STRADDLING, TINY, lora, train_one, train_two  # noqa: E402

CASES = {**OBJECTIVES, "straddling_tree": STRADDLING}


def measure(name: str, args: list[str], out: Path) -> str:
    """One table row: max |LoRA difference|, wall seconds of one process and of 2 sharded ranks."""
    args = [*args, *TINY]
    start = time.perf_counter()
    one = train_one(args, out / f"{name}-one")
    t_one = time.perf_counter() - start
    start = time.perf_counter()
    two = train_two([*args, "train.sharding=fsdp2"], out / f"{name}-fsdp2")
    t_two = time.perf_counter() - start
    if one.returncode or two.returncode:
        return f"| {name} | failed: {(one.stderr + two.stderr).strip().splitlines()[-1]} | | |"
    a, b = lora(out / f"{name}-one"), lora(out / f"{name}-fsdp2")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    return f"| {name} | {worst:.3g} | {t_one:.0f} | {t_two:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=sorted(CASES), choices=sorted(CASES))
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| case | max abs LoRA difference | wall s, 1 process | wall s, 2 ranks fsdp2 |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            print(measure(name, CASES[name], Path(tmp)), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
