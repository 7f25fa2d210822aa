"""Sol-RL on the embedded digits model: explore-stage speed, and two-stage vs single-stage DiffusionNFT.

Usage::

    python -m bench.solrl speed  [--prompts 8] [--candidates 16] [--rounds 5]
    python -m bench.solrl budget [--budget-s 240] [--eval-every-s 40] [--seed 0] [--set solrl.candidates=8 ...]
        [--set-single optim.lr=6e-3 ...]
    python -m bench.solrl modes  [--budget-s 240] [--eval-every-s 40] [--set ...] [--set-correct ...]

``speed``: candidates per second of each explore setting against the full-precision rollout
(the stage-2 setting: the LoRA policy, ``sampler.num_steps`` DPM-Solver++(2M) steps), in one
process, the variants interleaved round by round so they see the same machine load. A
candidate's cost is what stage 1 pays for it: sampling, VAE decode and scoring. Printed with
each variant: the per-prompt Kendall tau of its rewards against the full-precision rewards of the
same seeds, and the share of the full-precision ``best_worst`` selection (K of N per prompt) it
picks too.

``budget``: ``configs/nft/digits_fast.yaml`` (single stage) and ``configs/solrl/digits.yaml``
(two stage, with ``--set`` overrides) train from the same base model, prompts, seed and rewards
(both use the solrl config's ``rewards``) for the same training wall time (evaluation excluded);
the arm whose clock is behind takes the next iteration, so both progress together and share the
machine's load. Evaluated every ``--eval-every-s`` seconds of each arm's own training time by the
held-out evaluation (``Trainer.evaluate_heldout``, ``--eval-seeds`` seeds x 20 prompts): its reward,
and the independent digit reader (:mod:`flowrl.models.digits.reader`, through the convergence
harness's :func:`bench.convergence.reader_figures`) on the same samples: its accuracy on the
prompted digit (all, bold, thin) and the ink gap bold - thin. An arm reaches the target when its
reward is at least the single-stage run's final reward and the reader's accuracy is at least the
base model's on the same seeds (:func:`bench.convergence.confirmed`); the speed-up is the ratio of
the reaching times. The per-budget tables also give the speed-ups where every evaluation that counts
kept at least :data:`DIVERSITY_FLOOR` of the base model's per-prompt diversity: a reward reached by
collapsing onto a few shapes per prompt, which the reader alone does not see, does not count there.

``modes``: ``solrl.mode: regenerate`` (the two-stage DiffusionNFT arm above) against ``correct``
(``configs/grpo/digits.yaml``'s Flow-GRPO trained directly on SDE rollouts drawn by the int8
explore copy, with truncated importance weights), raced the same way; the target is the lower of
the two final rewards, reader-confirmed as above.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from bench.convergence import confirmed, reader_figures
from flowrl.config import Config, load_config
from flowrl.policy import build_policy
from flowrl.policy.precision import build_explore
from flowrl.prompts.batch import collate
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward, load_run_prompts
from flowrl.rollouts.chunked import chunked_solve
from flowrl.runtime import configure_threads, seeded_noise
from flowrl.solrl.diagnostics import kendall_tau
from flowrl.solrl.explore import explore_transformer
from flowrl.solrl.selection import select_seeds
from flowrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
SOLRL = REPO / "configs/solrl/digits.yaml"
SINGLE = REPO / "configs/nft/digits_fast.yaml"
GRPO = REPO / "configs/grpo/digits.yaml"
CORRECT = ["solrl.mode=correct", "solrl.precision=int8_dynamic"]  # Flow-GRPO on the int8 explore copy's rollouts
DIVERSITY_FLOOR = 0.8  # the alignment issue's floor: per-prompt diversity >= 80 % of the base model's
EVAL_SEEDS = 20  # held-out seeds per eval prompt (train.eval_seeds) for the reward and the reader: 400 samples
# an evaluation row's figures that `report` prints after train s and iteration (bench.solrl_frontier reads them)
# the diversity ratio (held-out samples' spread over the base model's; the alignment issue's floor is 0.8) shows
# a reward reached by collapsing onto few shapes, which the reader alone does not
TABLE_KEYS = ["eval/reward_mean", "reader", "reader_bold", "reader_thin", "ink_gap", "eval/diversity_ratio"]

VARIANTS = [  # name, precision (None = the LoRA policy itself), build options, steps (None = sampler.num_steps)
    ("full precision (stage 2)", None, {}, None),
    ("full precision, 10 steps", None, {}, 10),
    ("fp32 merged, 3 steps", "fp32", {}, 3),
    ("bf16 merged, 3 steps", "bf16", {}, 3),
    ("int8_dynamic, 5 steps", "int8_dynamic", {}, None),
    ("int8_dynamic, 4 steps", "int8_dynamic", {}, 4),
    ("int8_dynamic, 3 steps", "int8_dynamic", {}, 3),
    ("int8_dynamic, 2 steps", "int8_dynamic", {}, 2),
    ("nvfp4 W4A4 emulated, 6 steps", "nvfp4", {"activations": True}, 6),
]


def machine() -> str:
    """Date, torch, CPU, cores, threads and the load average."""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    return (
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
        f"load {' '.join(load)}"
    )


# --------------------------------------------------------------------------- speed


def candidates(policy: Any, module: Any, reward: Any, batch: Any, cond: Any, noise: torch.Tensor, steps: int) -> Any:
    """Stage-1 work for ``noise.shape[0]`` candidates: sample, decode, score. Returns (rewards (B,), seconds)."""
    start = time.perf_counter()
    chunk = 40
    with explore_transformer(policy.model, module) if module is not None else nullcontext():
        latents = chunked_solve(policy.model, cond, noise, policy.sigmas(steps), solver="dpmpp_2m", chunk_size=chunk)
    with torch.no_grad():
        images = torch.cat([policy.model.decode(latents[i : i + chunk]) for i in range(0, latents.shape[0], chunk)])
    total = reward(images, batch.texts, **batch.metadata).total
    return total, time.perf_counter() - start


def speed(args: argparse.Namespace) -> None:
    cfg = load_config(SOLRL)
    torch.manual_seed(cfg.train.seed)
    policy = build_policy(cfg, trainable=True)
    reward = build_reward(cfg)
    chosen = load_prompts(cfg.prompts.train)[: args.prompts]
    batch = collate(chosen, repeats=args.candidates)
    cond = policy.model.encode_prompt(batch.texts)
    seeds = [1000 + j for j in range(len(batch.texts))]
    noise = seeded_noise(policy.latent_shape, seeds)
    variants = {}
    for name, precision, options, steps in VARIANTS:
        if precision is not None and args.only and not any(word in name for word in args.only):
            continue
        module = None if precision is None else build_explore(policy, precision, **options).module
        variants[name] = (module, steps or cfg.sampler.num_steps)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    rewards: dict[str, torch.Tensor] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and gives the rewards: deterministic)
        for name, (module, steps) in variants.items():
            total, seconds = candidates(policy, module, reward, batch, cond, noise, steps)
            rewards[name] = total.double()
            if round_:
                rates[name].append(len(seeds) / seconds)
    k = cfg.prompts.group_size
    reference = rewards[VARIANTS[0][0]].reshape(args.prompts, -1)
    base = statistics.median(rates[VARIANTS[0][0]])
    print(f"Machine: {machine()}")
    print(
        f"{args.prompts} prompts x {args.candidates} candidates (sample + decode + score), "
        f"rewards {sorted(cfg.rewards)}; median (min-max) of {args.rounds} interleaved rounds\n"
    )
    print("| variant | steps | candidates/s | vs full precision | per-prompt Kendall tau | best_worst overlap |")
    print("|---|---|---|---|---|---|")
    for name, (_, steps) in variants.items():
        got = rewards[name].reshape(args.prompts, -1)
        taus = [kendall_tau(a, b) for a, b in zip(got, reference)]
        overlap = [
            len(set(select_seeds(a, k).tolist()) & set(select_seeds(b, k).tolist())) / k for a, b in zip(got, reference)
        ]
        r = rates[name]
        print(
            f"| {name} | {steps} | {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) "
            f"| {statistics.median(r) / base:.2f}x | {statistics.mean(taus):.3f} | {statistics.mean(overlap):.3f} |",
            flush=True,
        )


# --------------------------------------------------------------------------- budget


class Arm:
    """One training run of the comparison: its trainer, its own training clock and its evaluations."""

    def __init__(self, name: str, cfg: Config):
        self.name, self.cfg = name, cfg
        torch.manual_seed(cfg.train.seed)
        train_prompts, eval_prompts = load_run_prompts(cfg)
        self.trainer = Trainer(cfg, build_policy(cfg, trainable=True), build_reward(cfg), train_prompts, eval_prompts)
        self.clock = 0.0
        self.rows: list[dict[str, float]] = []
        self.last: dict[str, float] = {}

    def step(self) -> None:
        start = time.perf_counter()
        self.last = self.trainer.train_step()
        self.clock += time.perf_counter() - start

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation (``Trainer.evaluate_heldout``) and the reader on its samples; appended to ``rows``."""
        held_out = self.trainer.evaluate_heldout()
        row = {"train_s": self.clock, "iteration": float(self.trainer.iteration)}
        row.update({k: v for k, v in held_out.metrics.items() if k.count("/") == 1})
        row.update(reader_figures(held_out.images, self.trainer.heldout.batch.metadata))
        row.update({k: v for k, v in self.last.items() if k.startswith("solrl/")})
        self.rows.append(row)
        return row


