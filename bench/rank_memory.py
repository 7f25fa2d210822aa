"""Rollout memory a rank holds: one process against each rank of 2 (gloo), on the shipped embedded configs.

Trains one iteration of each shipped config as one plain process and under ``ACCELERATE_USE_CPU=true
accelerate launch --config_file configs/accelerate/cpu_gloo.yaml`` (2 processes), and prints the
logged ``rollout/held_mb`` (rank 0's batch: conditioning, samples, trajectories, images, tree
nodes; :func:`flowrl.rollouts.collect.held_megabytes`) and ``train/plan_mb`` (the fresh noise of
rank 0's plan, DiffusionNFT and AWM; :func:`flowrl.objectives.planning.plan_megabytes`) of both and
their ratios. A rank holds its own ``B / W`` rows and their noise (ratio 0.5).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.rank_memory [--configs configs/grpo/digits.yaml ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scale"))

from test_launch import metrics, train_one, train_two  # noqa: E402

CONFIGS = [
    "configs/grpo/digits.yaml",
    "configs/sage/digits.yaml",
    "configs/nft/digits_fast.yaml",
    "configs/awm/digits_fast.yaml",
    "configs/branch/digits.yaml",
]
ONE_ITERATION = ["train.iterations=1", "train.eval_seeds=1", "output.grid_seeds=1", "train.progress=false"]


def held(run: Path, key: str = "rollout/held_mb") -> float:
    """``key`` (MiB) of the run's first iteration (rank 0's)."""
    return next(r.get(key, 0.0) for r in metrics(run) if r.get("step") == 1)


def ratio(a: float, b: float) -> str:
    """``b / a`` to 3 decimals, or "-" when ``a`` is 0."""
    return f"{b / a:.3f}" if a else "-"


def row(config: str, out: Path) -> str:
    """One table row: rows per iteration, MiB held by one process and by rank 0 of 2, and the ratio."""
    args = [config, *ONE_ITERATION]
    name = Path(config).stem + "-" + Path(config).parent.name
    one, two = train_one(args, out / f"{name}-one"), train_two(args, out / f"{name}-two")
    if one.returncode or two.returncode:
        return f"| `{config}` | failed: {(one.stderr + two.stderr).strip().splitlines()[-1]} | | | | | |"
    a, b = held(out / f"{name}-one"), held(out / f"{name}-two")
    pa, pb = (held(out / f"{name}-{n}", "train/plan_mb") for n in ("one", "two"))
    return f"| `{config}` | {a:.2f} | {b:.2f} | {ratio(a, b)} | {pa:.2f} | {pb:.2f} | {ratio(pa, pb)} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    args = parser.parse_args()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.2f}")
    print("| config | batch MiB, 1 process | rank 0 of 2 | ratio | plan noise MiB, 1 process | rank 0 of 2 | ratio |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            print(row(config, Path(tmp)), flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
