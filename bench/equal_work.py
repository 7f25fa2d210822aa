"""Iteration cost at equal work: today's eager one-thread path against compiled and two-thread runs.

Usage: ``python -m bench.equal_work [--models digits tiny64] [--objectives flow_grpo awm ...]
[--variants eager-1 compile-1 eager-2 compile-2] [--iterations 3] [--mode default]``.

For every model and objective it builds one ``flowrl.recipe.Run`` per variant from the shipped
config (the same policy stack, trainer, rewards and seeds as ``flowrl train``), so every variant
does the same work: the same prompts, group geometry, model evaluations (checked: the logged
``nfe`` must agree) and fp32 precision. A variant is a torch thread count and ``memory.compile``
(``eager`` = ``none``). The first iteration of every run is a warm-up (for compiled runs it holds
the tracing and code generation of every graph the iteration meets: its time is reported as the
compile cost); then the variants' iterations alternate, so a change of host load falls on all of
them. Scoring runs inline (``train.rewards_async=false``).

Printed: median seconds per iteration, each variant over the ``eager-1`` baseline (today's
default on a <= 2-core machine), the warm-up's extra seconds, and the largest difference of the
first iteration's mean reward from the baseline (compiled kernels round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.profile import OBJECTIVES, TINY64, TINY64_PER_OBJECTIVE, run_for, tiny_sd3_64

VARIANTS = ("eager-1", "compile-1", "eager-2", "compile-2")


def threads_of(variant: str) -> int:
    """The torch thread count of a variant name (``eager-1`` -> 1)."""
    return int(variant.split("-")[1])


def variant_overrides(variant: str, mode: str) -> list[str]:
    """Config overrides of one variant name (``eager-1``, ``compile-2``, ...)."""
    compiled = variant.startswith("compile")
    return [f"train.threads={threads_of(variant)}", f"memory.compile={mode if compiled else 'none'}"]


def timed_iteration(run: Any, threads: int) -> tuple[float, dict[str, float]]:
    """Wall seconds of one ``Trainer.train_step`` at ``threads`` torch threads, and its metrics."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    metrics = run.trainer.train_step()
    return time.perf_counter() - t0, metrics


def measure(config: str, overrides: list[str], variants: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Per variant: warm-up seconds, median iteration seconds, NFE and first-iteration reward."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-equal-work-") as tmp:
        runs = {}
        for v in variants:
            runs[v] = run_for(config, [*overrides, *variant_overrides(v, args.mode)], Path(tmp) / v)
            first, metrics = timed_iteration(runs[v], threads_of(v))
            out[v] = {"warmup": first, "times": [], "nfe": metrics.get("nfe"), "reward": metrics["reward_mean"]}
        for _ in range(args.iterations):
            for v in variants:
                seconds, metrics = timed_iteration(runs[v], threads_of(v))
                out[v]["times"].append(seconds)
                out[v]["nfe_timed"] = metrics.get("nfe")
        for run in runs.values():
            run.trainer.close()
    for v in variants:
        out[v]["median"] = statistics.median(out[v]["times"])
    return out


def table(results: dict[str, dict[str, dict[str, Any]]], variants: list[str]) -> str:
    """The markdown table: one row per model x objective, one column group per variant."""
    head = "| model | objective | NFE/it | " + " | ".join(f"{v} s/it" for v in variants)
    head += " | " + " | ".join(f"{v} / eager-1" for v in variants[1:]) + " | compile warm-up s | max reward diff |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for model, per in results.items():
        for name, res in per.items():
            if "missing" in res:
                lines.append(f"| {model} | {name} | {res['missing']} |")
                continue
            base = res[variants[0]]["median"]
            nfe = {res[v]["nfe_timed"] for v in variants}
            ratios = " | ".join(f"{res[v]['median'] / base:.3f}" for v in variants[1:])
            warm = max((res[v]["warmup"] - res[v]["median"] for v in variants if v.startswith("compile")), default=0)
            diff = max(abs(res[v]["reward"] - res[variants[0]]["reward"]) for v in variants)
            nfe_text = "/".join(f"{n:.0f}" for n in sorted(n for n in nfe if n is not None)) or "?"
            times = " | ".join(f"{res[v]['median']:.3f}" for v in variants)
            lines.append(f"| {model} | {name} | {nfe_text} | {times} | {ratios} | {warm:.1f} | {diff:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["digits", "tiny64"], choices=["digits", "tiny64"])
    parser.add_argument("--objectives", nargs="+", default=[n for n in OBJECTIVES if n != "sol_rl"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--mode", default="default", choices=["default", "max-autotune"])
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures here, row by row")
    args = parser.parse_args(argv)
    if args.variants[0] != "eager-1":
        parser.error("the first variant is the baseline and must be eager-1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = open("/proc/loadavg").read().split()[:3]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-tiny64-") as tmp:
        for model in args.models:
            extra = [f"model.path={tiny_sd3_64(Path(tmp) / 'model')}", *TINY64] if model == "tiny64" else []
            results[model] = {}
            for name in args.objectives:
                per = TINY64_PER_OBJECTIVE.get(name, []) if model == "tiny64" else []
                try:
                    results[model][name] = measure(OBJECTIVES[name], [*extra, *per], args.variants, args)
                except Exception as err:  # the other rows are still worth having
                    results[model][name] = {"missing": f"failed: {type(err).__name__}: {str(err)[:120]}"}
                print(table({model: {name: results[model][name]}}, args.variants).splitlines()[-1], flush=True)
                if args.json is not None:  # saved as it goes: a long run that is stopped keeps its rows
                    args.json.write_text(json.dumps(results, indent=1))
    end = open("/proc/loadavg").read().split()[:3]
    print(f"load {' '.join(load)} -> {' '.join(end)}; torch {torch.__version__}; compile mode {args.mode}")
    print(table(results, args.variants))


if __name__ == "__main__":
    main()