def kept_diversity(row: dict[str, float], diversity_floor: float | None) -> bool:
    """Whether an evaluation kept ``diversity_floor`` of the base model's diversity (always True for None)."""
    return diversity_floor is None or row["eval/diversity_ratio"] >= diversity_floor


def reach_time(rows: list[dict[str, float]], target: float, diversity_floor: float | None = None) -> float | None:
    """Training seconds at which an arm first reaches ``target``, reader-confirmed; None if it never does.

    The first evaluation that :func:`bench.convergence.confirmed` accepts (reward >= ``target``, the
    reader at least the base model's, row 0), and that kept ``diversity_floor`` of the base model's
    diversity when one is given (:func:`kept_diversity`); its time is interpolated linearly on the
    reward from the previous evaluation when that one was below the target, else it is that
    evaluation's time.
    """
    floor = rows[0]["reader"]
    for i, row in enumerate(rows):
        if not confirmed(row, target, floor) or not kept_diversity(row, diversity_floor):
            continue
        before = rows[i - 1] if i else None
        if before is None or before["eval/reward_mean"] >= target:
            return row["train_s"]
        share = (target - before["eval/reward_mean"]) / (row["eval/reward_mean"] - before["eval/reward_mean"])
        return before["train_s"] + share * (row["train_s"] - before["train_s"])
    return None


