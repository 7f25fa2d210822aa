"""Samples per second of `flowrl train` on 1 and on 2 CPU processes (gloo), same global batch.

Trains the embedded flowrl-digits model with Flow-GRPO for a few iterations, once as one plain
process and once under ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2``,
and reads rank 0's ``time/iteration_s`` from ``metrics.jsonl`` (a whole iteration: rollout,
scoring, reward gather, update, gradient all-reduce; evaluation excluded). The first iteration is
warm-up and not counted. Samples per second = global batch / median iteration time.

The host's load average is printed before and after each run: on a shared machine the figures
move with the other jobs, so compare them only at a similar load.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.scale_out [--prompts 8] [--group 4] [--iterations 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flowrl.outputs import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, out: Path) -> list[str]:
    """The training command's overrides: the global batch, the per-process threads and the output folder."""
    return [
        f"prompts.per_iteration={args.prompts}",
        f"prompts.group_size={args.group}",
        f"sampler.chunk_size={args.chunk}",
        f"sampler.num_steps={args.steps}",
        f"train.iterations={args.iterations}",
        f"train.eval_every={args.iterations}",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
        "train.progress=false",
        "train.threads=1",
        f"output.dir={out}",
    ]


def train_command(processes: int, env: dict[str, str]) -> list[str]:
    """``flowrl train`` as one plain process, or on ``processes`` CPU processes under accelerate (gloo).

    Sets ``ACCELERATE_USE_CPU`` in ``env`` for a multi-process launch.
    """
    if processes == 1:
        return [sys.executable, "-m", "flowrl", "train"]
    env["ACCELERATE_USE_CPU"] = "true"
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [accelerate, "launch", "--main_process_port", "0", "--multi_gpu", "--num_processes", str(processes)]
    return cmd + ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "flowrl", "train"]


def median_iteration(out: Path) -> float:
    """Median ``time/iteration_s`` of a run folder's ``metrics.jsonl`` (rank 0's), the first iteration left out.

    The first is warm-up (a compiled run's compile time); a one-iteration run keeps it.
    """
    rows = [json.loads(line) for _, line in read_metrics(out / "metrics.jsonl")]
    times = [r["time/iteration_s"] for r in rows if "time/iteration_s" in r]
    return statistics.median(times[1:] or times)


def run(processes: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """Train on ``processes`` processes; returns samples/s, median iteration seconds and the load around it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_NO_SUPERVISOR": "1"}
    cmd = train_command(processes, env)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run([*cmd, *overrides(args, out)], cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    median = median_iteration(out)
    return {
        "samples_s": args.prompts * args.group / median,
        "iteration_s": median,
        "wall_s": time.perf_counter() - start,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def main() -> None:
    """Run 1 and 2 processes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts.per_iteration (global)")
    parser.add_argument("--group", type=int, default=4, help="prompts.group_size")
    parser.add_argument("--chunk", type=int, default=8, help="sampler.chunk_size (must divide the rows per rank)")
    parser.add_argument("--steps", type=int, default=10, help="sampler.num_steps")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    print(
        f"global batch {args.prompts} x {args.group} = {args.prompts * args.group}, {args.steps} steps, "
        f"{os.cpu_count()} CPU cores; one torch thread per process"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, 2):
            results[n] = run(n, args, Path(tmp) / f"p{n}")
    print("| processes | samples/s | s/iteration (median) | wall s | load 1-min before | load after |")
    print("|---|---|---|---|---|---|")
    for n, r in results.items():
        print(
            f"| {n} | {r['samples_s']:.2f} | {r['iteration_s']:.2f} | {r['wall_s']:.0f} | "
            f"{r['load_before']:.2f} | {r['load_after']:.2f} |"
        )
    print(f"speed-up 2 vs 1: {results[2]['samples_s'] / results[1]['samples_s']:.2f}x")


if __name__ == "__main__":
    main()
