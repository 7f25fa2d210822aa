"""Convergence harness: Flow-GRPO, DiffusionNFT, AWM, SAGE-GRPO, BranchGRPO (and Sol-RL) on the embedded task.

Usage::

    python -m bench.convergence [--budget 300] [--eval-every-s 30] [--algos flow_grpo,diffusion_nft,awm]
    python -m bench.convergence --iterations 36 --eval-every-it 2 --eval-steps 10   # count-based budget
    python -m bench.convergence --algos nft_fast,awm_fast --baseline docs/benchmarks-convergence.json \
        --stop-confirmed --iterations 36 --eval-every-it 1   # stop each at the reader-confirmed target

Every evaluation point also carries the independent reader's reading of the held-out samples
(:mod:`flowrl.models.digits.reader`, trained on data the rewards never saw, a different model family):
its accuracy on the prompted digit (``reader``, ``reader_bold``, ``reader_thin``) and the mean ink
per style with its gap (``ink_gap``, the style measure). A target counts as **reached** only when the
eval reward is at or above it AND the reader's accuracy is at or above the base model's on the same
held-out samples (point 0), less one standard error of the difference (:func:`reader_floor`, about
2 points on 200 samples, so that sampling noise alone does not decide): an algorithm that raises
the reward by degrading the digits does not reach it (issue 14: an algorithm that hacks the reward
sooner is slower, not faster).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.policy.counting import CountingAdapter
from flowrl.prompts.sets import load_prompts
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
    "nft_fast": REPO / "configs/nft/digits_fast.yaml",
    "awm_fast": REPO / "configs/awm/digits_fast.yaml",
    "solrl": REPO / "configs/solrl/digits.yaml",  # NFE counts the full-precision model only, not the explore copy
}


class ComputeCounter(CountingAdapter):
    """Counts model evaluations by kind: ``nfe``, ``grad_nfe`` and ``rollout_nfe``.

    ``nfe`` counts all evaluations, ``grad_nfe`` those with autograd on (i.e. forwards that are also
    backpropagated) and ``rollout_nfe`` (set via :func:`run_one`) those made during rollouts.
    """

    def __init__(self, model):
        super().__init__(model)
        self.grad_nfe = 0
        self.rollout_nfe = 0

    def velocity(self, x, sigma, cond):
        if torch.is_grad_enabled():
            self.grad_nfe += x.shape[0] * int(self.wrapped.evaluations_per_sample)
        return super().velocity(x, sigma, cond)


def compute_equivalent(nfe: int, grad_nfe: int) -> int:
    """Forward-equivalent cost: every evaluation counts 1 and a backward pass ~2 more.

    So a train forward+backward counts 3 (rollout NFE + no-grad train NFE + 3 x grad NFE).
    """
    return nfe + 2 * grad_nfe


def reader_figures(images: torch.Tensor, metadata: dict[str, list]) -> dict[str, float]:
    """The independent reader's accuracy (and mean top probability) and the ink per style of held-out samples.

    Args:
        images: (N, 3, H, W) in [0, 1], the held-out evaluation's samples.
        metadata: the eval batch's metadata with ``digit`` and ``style`` per sample (N each).
    """
    from flowrl.models.digits.evaluation import ink
    from flowrl.models.digits.reader import reader_probabilities, readings

    labels = torch.tensor(metadata["digit"])
    bold = torch.tensor([s == "bold" for s in metadata["style"]])
    probs = reader_probabilities(images)  # read once: the reading and its confidence
    right = (readings(probs) == labels).float()
    amount = ink(images)
    figures = {
        "reader": float(right.mean()),
        "confidence": float(probs.amax(dim=1).mean()),
        "reader_n": float(len(right)),
        "reader_bold": float(right[bold].mean()),
        "reader_thin": float(right[~bold].mean()),
        "ink_bold": float(amount[bold].mean()),
        "ink_thin": float(amount[~bold].mean()),
    }
    figures["ink_gap"] = figures["ink_bold"] - figures["ink_thin"]
    return figures


def run_one(
    name: str,
    budget: float | None,
    eval_every: float,
    overrides: list[str],
    *,
    config: Path | None = None,
    iterations: int | None = None,
    nfe_budget: float | None = None,
    eval_every_it: int | None = None,
    eval_steps: int | None = None,
    stop_at: float | None = None,
) -> list[dict[str, float]]:
    """Train one algorithm and return its eval points.

    Stops at the first of: ``budget`` seconds of training (None = no time limit), ``iterations``,
    ``nfe_budget`` compute-equivalents, or an eval reward >= ``stop_at``. Evaluates every
    ``eval_every`` training seconds, or every ``eval_every_it`` iterations when given, on a
    fixed ``eval_steps``-step ODE schedule when given (else the run's own sampler steps).
    """
    fixed_eval = [f"train.eval_steps={eval_steps}"] if eval_steps else []
    cfg = load_config(
        config or CONFIGS[name], ["train.iterations=100000", "train.progress=false", *overrides, *fixed_eval]
    )
    configure_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    prompts = load_prompts(cfg.prompts.train)
    policy = build_policy(cfg, trainable=True, counter=ComputeCounter)
    model = policy.model
    trainer = Trainer(cfg, policy, build_reward(cfg), prompts, load_prompts(cfg.prompts.eval))
    collect = trainer.collect

    def counted_collect():
        before = model.nfe
        out = collect()
        model.rollout_nfe += model.nfe - before
        return out

    trainer.collect = counted_collect

    def point(wall: float) -> dict[str, float]:
        held_out = trainer.evaluate_heldout()
        return {
            "wall_s": wall,
            "nfe": model.nfe,
            "grad_nfe": model.grad_nfe,
            "rollout_nfe": model.rollout_nfe,
            "compute": compute_equivalent(model.nfe, model.grad_nfe),
            "iteration": trainer.iteration,
            **held_out.metrics,
            **reader_figures(held_out.images, trainer.heldout.batch.metadata),
        }

    points = [point(0.0)]
    floor = reader_floor(points[0])
    train_s, next_eval = 0.0, eval_every

    def done() -> bool:
        return (
            (budget is not None and train_s >= budget)
            or (iterations is not None and trainer.iteration >= iterations)
            or (nfe_budget is not None and compute_equivalent(model.nfe, model.grad_nfe) >= nfe_budget)
            or (stop_at is not None and confirmed(points[-1], stop_at, floor))
        )

    while not done():
        t0 = time.perf_counter()
        trainer.train_step()
        train_s += time.perf_counter() - t0
        due = trainer.iteration % eval_every_it == 0 if eval_every_it else train_s >= next_eval
        if due or done():
            points.append(point(train_s))
            next_eval += eval_every
            print(
                f"  {name}: {train_s:6.1f}s it {trainer.iteration:4d} eval reward {points[-1]['eval/reward_mean']:.4f}"
                f" reader {100 * points[-1]['reader']:.1f} % ink gap {points[-1]['ink_gap']:.3f}",
                flush=True,
            )
    return points


def confirmed(point: dict[str, float], target: float, reader_floor: float) -> bool:
    """The reward reached ``target`` and the independent reader reads at least ``reader_floor`` (the base's)."""
    return point["eval/reward_mean"] >= target and point.get("reader", reader_floor) >= reader_floor


def reader_floor(base: dict[str, float]) -> float:
    """The lowest reader accuracy that still counts as "as legible as the base".

    The base's accuracy minus one standard error of the difference of two accuracies on ``reader_n``
    samples each, sqrt(2 p (1 - p) / n): about 2 points at p = 0.95, n = 200, so that sampling noise
    alone does not decide a hit.
    """
    p, n = base.get("reader", 0.0), base.get("reader_n", 0.0)
    return p - math.sqrt(2 * p * (1 - p) / n) if n > 0 else p


def first_reach(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """First eval point whose reward is >= target while the reader reads as well as the base (point 0)."""
    floor = reader_floor(points[0])
    return next((p for p in points if confirmed(p, target, floor)), None)


def first_reward_only(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """First eval point whose reward is >= target, whatever the reader says."""
    return next((p for p in points if p["eval/reward_mean"] >= target), None)


def plot(results: dict[str, list[dict[str, float]]], path: Path) -> None:
    """Eval reward against wall time and compute, and the independent reader against compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), dpi=100)
    for name, points in results.items():
        axes[0].plot([p["wall_s"] for p in points], [p["eval/reward_mean"] for p in points], "o-", ms=3, label=name)
        axes[1].plot([p["compute"] for p in points], [p["eval/reward_mean"] for p in points], "o-", ms=3, label=name)
        if "reader" in points[0]:
            axes[2].plot([p["compute"] for p in points], [100 * p["reader"] for p in points], "o-", ms=3, label=name)
    axes[0].set_xlabel("training wall time (s)")
    axes[1].set_xlabel("compute equivalent (NFE + 2 x backpropagated NFE)")
    axes[2].set_xlabel("compute equivalent")
    for ax in axes[:2]:
        ax.set_ylabel("eval reward (held-out seeds)")
    axes[2].set_ylabel("independent reader accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ratio(hit: dict[str, float] | None, base: dict[str, float] | None, key: str) -> str:
    return f"{hit[key] / base[key]:.3f}" if hit and base and base.get(key) else "–"


def _row(name: str, points: list[dict[str, float]], target: float | None, hit_base: dict | None) -> str:
    """One table row of :func:`report`."""
    hit = first_reach(points, target) if target is not None else None
    raw = first_reward_only(points, target) if target is not None else None
    first, last = points[0], points[-1]
    cells = [
        name,
        f"{first['eval/reward_mean']:.4f}",
        f"{last['eval/reward_mean']:.4f}",
        str(last["iteration"]),
        f"{100 * first.get('reader', math.nan):.1f} → {100 * last.get('reader', math.nan):.1f} %",
        f"{first.get('ink_gap', math.nan):.3f} → {last.get('ink_gap', math.nan):.3f}",
        str(raw["iteration"]) if raw else "not reached",
        str(hit["iteration"]) if hit else "not reached",
    ]
    if hit is None:
        return "| " + " | ".join(cells + ["–"] * 6) + " |"
    cells += [
        f"{100 * hit.get('reader', math.nan):.1f} % / {hit.get('ink_gap', math.nan):.3f}",
        f"{hit['wall_s']:.0f}",
        _ratio(hit, hit_base, "wall_s"),
        _ratio(hit, hit_base, "nfe"),
        f"{hit['compute']:,}",
        _ratio(hit, hit_base, "compute"),
    ]
    return "| " + " | ".join(cells) + " |"


def report(results: dict[str, list[dict[str, float]]], budget: float | str, command: str) -> str:
    """Markdown section: time, NFE and compute to Flow-GRPO's final reward, confirmed by the reader."""
    base = results.get("flow_grpo")
    target = base[-1]["eval/reward_mean"] if base else None
    lines = [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); "
        f"date {dt.date.today().isoformat()}; budget {budget_text(budget)} per algorithm.",
        "",
        f"Target: Flow-GRPO's final eval reward {target:.4f}, reached only when the independent reader also "
        "reads at least as well as the base model on the same held-out samples (less one standard error of the "
        "difference, about 2 points on 200 samples)."
        if target is not None
        else "No Flow-GRPO baseline: no target.",
        "",
        "| algorithm | start reward | final reward | iterations | reader base → final | ink gap base → final "
        "| reward-only hit (it.) | confirmed hit (it.) | reader / ink gap at hit | time (s) | time ratio "
        "| NFE ratio | compute-eq. to it | compute ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    hit_base = first_reach(base, target) if base else None
    for name, points in results.items():
        lines.append(_row(name, points, target, hit_base))
    return "\n".join(lines)


def budget_text(budget: float | str) -> str:
    """``240`` -> "240 s of training"; a string (iterations / compute budget) is used as is."""
    return f"{budget:.0f} s of training" if isinstance(budget, (int, float)) else budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=300.0, help="training seconds per algorithm")
    parser.add_argument("--eval-every-s", type=float, default=30.0)
    parser.add_argument("--iterations", type=int, help="iteration budget per algorithm (replaces --budget)")
    parser.add_argument(
        "--nfe-budget", type=float, help="compute-equivalent budget (NFE + 2 x grad NFE; replaces --budget)"
    )
    parser.add_argument("--eval-every-it", type=int, help="evaluate every N iterations instead of every N seconds")
    parser.add_argument(
        "--eval-steps", type=int, help="fixed ODE steps for evaluation (default: each run's sampler steps)"
    )
    parser.add_argument("--algos", default="flow_grpo,diffusion_nft,awm")
    parser.add_argument(
        "--baseline", type=Path, help="a benchmarks-convergence.json whose flow_grpo curve is the baseline (not re-run)"
    )
    parser.add_argument(
        "--stop-confirmed",
        action="store_true",
        help="stop each algorithm at the baseline's final reward once the reader confirms it",
    )
    parser.add_argument("--out", default=str(REPO / "docs"))
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="no training: merge these benchmarks-convergence.json files (first has flow_grpo), plot and report",
    )
    parser.add_argument("overrides", nargs="*", help="key=value applied to every algorithm")
    args = parser.parse_args(argv)
    command = "python -m bench.convergence " + " ".join(argv if argv is not None else os.sys.argv[1:])
    if args.merge:
        merged = {k: v for path in args.merge for k, v in json.loads(path.read_text()).items()}
        write_results(merged, Path(args.out), "merged curves", command.strip())
        return
    results = {}
    if args.baseline is not None:
        results["flow_grpo"] = json.loads(args.baseline.read_text())["flow_grpo"]
    stop_at = results["flow_grpo"][-1]["eval/reward_mean"] if args.stop_confirmed and results else None
    count_budget = args.iterations is not None or args.nfe_budget is not None
    budget = None if count_budget else args.budget
    for name in args.algos.split(","):
        print(f"running {name}", flush=True)
        results[name] = run_one(
            name,
            budget,
            args.eval_every_s,
            args.overrides,
            iterations=args.iterations,
            nfe_budget=args.nfe_budget,
            eval_every_it=args.eval_every_it,
            eval_steps=args.eval_steps,
            stop_at=stop_at,
        )
    limits = [
        f"{args.iterations} iterations" if args.iterations else "",
        f"{args.nfe_budget:,.0f} compute-eq." if args.nfe_budget else "",
    ]
    write_results(
        results, Path(args.out), " / ".join(x for x in limits if x) if count_budget else args.budget, command.strip()
    )


def write_results(results: dict[str, list[dict[str, float]]], out: Path, budget: float | str, command: str) -> None:
    """Write the curves (JSON), the plot and the markdown section into ``out``; print the section."""
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "benchmarks-convergence.png")
    (out / "benchmarks-convergence.json").write_text(json.dumps(results, indent=1))
    section = report(results, budget, command)
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