def speedups_by_budget(
    single: list[dict[str, float]], two: list[dict[str, float]], diversity_floor: float | None = None
) -> list[dict[str, Any]]:
    """The speed-up at every shorter budget: each single-stage evaluation's reward taken as the target.

    For the single-stage evaluation at training time ``B`` (every row after the base row), the target
    is its reward at ``B``; both arms' reader-confirmed reaching times (:func:`reach_time`, over all
    of each arm's evaluations) give the speed-up ``t_single / t_two``. The last row is the budget race
    itself; the earlier rows are what a race with budget ``B`` would have measured, from one run.

    Args:
        single: the single-stage arm's evaluation rows (row 0: the base model).
        two: the two-stage arm's rows.
        diversity_floor: also require this diversity ratio (:func:`kept_diversity`) of the target
            evaluation itself and of the reaching ones; single-stage evaluations below it set no target.

    Returns:
        One dict per single-stage evaluation: ``budget_s``, ``target``, ``single_s``, ``two_s`` (None
        where never reached, reader-confirmed) and ``speedup`` (None unless both reached it).
    """
    out = []
    for row in single[1:]:
        if not kept_diversity(row, diversity_floor):
            continue
        target = row["eval/reward_mean"]
        t1, t2 = reach_time(single, target, diversity_floor), reach_time(two, target, diversity_floor)
        ratio = t1 / t2 if t1 is not None and t2 else None
        out.append({"budget_s": row["train_s"], "target": target, "single_s": t1, "two_s": t2, "speedup": ratio})
    return out


