"""Sweep DiffusionNFT / AWM settings against a Flow-GRPO baseline on the embedded task.

Usage::

    # 1. the baseline curve (Flow-GRPO at its tuned default, 36 iterations, eval every 2)
    python -m bench.convergence --algos flow_grpo --iterations 36 --eval-every-it 2 --eval-steps 10 --out OUT/base
    # 2. variants (named below), two processes at a time, each stopped once it reaches the target
    python -m bench.forward_sweep --baseline OUT/base/benchmarks-convergence.json --out OUT/sweep \
        --variants nft_ref,awm_ref
    # 3. the table of everything run so far
    python -m bench.forward_sweep --baseline OUT/base/benchmarks-convergence.json --out OUT/sweep --table
    # 4. seconds per iteration, variants interleaved with the baseline in one process (wall-clock ratios)
    python -m bench.forward_sweep --baseline ... --out OUT/timing --time-rounds 3 --variants nft_fastA,awm_fastA
    # 5. eval reward of the untrained model with true CFG (what a CFG baseline starts from)
    python -m bench.forward_sweep --baseline ... --out OUT/cfg --cfg-scales 1,1.5,3,4.5

The target is the baseline's final eval reward. Each variant trains until its eval reward (10-step
ODE, held-out seeds, evaluated every iteration) reaches the target, or until it has spent
``--cap`` times the baseline's compute to the target. Reported per variant: iterations, NFE,
compute equivalent (NFE + 2 x backpropagated forwards) and training wall time to the target,
each as a ratio to the baseline's (wall time: use ``--time-rounds``, which interleaves the
configurations in one process, since a shared host distorts separate runs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.convergence import REPO, ComputeCounter, first_reach, run_one

NFT = REPO / "configs/nft/digits.yaml"
AWM = REPO / "configs/awm/digits.yaml"
GRPO = REPO / "configs/grpo/digits.yaml"

# name -> (algorithm, config, overrides): the variants measured in docs/benchmarks.md.
# "ref" = the shipped config (reference defaults); "fastA" = configs/{nft,awm}/digits_fast.yaml.
FAST_SAMPLER = ["sampler.num_steps=5", "sampler.solver=dpmpp_2m"]
NFT_FAST = ["optim.lr=3e-3", "sampler.num_steps=5", "objective.train_fraction=0.5"]
AWM_FAST = ["optim.lr=3e-3", *FAST_SAMPLER, "objective.num_timesteps=2"]
VARIANTS: dict[str, tuple[str, Path, list[str]]] = {
    "grpo_ref": ("flow_grpo", GRPO, []),
    "grpo_lr3e-3": ("flow_grpo", GRPO, ["optim.lr=3e-3"]),
    "grpo_paperlike": ("flow_grpo", GRPO, ["optim.lr=3e-4", "objective.updates_per_iteration=2"]),
    "grpo_fast_lr3e-3": ("flow_grpo", GRPO, ["sampler.window=random", "sampler.window_size=2", "optim.lr=3e-3"]),
    "nft_ref": ("diffusion_nft", NFT, []),
    "nft_fastA": ("diffusion_nft", NFT, NFT_FAST),
    "nft_fast1": ("diffusion_nft", NFT, [*NFT_FAST, "prompts.per_iteration=10", "objective.updates_per_iteration=2"]),
    "nftA_lr1e-3": ("diffusion_nft", NFT, [*NFT_FAST, "optim.lr=1e-3"]),
    "nftA_steps10": ("diffusion_nft", NFT, [*NFT_FAST, "sampler.num_steps=10", "objective.train_fraction=0.2"]),
    "nftA_upd2": ("diffusion_nft", NFT, [*NFT_FAST, "objective.updates_per_iteration=2"]),
    "nftA_beta0.1": ("diffusion_nft", NFT, [*NFT_FAST, "objective.beta=0.1"]),
    "nftA_g4": ("diffusion_nft", NFT, [*NFT_FAST, "prompts.group_size=4", "prompts.per_iteration=40"]),
    "nft_fastB": ("diffusion_nft", NFT, [*NFT_FAST, "objective.kl_beta=0.0", "objective.ema_decay_max=0.0"]),
    "nft_fastC": (
        "diffusion_nft",
        NFT,
        [
            *NFT_FAST,
            "objective.kl_beta=0.0",
            "objective.ema_decay_max=0.0",
            "prompts.group_size=4",
            "prompts.per_iteration=40",
        ],
    ),
    "awm_ref": ("awm", AWM, []),
    "awm_fastA": ("awm", AWM, AWM_FAST),
    "awmA_lr1e-3": ("awm", AWM, [*AWM_FAST, "optim.lr=1e-3"]),
    "awmA_sde10": ("awm", AWM, [*AWM_FAST, "sampler.num_steps=10", "sampler.solver=sde_window"]),
    "awmA_ts6": ("awm", AWM, [*AWM_FAST, "objective.num_timesteps=6"]),
    "awmA_upd2": ("awm", AWM, [*AWM_FAST, "objective.updates_per_iteration=2"]),
    "awmA_g4": ("awm", AWM, [*AWM_FAST, "prompts.group_size=4", "prompts.per_iteration=40"]),
    "awmA_nokl": ("awm", AWM, [*AWM_FAST, "objective.kl_beta=0.0", "objective.ema_beta=0.0"]),
}


def parse_variant(spec: str) -> tuple[str, tuple[str, Path, list[str]]]:
    """``name`` from :data:`VARIANTS`, or ``name=base:key=value;key=value`` (base = a VARIANTS name)."""
    if "=" not in spec.split(":")[0]:
        if spec not in VARIANTS:
            raise ValueError(f"unknown variant {spec!r}; known: {', '.join(VARIANTS)} (or name=base:key=value;...)")
        return spec, VARIANTS[spec]
    name, rest = spec.split("=", 1)
    base, _, extra = rest.partition(":")
    if base not in VARIANTS:
        raise ValueError(f"variant {name!r}: unknown base {base!r}; known: {', '.join(VARIANTS)}")
    algo, config, overrides = VARIANTS[base]
    return name, (algo, config, [*overrides, *[x for x in extra.split(";") if x]])


def baseline_hit(path: Path) -> tuple[float, dict[str, float]]:
    """Target (the baseline's final eval reward) and the baseline's first point reaching it."""
    points = json.loads(path.read_text())["flow_grpo"]
    target = points[-1]["eval/reward_mean"]
    return target, first_reach(points, target)


def run_variant(job: tuple[str, str, str, list[str], float, float, int, str]) -> str:
    """Run one variant in a worker process and write OUT/name.json."""
    name, algo, config, overrides, stop, cap, max_it, out = job
    points = run_one(
        f"{name}",
        None,
        0.0,
        overrides,
        config=Path(config),
        iterations=max_it,
        nfe_budget=cap,
        eval_every_it=1,
        eval_steps=10,
        stop_at=stop,
    )
    Path(out, f"{name}.json").write_text(
        json.dumps(
            {"algo": algo, "config": str(Path(config).relative_to(REPO)), "overrides": overrides, "points": points},
            indent=1,
        )
    )
    return name


def table(
    out: Path, target: float, base: dict[str, float], names: list[str] | None = None, vs: str | None = None
) -> str:
    """Markdown table of the variants in ``out`` (all, or ``names`` in that order).

    With ``vs`` (a variant in ``out``, e.g. a stronger Flow-GRPO) the table also has the compute ratio to that
    variant's hit.
    """
    files = [out / f"{n}.json" for n in names] if names else sorted(out.glob("*.json"))
    strong = first_reach(json.loads((out / f"{vs}.json").read_text())["points"], target) if vs else None
    lines = [
        f"Target: Flow-GRPO's final eval reward {target:.4f}, reached by the baseline at iteration "
        f"{base['iteration']} "
        f"({base['nfe']:,} NFE, {base['compute']:,} compute-eq., {base['wall_s']:.0f} s).",
        "",
        "| variant | settings (diff to the shipped config) | compute-eq. / iteration | iterations | NFE ratio "
        "| compute ratio " + (f"| compute ratio vs {vs} " if strong else "") + "| ink / correctness at hit |",
        "|---|---|---|---|---|---|" + ("---|" if strong else "") + "---|",
    ]
    for f in files:
        if not f.is_file():
            continue
        d = json.loads(f.read_text())
        if "points" not in d:  # e.g. the baseline or timing files kept beside the variants
            continue
        hit = first_reach(d["points"], target)
        last = d["points"][-1]
        overrides = {o.split("=", 1)[0]: o for o in d["overrides"]}  # a later value of a key replaces an earlier one
        settings = f"`{d['config']}` " + (" ".join(f"`{o}`" for o in overrides.values()) or "(as shipped)")
        per_it = f"{d['points'][1]['compute'] / d['points'][1]['iteration']:,.0f}" if len(d["points"]) > 1 else "–"
        if hit is None:
            lines.append(
                f"| {f.stem} | {settings} | {per_it} | not reached in {last['iteration']} "
                f"(best {max(p['eval/reward_mean'] for p in d['points']):.4f}) "
                f"| > {last['nfe'] / base['nfe']:.2f} | > {last['compute'] / base['compute']:.2f} "
                + ("| – " if strong else "")
                + "| – |"
            )
            continue
        lines.append(
            f"| {f.stem} | {settings} | {per_it} | {hit['iteration']} | {hit['nfe'] / base['nfe']:.3f} "
            f"| {hit['compute'] / base['compute']:.3f} "
            + (f"| {hit['compute'] / strong['compute']:.3f} " if strong else "")
            + f"| {hit['eval/ink']:.3f} / {hit['eval/digit_correctness']:.3f} |"
        )
    return "\n".join(lines)


def time_per_iteration(specs: list[tuple[str, tuple[str, Path, list[str]]]], rounds: int) -> dict[str, list[float]]:
    """Seconds per training iteration of each variant, interleaved round by round in one process.

    Interleaving makes every variant see the same host load. Returns name -> list of per-round times.
    """
    from flowrl.config import load_config
    from flowrl.policy import build_policy
    from flowrl.prompts.sets import load_prompts
    from flowrl.recipe import build_reward
    from flowrl.runtime import configure_threads
    from flowrl.trainer import Trainer

    trainers = {}
    for name, (_, config, overrides) in specs:
        cfg = load_config(config, ["train.progress=false", *overrides])
        configure_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        policy = build_policy(cfg, trainable=True, counter=ComputeCounter)
        trainers[name] = Trainer(
            cfg, policy, build_reward(cfg), load_prompts(cfg.prompts.train), load_prompts(cfg.prompts.eval)
        )
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.train_step()
            times[name].append(time.perf_counter() - t0)
    return times


def cfg_baseline_rewards(scales: list[float]) -> dict[float, dict[str, float]]:
    """Eval reward of the untrained base model sampled with true CFG at each scale.

    Uses the same held-out seeds and 10-step ODE as every eval here; CFG costs 2 evaluations per step.
    """
    from flowrl.config import load_config
    from flowrl.policy import build_policy
    from flowrl.prompts.sets import load_prompts
    from flowrl.recipe import build_reward
    from flowrl.runtime import configure_threads
    from flowrl.trainer import Trainer

    out = {}
    for scale in scales:
        cfg = load_config(GRPO, [f"sampler.guidance_scale={scale}", "train.progress=false", "train.eval_steps=10"])
        configure_threads(cfg.train.threads)
        policy = build_policy(cfg, trainable=True, counter=ComputeCounter)
        trainer = Trainer(
            cfg, policy, build_reward(cfg), load_prompts(cfg.prompts.train), load_prompts(cfg.prompts.eval)
        )
        out[scale] = trainer.evaluate()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="benchmarks-convergence.json of a flow_grpo run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="", help="comma-separated names or name=base:key=value;key=value")
    parser.add_argument("--jobs", type=int, default=2, help="variants run in parallel (1 torch thread each)")
    parser.add_argument(
        "--cap", type=float, default=0.7, help="stop a variant at this fraction of the baseline's compute"
    )
    parser.add_argument("--max-iterations", type=int, default=200)
    parser.add_argument(
        "--stop-at", type=float, help="stop reward (default: the target); set it higher to keep points past the target"
    )
    parser.add_argument("--table", action="store_true", help="only print the table of what is in --out")
    parser.add_argument(
        "--time-rounds", type=int, help="only time iterations: flow_grpo baseline and the variants, interleaved"
    )
    parser.add_argument("--vs", help="with --table: also the compute ratio to this variant (e.g. grpo_lr3e-3)")
    parser.add_argument(
        "--cfg-scales", help="only evaluate the base model with true CFG at these comma-separated scales"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, base = baseline_hit(Path(args.baseline))
    names = [v for v in args.variants.split(",") if v]
    specs = [] if args.table else [parse_variant(v) for v in names]
    if args.cfg_scales:
        print("| CFG scale | eval reward | ink | digit correctness |\n|---|---|---|---|")
        for scale, ev in cfg_baseline_rewards([float(x) for x in args.cfg_scales.split(",")]).items():
            print(
                f"| {scale:g} | {ev['eval/reward_mean']:.4f} | {ev['eval/ink']:.4f} "
                f"| {ev['eval/digit_correctness']:.4f} |"
            )
        return
    if args.time_rounds:
        times = time_per_iteration([("flow_grpo", ("flow_grpo", GRPO, [])), *specs], args.time_rounds)
        (out / "iteration_times.json").write_text(json.dumps(times, indent=1))
        ref = statistics.median(times["flow_grpo"])
        print("| variant | median s / iteration | min | max | ratio to Flow-GRPO's median |\n|---|---|---|---|---|")
        for name, ts in times.items():
            print(
                f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} "
                f"| {statistics.median(ts) / ref:.3f} |"
            )
        return
    if not args.table and specs:
        cap = args.cap * base["compute"]
        stop = args.stop_at if args.stop_at is not None else target
        jobs = [(n, a, str(c), o, stop, cap, args.max_iterations, str(out)) for n, (a, c, o) in specs]
        with mp.get_context("spawn").Pool(max(1, min(args.jobs, len(jobs)))) as pool:
            for name in pool.imap_unordered(run_variant, jobs):
                print(f"done {name}", flush=True)
    print(table(out, target, base, names if args.table and names else None, args.vs if args.table else None))


if __name__ == "__main__":
    main()
