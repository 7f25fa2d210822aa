"""The default job end to end, as a user runs it, against the same job on two processes or compiled.

Usage: ``python -m bench.end_to_end [--arms base procs2 compile threads2] [--set key=value ...]
[--model tiny64] [--keep DIR]``.

Every arm runs the whole default job (``flowrl train`` with no config: 70 Flow-GRPO iterations,
evaluations every 10, grids, checkpoints) in its own process, one after the other in one run of
this script, and is timed from start to exit. Arms:

- ``base``: ``flowrl train`` (one process; one torch thread on a <= 2-core machine; eager).
- ``procs2``: the same job under ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
  --num_processes 2`` (gloo, one thread per process; the global batch, seeds and geometry of one
  process, so the same LoRA within fp32 tolerance: tests/scale).
- ``compile``: ``memory.compile=default`` (compile time included in the wall time).
- ``procs2-compile``: ``procs2`` with ``memory.compile=default`` in each process.
- ``threads2``: ``train.threads=2``.
- ``auto``: ``flowrl train --processes auto`` (flowrl starts the accelerate launch itself: one
  process per usable core, here 2; the same job as ``procs2``).

``--model tiny64`` runs the same arms on ``bench.profile``'s random-weight SD3 pipeline at 64²
(saved as a diffusers folder, ``model.path``), 8 prompts x 4 in chunks of 16 (one chunk per rank on
two processes); figures it has no reader for print as ``nan``.

Printed: wall seconds, each arm over ``base``, the median training iteration (``time/iteration_s``
of rank 0's ``metrics.jsonl``, the first iteration left out: it holds a compiled arm's compile
time) over ``base``'s, and the end-of-run figures from ``summary.json``
(held-out reward, the SVC digit accuracy of the run's report, ink gap, diversity ratio) with
their largest difference from ``base``: an arm has "the same results" when its figures agree to
the digits shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.profile import tiny_sd3_64
from bench.scale_out import ROOT, median_iteration, train_command

ARMS = {
    "base": (1, []),
    "procs2": (2, []),
    "compile": (1, ["memory.compile=default"]),
    "procs2-compile": (2, ["memory.compile=default"]),
    "threads2": (1, ["train.threads=2"]),
    "auto": ("auto", []),
}
TINY64_E2E = ["prompts.per_iteration=8", "prompts.group_size=4", "sampler.chunk_size=16"]
FIGURES = ("eval/reward_mean", "eval/accuracy", "eval/ink_gap", "eval/diversity_ratio")


def run_arm(name: str, out: Path, extra: list[str]) -> dict[str, float]:
    """Run one arm's whole job; its wall seconds, load around it and end-of-run figures."""
    processes, overrides = ARMS[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if processes == "auto":  # the product path: flowrl train's own launch (pre-launch checks, then accelerate)
        command = [sys.executable, "-m", "flowrl", "train", "--processes", "auto"]
    else:
        command = train_command(processes, env)
    cmd = [*command, *overrides, *extra, f"output.dir={out}", "train.progress=false"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    figures = {k: float(summary["end"].get(k, "nan")) for k in FIGURES}  # a model that is not digits has no reader
    iteration = median_iteration(out)
    return {"wall": wall, "train_wall": float(summary["train_wall_s"]), "load": load, "iteration": iteration, **figures}


def table(results: dict[str, dict[str, float]]) -> str:
    """One row per arm: wall, ratio to base, load before, and the end figures."""
    base = results.get("base")
    head = "| arm | wall s | / base | s/iteration (median) | / base | load before | " + " | ".join(FIGURES) + " |"
    lines = [head, "|" + "---|" * (6 + len(FIGURES))]
    for name, r in results.items():
        ratio = f"{r['wall'] / base['wall']:.3f}" if base else "-"
        per_it = f"{r['iteration'] / base['iteration']:.3f}" if base else "-"
        figs = " | ".join(f"{r[k]:.4f}" for k in FIGURES)
        lines.append(
            f"| {name} | {r['wall']:.0f} | {ratio} | {r['iteration']:.3f} | {per_it} | {r['load']:.2f} | {figs} |"
        )
    if base:
        for name, r in results.items():
            if name != "base":
                diff = max((abs(r[k] - base[k]) for k in FIGURES if not math.isnan(base[k])), default=0.0)
                speed = base["wall"] / r["wall"]
                lines.append(f"\n{name}: base / {name} = {speed:.2f}x; largest figure diff {diff:.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["base", "procs2"], choices=list(ARMS))
    parser.add_argument("--set", nargs="*", default=[], help="extra overrides for every arm (e.g. a shorter job)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--model", choices=("digits", "tiny64"), default="digits")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-e2e-") as tmp:
        folder = args.keep or Path(tmp)
        extra = list(args.set)
        if args.model == "tiny64":
            model = tiny_sd3_64(Path(tmp) / "tiny64")
            extra = [f"model.path={model}", *TINY64_E2E, *extra]
        for name in args.arms:
            results[name] = run_arm(name, folder / name, extra)
            print(f"{name}: {results[name]['wall']:.0f} s", flush=True)
    print(f"{os.cpu_count()} CPU cores; load at the end {os.getloadavg()[0]:.2f}")
    print(table(results))


if __name__ == "__main__":
    main()
