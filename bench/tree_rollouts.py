"""Tree rollouts (BranchGRPO) against flat trajectories on the embedded model, one process.

Usage::

    python -m bench.tree_rollouts [--part nfe,iteration,leaves] [--repeats 5] [--leaf-iterations 12]

Parts:

- ``nfe``: model evaluations of one tree of 16 leaves (4 splits of factor 2, 10 steps) against
  16 flat trajectories, counted by ``CountingAdapter`` and compared with the formula
  ``NFE = sum_t n_t`` for several split schedules.
- ``iteration``: wall time per training iteration at equal leaves (10 prompts x 16 samples):
  flat Flow-GRPO (configs/grpo/digits.yaml) against BranchGRPO (configs/branch/digits.yaml),
  alternating iterations of the two trainers so both see the same machine load; medians and
  their ratio. Also run with the KL term off for both.
- ``diversity``: base-model leaf reward and within-group reward std of trees (several SDE /
  split-noise settings) against 16 flat Flow-SDE samples per prompt (20 prompts).
- ``leaves``: DiffusionNFT and AWM trained on tree leaves (``sampler.solver=tree``, group of 16
  per prompt, 10 prompts) against their flat configs (20 prompts x 8, their own solvers), the
  same number of iterations: eval reward, model evaluations and training time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.policy import build_policy
from flowrl.policy.counting import CountingAdapter
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.runtime import configure_threads
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.tree import split_factors, tree_nfe, tree_widths
from flowrl.trainer import Trainer
from flowrl.tree.rollouts import chunked_tree_rollout

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = {
    "0,3,6,9 (BranchGRPO's split points)": [0, 3, 6, 9],
    "0,1,3,4 (its 20-step spacing scaled to 10)": [0, 1, 3, 4],
    "1,3,5,7": [1, 3, 5, 7],
    "2,4,6,8": [2, 4, 6, 8],
    "6,7,8,9": [6, 7, 8, 9],
}


def part_nfe(steps: int = 10) -> str:
    """Counted vs formula NFE of one 16-leaf tree per schedule, against 16 flat trajectories."""
    model = CountingAdapter(load_adapter("flowrl-digits"))
    cond = model.encode_prompt(["a bold handwritten 3"])
    sigmas, levels = linear_sigmas(steps), torch.full((steps,), 0.3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    model.nfe = 0
    chunked_rollout(
        model,
        model.encode_prompt(["a bold handwritten 3"] * 16),
        torch.randn(16, 4, 8, 8, generator=gen),
        sigmas,
        sde_noise_levels(steps, 0.7),
        chunk_size=40,
        generator=gen,
    )
    flat = model.nfe
    rows = [
        f"Flat: 16 trajectories x {steps} steps = {flat} model evaluations counted ({flat / 16:.2f} per leaf).",
        "",
        "| split steps | nodes per depth n_0..n_T | NFE formula sum_t n_t | NFE counted | per leaf | vs flat |",
        "|---|---|---|---|---|---|",
    ]
    for name, splits in SCHEDULES.items():
        factors = split_factors(steps, splits, [2])
        model.nfe = 0
        tree = chunked_tree_rollout(
            model,
            cond,
            torch.randn(1, 4, 8, 8, generator=gen),
            sigmas,
            levels,
            factors,
            chunk_size=40,
            split_noise_scale=4.0,
            sde="dance",
            generator=gen,
        )
        leaves = tree.leaves.shape[0]
        formula = tree_nfe(factors)
        rows.append(
            f"| {name} | {tree_widths(factors)} | {formula} | {model.nfe} | {model.nfe / leaves:.2f} "
            f"| {model.nfe / flat:.1%} |"
        )
    return "\n".join(rows)


def part_diversity(prompts_n: int = 20) -> str:
    """Mean leaf reward and mean within-group reward std of the base model: trees vs flat."""
    cfg = load_config(REPO / "configs/branch/digits.yaml")
    model, reward = load_adapter("flowrl-digits"), build_reward(cfg)
    from flowrl.prompts.batch import sample_groups

    batch = sample_groups(load_prompts("digits-styles"), prompts_n, 16, torch.Generator().manual_seed(0))
    cond = model.encode_prompt(batch.texts)
    sigmas, factors = linear_sigmas(10), split_factors(10, [0, 3, 6, 9], [2])
    rows = [
        "| rollout | SDE, level | split noise | mean leaf reward | within-group reward std |",
        "|---|---|---|---|---|",
    ]
    for sde, level, scale in [("dance", 0.3, 4.0), ("dance", 0.3, 1.0), ("flow", 0.7, 1.0), ("flow", 0.7, 4.0)]:
        gen = torch.Generator().manual_seed(1)
        tree = chunked_tree_rollout(
            model,
            {k: v[::16] for k, v in cond.items()},
            torch.randn(prompts_n, 4, 8, 8, generator=gen),
            sigmas,
            torch.full((10,), level, dtype=torch.float64),
            factors,
            chunk_size=40,
            split_noise_scale=scale,
            sde=sde,
            generator=gen,
        )
        r = reward(model.decode(tree.leaves), batch.texts, **batch.metadata).total
        rows.append(
            f"| tree 0,3,6,9 x2 | {sde}, {level} | {scale:g}x | {float(r.mean()):.4f} "
            f"| {float(r.view(prompts_n, 16).std(1).mean()):.4f} |"
        )
    gen = torch.Generator().manual_seed(1)
    traj = chunked_rollout(
        model,
        cond,
        torch.randn(prompts_n * 16, 4, 8, 8, generator=gen),
        sigmas,
        sde_noise_levels(10, 0.7),
        chunk_size=40,
        generator=gen,
    )
    r = reward(model.decode(traj.latents[:, -1]), batch.texts, **batch.metadata).total
    rows.append(
        f"| flat, 16 independent samples | flow, 0.7 (last step ODE) | – | {float(r.mean()):.4f} "
        f"| {float(r.view(prompts_n, 16).std(1).mean()):.4f} |"
    )
    return "\n".join(rows)


def _trainer(config: str, overrides: list[str]) -> Trainer:
    cfg = load_config(REPO / config, ["train.progress=false", *overrides])
    configure_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    return Trainer(
        cfg,
        build_policy(cfg, model=load_adapter(cfg.model.path), trainable=True),
        build_reward(cfg),
        load_prompts(cfg.prompts.train),
        load_prompts(cfg.prompts.eval),
    )


def part_iteration(repeats: int) -> str:
    """Median seconds per training iteration, flat Flow-GRPO vs BranchGRPO, alternating."""
    equal = ["prompts.per_iteration=10", "prompts.group_size=16"]
    cases = {
        "KL 0.04 (shipped configs)": [],
        "no KL (both)": ["objective.kl_beta=0"],
    }
    rows = [
        "| setting | algorithm | samples/iteration | NFE/iteration (rollout + training) | median s/iteration "
        "| min | max | ratio tree/flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, extra in cases.items():
        flat = _trainer("configs/grpo/digits.yaml", equal + extra)
        tree = _trainer("configs/branch/digits.yaml", extra)
        times: dict[str, list[float]] = {"flat": [], "tree": []}
        nfe: dict[str, int] = {}
        for r in range(repeats + 1):  # the first round warms up both and is dropped
            for key, trainer in (("flat", flat), ("tree", tree)):
                before = trainer.model.nfe
                t0 = time.perf_counter()
                trainer.train_step()
                if r > 0:
                    times[key].append(time.perf_counter() - t0)
                nfe[key] = trainer.model.nfe - before
        med = {k: statistics.median(v) for k, v in times.items()}
        for key, name in (("flat", "Flow-GRPO, flat"), ("tree", "BranchGRPO, tree")):
            ratio = f"**{med['tree'] / med['flat']:.2f}**" if key == "tree" else "1"
            rows.append(
                f"| {label} | {name} | 160 | {nfe[key]:,} | {med[key]:.2f} | {min(times[key]):.2f} "
                f"| {max(times[key]):.2f} | {ratio} |"
            )
        print(rows[-2] + "\n" + rows[-1], flush=True)
    return "\n".join(rows)


def part_leaves(iterations: int) -> str:
    """NFT / AWM on flat rollouts vs on tree leaves: eval reward after the same iterations."""
    tree = [
        "sampler.solver=tree",
        "prompts.per_iteration=10",
        "prompts.group_size=16",
        "sampler.sde=dance",
        "sampler.noise_level=0.3",
    ]
    runs = {
        ("diffusion_nft", "flat (20 x 8, DPM-Solver++(2M))"): ("configs/nft/digits.yaml", []),
        ("diffusion_nft", "tree leaves (10 x 16)"): ("configs/nft/digits.yaml", tree),
        ("awm", "flat (20 x 8, SDE window)"): ("configs/awm/digits.yaml", []),
        ("awm", "tree leaves (10 x 16)"): ("configs/awm/digits.yaml", tree),
    }
    rows = [
        f"| objective | rollout | eval reward start | after {iterations} it. | NFE (all) | rollout NFE/it. "
        "| training s | s/iteration |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (algo, label), (config, extra) in runs.items():
        trainer = _trainer(config, extra)
        start = trainer.evaluate()["eval/reward_mean"]
        train_s, rollout_nfe = 0.0, 0
        for _ in range(iterations):
            before = trainer.model.nfe
            t0 = time.perf_counter()
            batch, _ = trainer.collect()
            rollout_nfe = trainer.model.nfe - before
            trainer.update(batch)
            trainer.iteration += 1
            trainer.objective.after_iteration(trainer.model, trainer.iteration)
            train_s += time.perf_counter() - t0
        end = trainer.evaluate()["eval/reward_mean"]
        rows.append(
            f"| {algo} | {label} | {start:.4f} | {end:.4f} | {trainer.model.nfe:,} | {rollout_nfe:,} | {train_s:.0f} "
            f"| {train_s / iterations:.2f} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="nfe,iteration,leaves")
    parser.add_argument("--repeats", type=int, default=5, help="timed iterations per trainer (after one warm-up)")
    parser.add_argument("--leaf-iterations", type=int, default=12)
    args = parser.parse_args(argv)
    parts = args.part.split(",")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.1f} at start",
        flush=True,
    )
    if "nfe" in parts:
        print("\n## NFE per leaf\n\n" + part_nfe(), flush=True)
    if "iteration" in parts:
        print("\n## Wall time per training iteration (equal leaves)\n\n" + part_iteration(args.repeats), flush=True)
    if "diversity" in parts:
        print("\n## Leaf reward and group diversity (base model)\n\n" + part_diversity(), flush=True)
    if "leaves" in parts:
        print("\n## NFT / AWM on tree leaves\n\n" + part_leaves(args.leaf_iterations), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end", flush=True)


if __name__ == "__main__":
    main()
