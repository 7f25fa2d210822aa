"""Operators per training iteration, per category: a device-independent count of kernel launches.

Usage: ``python -m bench.op_count [--objectives flow_grpo awm ...] [--cuda-json docs/benchmarks-profile-cuda.json]
[--override key=value ...]``.

On a GPU the embedded model is launch-bound (docs/benchmarks.md, "Where the time goes on an H100"):
an iteration costs about what its kernel launches and their Python cost, not its FLOPs. Nearly every
aten operator that is not a view is one kernel launch there. This counts the operators one
iteration dispatches on this CPU (the same code path and calls as on a GPU, except that the Flow-SDE
step runs its torch reference here and one fused kernel on CUDA), split into the categories of
:mod:`bench.profile` by the same wrappers, with a ``TorchDispatchMode`` over one untimed iteration
after ``--warmup`` ones. Views (``func.is_view``) and ``detach`` / ``alias`` launch nothing and are
counted apart.

With ``--cuda-json`` (a saved ``python -m bench.profile --device cuda --json``) it also prints, per
category, the GPU seconds of that run divided by the operators counted here: what one operator costs
there, so what a cut of N operators is worth before it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.profile import CATEGORIES, OBJECTIVES, PHASES, Timers, instrument, iteration, run_for

FREE = ("detach", "alias", "lift_fresh")  # no kernel: autograd / metadata bookkeeping


class OpCounter(TorchDispatchMode):
    """Count dispatched aten operators per (phase, category) of ``timers`` (the innermost timed call).

    Attributes:
        launches: (phase, category) -> operators that launch work (not views, not ``FREE``).
        views: (phase, category) -> views and ``FREE`` operators.
    """

    def __init__(self, timers: Timers):
        super().__init__()
        self.timers = timers
        self.launches: dict[tuple[str, str], int] = defaultdict(int)
        self.views: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        key = (self.timers.phase, self.timers.cats[-1] if self.timers.cats else "rest")
        name = func.overloadpacket.__name__
        free = func.is_view or name in FREE
        (self.views if free else self.launches)[key] += 1
        return func(*args, **(kwargs or {}))


def count_objective(config: str, overrides: list[str], warmup: int) -> dict[str, int]:
    """Operators of one iteration of ``config`` after ``warmup`` ones: ``"<phase>/<category>"`` -> count.

    Also ``"<phase>/views"`` (views and free operators of the phase) and ``"total"`` (launching operators).
    """
    from flowrl.outputs import MetricsLogger

    with tempfile.TemporaryDirectory(prefix="flowrl-ops-") as tmp:
        run = run_for(config, overrides, Path(tmp) / "run")
        run.out.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(run.out, resume_step=None)
        run.trainer.warm_prompts()
        timers = Timers(lambda: None)
        with contextlib.ExitStack() as stack:
            instrument(stack, timers, run.trainer)
            for _ in range(warmup):
                iteration(run, timers, logger)
            counter = OpCounter(timers)
            with counter:
                iteration(run, timers, logger)
        logger.close()
        run.trainer.close()
    out = {f"{p}/{c}": counter.launches.get((p, c), 0) for p in PHASES for c in CATEGORIES}
    out.update({f"{p}/views": sum(n for (q, _), n in counter.views.items() if q == p) for p in PHASES})
    out["total"] = sum(counter.launches.values())
    return out


def per_operator_seconds(ops: dict[str, int], cuda: dict[str, float]) -> dict[str, float]:
    """GPU seconds per launching operator of each category over collect + update (0 counted: omitted).

    Args:
        ops: :func:`count_objective`'s counts.
        cuda: the same objective's medians from a ``bench.profile --device cuda --json`` run.
    """
    out = {}
    for c in CATEGORIES:
        n = sum(ops.get(f"{p}/{c}", 0) for p in ("collect", "update"))
        seconds = sum(cuda.get(f"{p}/{c}", 0.0) for p in ("collect", "update"))
        if n:
            out[c] = seconds / n
    return out


SHOWN = ("forward", "backward", "adapter", "sampler", "objective", "decode", "rewards", "data", "optimizer", "rest")


def table(counts: dict[str, dict[str, int]]) -> str:
    """Markdown: launching operators per category (every phase), total and the share outside the denoiser."""
    head = "| objective | " + " | ".join(SHOWN) + " | other | total | outside the denoiser | views |"
    lines = [head, "|" + "---|" * (len(SHOWN) + 5)]
    for name, ops in counts.items():
        per = {c: sum(ops[f"{p}/{c}"] for p in PHASES) for c in CATEGORIES}
        total = sum(per.values())
        other = total - sum(per[c] for c in SHOWN)
        outside = 1 - (per["forward"] + per["backward"]) / total
        views = sum(ops[f"{p}/views"] for p in PHASES)
        cells = " | ".join(str(per[c]) for c in SHOWN)
        lines.append(f"| {name} | {cells} | {other} | {total} | {outside:.0%} | {views} |")
    return "\n".join(lines)


def cost_table(counts: dict[str, dict[str, int]], cuda: dict[str, dict[str, float]]) -> str:
    """Markdown: microseconds of the saved GPU run per launching operator counted here, per category."""
    lines = ["| objective | " + " | ".join(SHOWN) + " |", "|" + "---|" * (len(SHOWN) + 1)]
    for name, ops in counts.items():
        if name not in cuda or "missing" in cuda[name]:
            continue
        per = per_operator_seconds(ops, cuda[name])
        lines.append(f"| {name} | " + " | ".join(f"{per[c] * 1e6:.1f}" if c in per else "-" for c in SHOWN) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--override", nargs="*", default=[], help="extra key=value config overrides")
    parser.add_argument("--cuda-json", type=Path, default=None, help="a saved bench.profile --device cuda --json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    counts = {}
    for name in args.objectives:
        counts[name] = count_objective(OBJECTIVES[name], ["train.threads=1", *args.override], args.warmup)
        print(f"{name}: {counts[name]['total']} launching operators per iteration", flush=True)
    print("\nLaunching aten operators per iteration (rollout, training, logging), by category of bench.profile:\n")
    print(table(counts))
    if args.cuda_json is not None:
        cuda = json.loads(args.cuda_json.read_text())["results"]["digits"]
        print(f"\nMicroseconds per operator on the GPU run of {args.cuda_json} (its seconds / these counts):\n")
        print(cost_table(counts, cuda))


if __name__ == "__main__":
    main()