def _seconds(t: float | None) -> str:
    return "never" if t is None else f"{t:.0f}"


def budget_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`speedups_by_budget`."""
    lines = ["| budget s | target (single-stage reward there) | single s | two s | speed-up |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        times = f"{_seconds(r['single_s'])} | {_seconds(r['two_s'])}"
        lines.append(f"| {r['budget_s']:.0f} | {r['target']:.3f} | {times} | {ratio} |")
    return "\n".join(lines)


def race(arms: list[Arm], budget_s: float, eval_every_s: float) -> None:
    """Train every arm for ``budget_s`` seconds of its own clock, evaluating every ``eval_every_s``.

    The arm whose clock is behind takes the next iteration, so the arms progress together and
    share the machine's load (evaluation is not on the clock).
    """
    for arm in arms:
        print(f"{arm.name}: {arm.evaluate()}", flush=True)
    next_eval = {arm.name: eval_every_s for arm in arms}
    while any(arm.clock < budget_s for arm in arms):
        arm = min((a for a in arms if a.clock < budget_s), key=lambda a: a.clock)
        arm.step()
        if arm.clock >= next_eval[arm.name] or arm.clock >= budget_s:
            next_eval[arm.name] += eval_every_s
            print(f"{arm.name}: {arm.evaluate()}", flush=True)


def report(arms: list[Arm], budget_s: float, target: float, what: str) -> list[float | None]:
    """Print the evaluation table and when each arm first reaches ``target`` with the reader at base level.

    Returns:
        Each arm's reaching time (seconds of training), None where it never did.
    """
    base = arms[0].rows[0]["reader"]  # every arm starts from the same base model and reads the same seeds
    print(f"\nMachine at the end: {machine()}")
    print(f"Same training wall budget {budget_s:.0f} s per arm (evaluation excluded)\n")
    columns = "reward | reader | reader bold | reader thin | ink gap | diversity ratio"
    print(f"| arm | train s | iteration | {columns} | reached |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        for row in arm.rows:
            cells = " | ".join(f"{row[k]:.3f}" for k in TABLE_KEYS)
            ok = confirmed(row, target, base)
            print(f"| {arm.name} | {row['train_s']:.0f} | {int(row['iteration'])} | {cells} | {'yes' if ok else ''} |")
    times = [reach_time(arm.rows, target) for arm in arms]
    shown = ", ".join(f"{a.name} {t:.0f} s" if t is not None else f"{a.name} never" for a, t in zip(arms, times))
    ratio = ""
    if None not in times and times[1]:
        ratio = f"; speed-up of {arms[1].name} over {arms[0].name}: {times[0] / times[1]:.2f}x"
    seeds = arms[0].cfg.train.eval_seeds
    print(
        f"\ntarget: eval/reward_mean >= {target:.3f} ({what}) with the reader's accuracy >= the base model's "
        f"{base:.3f} (the held-out evaluation's {seeds} seeds x 20 prompts): {shown}{ratio}"
    )
    return times


def _shared(args: argparse.Namespace) -> list[str]:
    """Overrides of every arm: no progress bar, ``--eval-seeds`` held-out seeds per prompt, ``--seed``."""
    seed = [f"train.seed={args.seed}"] if args.seed is not None else []
    return ["train.progress=false", f"train.eval_seeds={args.eval_seeds}", *seed]


def budget_summary(rows: list[dict[str, Any]], from_s: float) -> str:
    """One line: the smallest and the median speed-up over the budgets of at least ``from_s`` seconds.

    Args:
        rows: :func:`speedups_by_budget`'s rows.
        from_s: the shortest budget that counts.

    Returns:
        The line. A budget whose target two stage never reached counts as a speed-up of 0; one whose
        target single stage itself never confirmed (its reader below the base's there) is left out.
    """
    ratios = [
        0.0 if r["two_s"] is None else r["speedup"]
        for r in rows
        if r["budget_s"] >= from_s and r["single_s"] is not None and (r["two_s"] is None or r["speedup"] is not None)
    ]
    if not ratios:
        return f"no budget of {from_s:.0f} s or more"
    return (
        f"over the {len(ratios)} budgets of {from_s:.0f} s or more: smallest {min(ratios):.2f}x, "
        f"median {statistics.median(ratios):.2f}x"
    )


def arm_configs(args: argparse.Namespace) -> tuple[Config, Config]:
    """The single-stage and the two-stage configs of a budget race.

    Both arms get the two-stage file's rewards and its ``objective.kl_beta`` (the same task and the same
    pull to the base model), then their own overrides (``--set-single``, ``--set``).
    """
    shared = _shared(args)
    two = load_config(SOLRL, [*shared, *args.set])
    one = load_config(SINGLE, [*shared, f"objective.kl_beta={two.objective['kl_beta']}", *args.set_single])
    one.rewards = two.rewards  # the same task for both arms
    return one, two


def budget(args: argparse.Namespace) -> None:
    """Single-stage DiffusionNFT against the two-stage pipeline; the target is the single-stage final reward."""
    one, two = arm_configs(args)
    arms = [Arm("single-stage DiffusionNFT", one), Arm("two-stage Sol-RL", two)]
    kl = (one.objective["kl_beta"], two.objective["kl_beta"])
    print(
        f"Machine: {machine()}; rewards {two.rewards}; kl_beta {kl[0]} / {kl[1]}; "
        f"overrides {args.set_single} / {args.set}",
        flush=True,
    )
    race(arms, args.budget_s, args.eval_every_s)
    report(arms, args.budget_s, arms[0].rows[-1]["eval/reward_mean"], "the single-stage run's final reward")
    print("\nAt every shorter budget (target: the single-stage reward at each of its evaluations, reader-confirmed):\n")
    every = speedups_by_budget(arms[0].rows, arms[1].rows)
    print(budget_table(every))
    print(f"\nSpeed-up {budget_summary(every, args.budget_s / 2)}")
    print(
        f"\nThe same, where the evaluations also keep >= {DIVERSITY_FLOOR:.0%} of the base model's diversity "
        "(eval/diversity_ratio, the alignment issue's floor):\n"
    )
    kept = speedups_by_budget(arms[0].rows, arms[1].rows, DIVERSITY_FLOOR)
    print(budget_table(kept))
    print(f"\nSpeed-up with the floor {budget_summary(kept, args.budget_s / 2)}")


def modes(args: argparse.Namespace) -> None:
    """``solrl.mode: regenerate`` (two-stage DiffusionNFT) against ``correct`` (Flow-GRPO on explore rollouts)."""
    shared = _shared(args)
    regenerate = load_config(SOLRL, [*shared, *args.set])
    correct = load_config(GRPO, [*shared, *CORRECT, *args.set_correct])
    correct.rewards = regenerate.rewards
    arms = [
        Arm("regenerate (DiffusionNFT, two-stage)", regenerate),
        Arm("correct (Flow-GRPO, explore rollouts + IS)", correct),
    ]
    print(f"Machine: {machine()}; rewards {regenerate.rewards}; correct arm {CORRECT + args.set_correct}", flush=True)
    race(arms, args.budget_s, args.eval_every_s)
    target = min(arm.rows[-1]["eval/reward_mean"] for arm in arms)
    report(arms, args.budget_s, target, "the lower of the two final rewards")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.solrl``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("speed", "budget", "modes"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--only", nargs="*", default=[], help="speed: the explore variants whose name holds one of these words"
    )
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--eval-every-s", type=float, default=40.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="train.seed of every arm (default: the configs')")
    parser.add_argument("--eval-seeds", type=int, default=EVAL_SEEDS, help="held-out seeds per eval prompt")
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides of the two-stage (regenerate) arm")
    parser.add_argument("--set-single", nargs="*", default=[], help="key=value overrides of the single-stage arm")
    parser.add_argument("--set-correct", nargs="*", default=[], help="key=value overrides of the `correct` arm")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    configure_threads(args.threads)
    {"speed": speed, "budget": budget, "modes": modes}[args.part](args)


if __name__ == "__main__":
    main()
