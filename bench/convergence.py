"""Convergence harness: Flow-GRPO, DiffusionNFT and AWM on the embedded task, one process.

Usage::

    python -m bench.convergence [--budget 300] [--eval-every-s 30] [--algos flow_grpo,diffusion_nft,awm]

Each algorithm trains from the same base model, prompts, rewards and seed under the same
wall-clock budget (evaluation excluded). Eval reward = ODE samples on held-out seeds. Writes a
table and ``docs/benchmarks-convergence.png``, and prints the markdown section that goes into
``docs/benchmarks.md``: for each algorithm, the wall time and NFE at which it first reaches
Flow-GRPO's final eval reward, as a fraction of Flow-GRPO's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.prompts import load_prompts
from flowrl.recipe import build_reward
from flowrl.runtime import configure_threads
from flowrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "flow_grpo": REPO / "configs/grpo/digits.yaml",
    "diffusion_nft": REPO / "configs/nft/digits.yaml",
    "awm": REPO / "configs/awm/digits.yaml",
    "sage_grpo": REPO / "configs/sage/digits.yaml",
    "branch_grpo": REPO / "configs/branch/digits.yaml",
}


def run_one(name: str, budget: float, eval_every: float, overrides: list[str]) -> list[dict[str, float]]:
    """Train one algorithm for ``budget`` seconds of training; returns eval points."""
    cfg = load_config(CONFIGS[name], ["train.iterations=100000", "train.progress=false", *overrides])
    configure_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    prompts = load_prompts(cfg.prompts.train)
    trainer = Trainer(cfg, load_adapter(cfg.model.path), build_reward(cfg), prompts, load_prompts(cfg.prompts.eval))
    points = [{"wall_s": 0.0, "nfe": 0, "iteration": 0, **trainer.evaluate()}]
    train_s, next_eval = 0.0, eval_every
    while train_s < budget:
        t0 = time.perf_counter()
        trainer.train_step()
        train_s += time.perf_counter() - t0
        if train_s >= next_eval or train_s >= budget:
            points.append({"wall_s": train_s, "nfe": trainer.model.nfe, "iteration": trainer.iteration, **trainer.evaluate()})
            next_eval += eval_every
            print(f"  {name}: {train_s:6.1f}s it {trainer.iteration:4d} eval reward {points[-1]['eval/reward_mean']:.4f}", flush=True)
    return points


def first_reach(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """First eval point whose reward is >= target."""
    return next((p for p in points if p["eval/reward_mean"] >= target), None)


def plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    for name, points in results.items():
        axes[0].plot([p["wall_s"] for p in points], [p["eval/reward_mean"] for p in points], "o-", ms=3, label=name)
        axes[1].plot([p["nfe"] for p in points], [p["eval/reward_mean"] for p in points], "o-", ms=3, label=name)
    axes[0].set_xlabel("training wall time (s)")
    axes[1].set_xlabel("model evaluations (per-sample NFE)")
    for ax in axes:
        ax.set_ylabel("eval reward (held-out seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(results: dict[str, list[dict[str, float]]], budget: float, command: str) -> str:
    """Markdown section with the table of time/NFE to Flow-GRPO's final reward."""
    base = results.get("flow_grpo")
    target = base[-1]["eval/reward_mean"] if base else None
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"date {dt.date.today().isoformat()}; budget {budget:.0f} s of training per algorithm.",
        "",
        "| algorithm | start reward | final reward | iterations | time to Flow-GRPO's final (s) | ratio | NFE to it | NFE ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hit_base = first_reach(base, target) if base else None
    for name, points in results.items():
        hit = first_reach(points, target) if target is not None else None
        t = f"{hit['wall_s']:.0f}" if hit else "not reached"
        n = f"{hit['nfe']:,}" if hit else "–"
        ratio = f"{hit['wall_s'] / hit_base['wall_s']:.2f}" if hit and hit_base and hit_base["wall_s"] > 0 else "–"
        nratio = f"{hit['nfe'] / hit_base['nfe']:.2f}" if hit and hit_base and hit_base["nfe"] > 0 else "–"
        lines.append(
            f"| {name} | {points[0]['eval/reward_mean']:.4f} | {points[-1]['eval/reward_mean']:.4f} | {points[-1]['iteration']} "
            f"| {t} | {ratio} | {n} | {nratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=300.0, help="training seconds per algorithm")
    parser.add_argument("--eval-every-s", type=float, default=30.0)
    parser.add_argument("--algos", default="flow_grpo,diffusion_nft,awm")
    parser.add_argument("--out", default=str(REPO / "docs"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every algorithm")
    args = parser.parse_args(argv)
    results = {}
    for name in args.algos.split(","):
        print(f"running {name} for {args.budget:.0f} s", flush=True)
        results[name] = run_one(name, args.budget, args.eval_every_s, args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "benchmarks-convergence.png")
    (out / "benchmarks-convergence.json").write_text(json.dumps(results, indent=1))
    command = "python -m bench.convergence " + " ".join(argv if argv is not None else os.sys.argv[1:])
    section = report(results, args.budget, command.strip())
    print(section)
    update_docs(out / "benchmarks.md", section)


def update_docs(path: Path, section: str) -> None:
    """Replace the text between the convergence markers of docs/benchmarks.md (append if absent)."""
    start, end = "<!-- convergence:start -->", "<!-- convergence:end -->"
    block = f"{start}\n{section}\n\n![convergence](benchmarks-convergence.png)\n{end}"
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n## Convergence: Flow-GRPO vs DiffusionNFT vs AWM\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
