"""Peak resident memory of a whole run: the summed RSS of every process it starts, sampled while it runs.

Usage: ``python -m bench.tree_memory [--set key=value ...] [--interval-s 0.2]``.

``/usr/bin/time -v`` reports one process's peak; a run of ``flowrl train --processes N`` is a
supervisor, flowrl's launching process, accelerate's launcher and N ranks alive together. This
script runs a short default job (``train.iterations=3 train.eval_every=3``, start and end
evaluation, grids, a checkpoint) as ``flowrl train`` and as ``flowrl train --processes auto``, one
after the other, samples ``VmRSS`` of the process tree every ``--interval-s`` seconds, and prints
the peak of the sum, the processes alive at that moment and each one's own peak. Target (issue
17): the default job's peak <= 2 GB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.scale_out import ROOT

SHORT = ["train.iterations=3", "train.eval_every=3", "train.progress=false"]
ARMS = {"flowrl train": [], "flowrl train --processes auto": ["--processes", "auto"]}


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux ``/proc/<pid>/task/*/children``)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def rss_kb(pid: int) -> int:
    """``VmRSS`` of ``pid`` in kB (0 once it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def name(pid: int) -> str:
    """A short label of ``pid``'s command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(a.decode(errors="replace") for a in argv[:4])
    return "accelerate launcher" if "accelerate" in text else text[-40:]


Peaks = tuple[int, int, dict[int, tuple[str, int]], float]


def sample(cmd: list[str], env: dict[str, str], interval_s: float) -> Peaks:
    """Run ``cmd``; (peak summed kB, processes alive then, {pid: (label, own peak kB)}, wall s)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, alive, own = 0, 0, {}
    while proc.poll() is None:
        pids = [proc.pid, *children(proc.pid)]
        sizes = {pid: rss_kb(pid) for pid in pids}
        for pid, kb in sizes.items():
            label, best = own.get(pid, (name(pid), 0))
            own[pid] = (label, max(best, kb))
        total = sum(sizes.values())
        if total > peak:
            peak, alive = total, sum(1 for kb in sizes.values() if kb)
        time.sleep(interval_s)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return peak, alive, own, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", nargs="*", default=[], help="extra overrides for both arms")
    parser.add_argument("--interval-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("FLOWRL_NO_SUPERVISOR", None)  # as a user runs it
    rows = []
    with tempfile.TemporaryDirectory(prefix="flowrl-rss-") as tmp:
        for i, (arm, flags) in enumerate(ARMS.items()):
            cmd = [sys.executable, "-m", "flowrl", "train", *flags, *SHORT, *args.set, f"output.dir={tmp}/{i}"]
            peak, alive, own, wall = sample(cmd, env, args.interval_s)
            rows.append((arm, peak, alive, own, wall))
            print(f"{arm}: peak {peak / 2**20:.2f} GB in {wall:.0f} s", flush=True)
    load = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} CPU cores; load at the end {load:.2f}; sampled every {args.interval_s} s\n")
    print("| command | peak RSS, all processes | processes then | each process's own peak |")
    print("|---|---|---|---|")
    for arm, peak, alive, own, _ in rows:
        each = ", ".join(f"{label.strip()} {kb / 1024:.0f} MB" for label, kb in own.values() if kb)
        print(f"| `{arm}` | {peak / 2**20:.2f} GB | {alive} | {each} |")


if __name__ == "__main__":
    main()
