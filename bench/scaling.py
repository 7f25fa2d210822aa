"""Cost of a rollout and of an iteration against samples, steps, tokens, tree leaves and processes.

Usage::

    python -m bench.scaling [--rounds 3] [--train-leaves] [--processes] [--plot docs/benchmarks-scaling.png]

Sweeps (all on the shipped embedded ``flowrl-digits`` model with a LoRA r8 unless said otherwise):

- ``samples``: no-grad Flow-SDE rollouts (``flowrl.rollouts.chunked.chunked_rollout``, chunks of 40)
  of 5 to 80 samples (the group size times prompts), 5 steps;
- ``steps``: the same rollout of 20 samples on 2 to 20 steps;
- ``tokens``: random-init SD3 transformers of the embedded model's width and depth at latent sizes
  8, 16 and 32 (the embedded VAE and text encoders, so only the transformer changes), 8 samples,
  5 steps;
- ``leaves``: no-grad BranchGRPO tree rollouts through ``flowrl.tree.rollouts.chunked_tree_rollout``
  with the geometry of ``configs/branch/digits.yaml`` (10 trees, 10 steps, Dance-SDE 0.3, 4x split
  noise, chunks of 40), ``k = 1..5`` factor-2 splits spread evenly over the steps
  (:func:`spread_splits`; ``k = 4`` is the shipped 0, 3, 6, 9) -> 2 to 32 leaves per tree;
- ``--train-leaves``: whole BranchGRPO training iterations (``Trainer.train_step`` on
  ``configs/branch/digits.yaml`` with those splits: rollout, decode, rewards, update) per leaf count;
- ``--processes``: ``bench.scale_out.run`` on 1 and on 2 gloo processes (``accelerate launch``),
  alternating 1-2 / 2-1 over rounds; samples/s of rank 0's median iteration.

In-process points alternate within each round (so they share the host's load) and the median over
rounds is reported. FLOPs come from ``FlopCounterMode`` on the same call (the untimed warm-up);
model evaluations (NFE, one per sample row) and model calls (one per chunk) are counted by a
wrapper around the adapter and checked against :func:`flat_cost` / :func:`tree_cost`. The fitted
growth is the slope of log(time) against log(x) (1 = linear), printed beside the FLOP model's; the
rollouts of the embedded model are also fitted as ``time = a * calls + b * NFE`` (a fixed cost per
model call plus a cost per evaluated sample).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from bench.flop_floor import count_flops
from flowrl.models.adapter import Cond
from flowrl.policy.counting import CountingAdapter
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.tree import split_factors, tree_widths
from flowrl.tree.rollouts import chunked_tree_rollout

CHUNK = 40
TREES, TREE_STEPS, TREE_SDE, TREE_LEVEL, TREE_SPLIT_NOISE = 10, 10, "dance", 0.3, 4.0  # configs/branch/digits.yaml


class Cost(NamedTuple):
    """Work of one rollout: model calls (chunks) and model evaluations (sample rows, NFE)."""

    calls: int
    nfe: int


def spread_splits(num_steps: int, splits: int) -> list[int]:
    """``splits`` step indices spread evenly over [0, T - 1], rounded half up: 4 of 10 -> [0, 3, 6, 9].

    Raises:
        ValueError: ``splits`` not in 1..T.
    """
    if not 1 <= splits <= num_steps:
        raise ValueError(f"splits must be in 1..{num_steps} (one split per step at most); got {splits}")
    if splits == 1:
        return [0]
    return [int(i * (num_steps - 1) / (splits - 1) + 0.5) for i in range(splits)]


def tree_nfe_closed_form(num_steps: int, split_steps: list[int], factor: int = 2) -> int:
    """NFE of one tree with factor-``f`` splits at ``s_1 < ... < s_k``.

    ``(s_1 + 1) + f (s_2 - s_1) + ... + f^k (T - 1 - s_k)``: ``f^i`` nodes evaluated on every step
    from ``s_i + 1`` to ``s_{i+1}`` (docs/trees.md).
    """
    bounds = [-1, *split_steps, num_steps - 1]
    return sum(factor**i * (bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1))


def flat_cost(samples: int, steps: int, chunk: int) -> Cost:
    """Calls and NFE of a chunked flat rollout: ``steps * ceil(B / chunk)`` calls, ``steps * B`` rows."""
    return Cost(steps * -(-samples // chunk), steps * samples)


def tree_cost(factors: Tensor, num_trees: int, chunk: int) -> Cost:
    """Calls and NFE of ``num_trees`` chunked trees: the frontier ``N n_t`` of every step in chunks."""
    frontier = [num_trees * n for n in tree_widths(factors)[:-1]]
    return Cost(sum(-(-m // chunk) for m in frontier), sum(frontier))


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x) (the exponent of ``y ~ x^a``)."""
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def fit_calls_nfe(costs: list[Cost], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``seconds = a * calls + b * nfe`` (no intercept); returns (a, b) in seconds."""
    c, n = torch.tensor([k.calls for k in costs], dtype=torch.float64), torch.tensor([k.nfe for k in costs]).double()
    a = torch.stack([c, n], 1)
    sol = torch.linalg.lstsq(a, torch.tensor(seconds, dtype=torch.float64)[:, None]).solution
    return float(sol[0]), float(sol[1])


class CallCounter(CountingAdapter):
    """:class:`~flowrl.policy.counting.CountingAdapter` that also counts model calls."""

    def __init__(self, model: Any):
        super().__init__(model)
        self.calls = 0

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Count one call and ``B`` evaluations, then call the wrapped model."""
        self.calls += 1
        return super().velocity(x, sigma, cond)


def _model(latent: int | None = None) -> CallCounter:
    """The embedded adapter with a LoRA r8; with ``latent``, its transformer re-built at that latent size (random)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.models import load_adapter
    from flowrl.policy.lora import add_lora

    model = load_adapter("flowrl-digits")
    if latent is not None:
        cfg = dict(model.transformer.config)
        cfg.update(sample_size=latent, pos_embed_max_size=latent // cfg["patch_size"])
        torch.manual_seed(0)
        keep = {k: v for k, v in cfg.items() if not k.startswith("_")}
        model.pipe.transformer = SD3Transformer2DModel(**keep).requires_grad_(False)
        model.transformer = model.pipe.transformer
    add_lora(model.transformer, rank=8, alpha=16, targets=model.lora_target_modules)
    return CallCounter(model)


def _flat(model: CallCounter, samples: int, steps: int, latent: int) -> tuple[Callable[[], Any], Cost]:
    cond = model.encode_prompt(["a bold handwritten 7"] * samples)
    x = torch.randn(samples, model.transformer.config.in_channels, latent, latent)
    sigmas, levels = linear_sigmas(steps), sde_noise_levels(steps, 0.7)

    def fn() -> Any:
        return chunked_rollout(
            model, cond, x, sigmas, levels, chunk_size=CHUNK, generator=torch.Generator().manual_seed(0)
        )

    return fn, flat_cost(samples, steps, CHUNK)


def _tree(model: CallCounter, splits: int, latent: int) -> tuple[Callable[[], Any], Cost]:
    factors = split_factors(TREE_STEPS, spread_splits(TREE_STEPS, splits), [2])
    cond = model.encode_prompt([f"a bold handwritten {d}" for d in range(TREES)])
    roots = torch.randn(TREES, model.transformer.config.in_channels, latent, latent)
    sigmas, levels = linear_sigmas(TREE_STEPS), torch.full((TREE_STEPS,), TREE_LEVEL, dtype=torch.float64)

    def fn() -> Any:
        gen = torch.Generator().manual_seed(0)
        return chunked_tree_rollout(
            model, cond, roots, sigmas, levels, factors, chunk_size=CHUNK, split_noise_scale=TREE_SPLIT_NOISE,
            sde=TREE_SDE, generator=gen,
        )  # fmt: skip

    return fn, tree_cost(factors, TREES, CHUNK)


def _counted(model: CallCounter, fn: Callable[[], Any], expected: Cost) -> tuple[float, Cost]:
    """Run ``fn`` once under the FLOP counter (the warm-up); its denoiser FLOPs and counted cost (checked)."""
    model.nfe = model.calls = 0
    _, _, flops = count_flops(fn)
    counted = Cost(model.calls, model.nfe)
    if counted != expected:
        raise RuntimeError(f"counted {counted} but the formula says {expected}")
    return flops, counted


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def rollout_points(rounds: int) -> dict[str, Any]:
    """Time the in-process rollout sweeps (interleaved rounds); FLOPs and costs per point."""
    base = _model()
    side = base.latent_shape(*base.default_resolution)[-1]
    points: dict[tuple[str, int], tuple[CallCounter, Callable[[], Any], Cost]] = {}
    for samples in (5, 10, 20, 40, 80):
        points[("samples", samples)] = (base, *_flat(base, samples, 5, side))
    for steps in (2, 5, 10, 20):
        points[("steps", steps)] = (base, *_flat(base, 20, steps, side))
    for latent in (8, 16, 32):
        big = _model(latent)
        tokens = (latent // big.transformer.config.patch_size) ** 2
        points[("tokens", tokens)] = (big, *_flat(big, 8, 5, latent))
    for splits in range(1, 6):
        points[("leaves", 2**splits)] = (base, *_tree(base, splits, side))
    flops = {key: _counted(m, fn, cost)[0] for key, (m, fn, cost) in points.items()}
    load = _load()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in points}
    order = list(points)
    for r in range(rounds):
        for key in order if r % 2 == 0 else order[::-1]:  # forward, backward, ...: no point always follows another
            fn = points[key][1]
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {
        "load": [load, _load()],
        "rows": [
            {"sweep": sw, "x": x, "s": statistics.median(times[(sw, x)]), "min": min(times[(sw, x)]),
             "calls": points[(sw, x)][2].calls, "nfe": points[(sw, x)][2].nfe, "gflop": flops[(sw, x)] / 1e9,
             "splits": spread_splits(TREE_STEPS, int(math.log2(x))) if sw == "leaves" else None}
            for sw, x in points
        ],
    }  # fmt: skip


def train_leaf_points(rounds: int) -> dict[str, Any]:
    """Whole BranchGRPO iterations per leaf count, interleaved; one untimed warm-up under the FLOP counter."""
    from bench.tree_rollouts import _trainer

    trainers = {}
    for splits in range(1, 6):
        steps = spread_splits(TREE_STEPS, splits)
        over = [f"sampler.tree.split_steps=[{','.join(map(str, steps))}]", f"prompts.group_size={2**splits}"]
        trainers[2**splits] = _trainer("configs/branch/digits.yaml", over)
    flops, nfe = {}, {}
    for leaves, tr in trainers.items():
        before = tr.model.nfe
        _, _, flops[leaves] = count_flops(tr.train_step)
        nfe[leaves] = tr.model.nfe - before
    load = _load()
    it_s: dict[int, list[float]] = {k: [] for k in trainers}
    roll_s: dict[int, list[float]] = {k: [] for k in trainers}
    for r in range(rounds):
        for leaves in list(trainers) if r % 2 == 0 else list(trainers)[::-1]:
            tr = trainers[leaves]
            m = tr.train_step()
            it_s[leaves].append(m["time/iteration_s"])
            roll_s[leaves].append(m["time/sample_s"])
    return {
        "load": [load, _load()],
        "rows": [
            {"leaves": k, "samples": TREES * k, "nfe": nfe[k], "gflop": flops[k] / 1e9,
             "s": statistics.median(it_s[k]), "rollout_s": statistics.median(roll_s[k])}
            for k in trainers
        ],
    }  # fmt: skip


def process_points(rounds: int) -> dict[str, Any]:
    """``bench.scale_out.run`` on 1 and 2 processes, alternating 1-2 / 2-1 over rounds."""
    from bench import scale_out

    args = argparse.Namespace(prompts=8, group=4, chunk=8, steps=10, iterations=5)  # bench.scale_out's defaults
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for n in (1, 2) if r % 2 == 0 else (2, 1):
                runs[n].append(scale_out.run(n, args, Path(tmp) / f"r{r}p{n}"))
                print(f"  processes {n}, round {r}: {runs[n][-1]}", flush=True)
    return {"batch": args.prompts * args.group, "steps": args.steps, "runs": {str(k): v for k, v in runs.items()}}


def report(res: dict[str, Any]) -> str:
    """The markdown tables of a result dict (the JSON the script writes)."""
    ro = res["rollouts"]
    out = [
        f"In-process rollouts: load {ro['load'][0]} -> {ro['load'][1]}",
        "",
        "| sweep | x | model calls | NFE (sample evaluations) | denoiser GFLOP | median s | s per GFLOP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in ro["rows"]:
        out.append(
            f"| {r['sweep']} | {r['x']} | {r['calls']} | {r['nfe']} | {r['gflop']:.2f} | {r['s']:.3f} "
            f"| {r['s'] / r['gflop']:.3f} |"
        )
    out += ["", "| sweep | fitted growth of time (log-log slope) | FLOP model's slope |", "|---|---|---|"]
    for sweep in ("samples", "steps", "tokens", "leaves"):
        rows = [r for r in ro["rows"] if r["sweep"] == sweep]
        xs, ts, fs = [r["x"] for r in rows], [r["s"] for r in rows], [r["gflop"] for r in rows]
        out.append(f"| {sweep} | {slope(xs, ts):.2f} | {slope(xs, fs):.2f} |")
    leaves = [r for r in ro["rows"] if r["sweep"] == "leaves"]
    nfes = [r["nfe"] for r in leaves]
    out.append(f"| leaves: time against NFE | {slope(nfes, [r['s'] for r in leaves]):.2f} | 1.00 |")
    out.append(f"| leaves: NFE against leaves (flat rollouts: 1.00) | {slope([r['x'] for r in leaves], nfes):.2f} | |")
    base = [r for r in ro["rows"] if r["sweep"] != "tokens"]
    a, b = fit_calls_nfe([Cost(r["calls"], r["nfe"]) for r in base], [r["s"] for r in base])
    worst = max(abs(a * r["calls"] + b * r["nfe"] - r["s"]) / r["s"] for r in base)
    out += [
        "",
        f"Fit over the embedded model's rollouts (samples, steps, leaves; {len(base)} points): time = "
        f"{a * 1e3:.2f} ms x calls + {b * 1e3:.3f} ms x NFE; largest relative residual {worst:.0%}.",
    ]
    if "train_leaves" in res:
        tl = res["train_leaves"]
        out += [
            "",
            f"BranchGRPO training iterations: load {tl['load'][0]} -> {tl['load'][1]}",
            "",
            "| leaves per tree | samples | NFE (rollout + training) | denoiser GFLOP | median s/iteration "
            "| of it rollout s | s per GFLOP |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in tl["rows"]:
            out.append(
                f"| {r['leaves']} | {r['samples']} | {r['nfe']:,} | {r['gflop']:.2f} | {r['s']:.2f} "
                f"| {r['rollout_s']:.2f} | {r['s'] / r['gflop']:.3f} |"
            )
        xs = [r["leaves"] for r in tl["rows"]]
        out.append(
            f"\nslopes against leaves: time {slope(xs, [r['s'] for r in tl['rows']]):.2f}, "
            f"FLOPs {slope(xs, [r['gflop'] for r in tl['rows']]):.2f}, "
            f"NFE {slope(xs, [r['nfe'] for r in tl['rows']]):.2f}"
        )
    if "processes" in res:
        pr = res["processes"]
        out += [
            "",
            f"Processes (bench.scale_out.run, global batch {pr['batch']}, {pr['steps']} steps):",
            "",
            "| processes | samples/s per run | median samples/s | load 1-min before -> after each run |",
            "|---|---|---|---|",
        ]
        med = {}
        for n, runs in pr["runs"].items():
            med[n] = statistics.median(r["samples_s"] for r in runs)
            per = ", ".join(f"{r['samples_s']:.2f}" for r in runs)
            loads = ", ".join(f"{r['load_before']:.1f} -> {r['load_after']:.1f}" for r in runs)
            out.append(f"| {n} | {per} | {med[n]:.2f} | {loads} |")
        out.append(f"\n2 vs 1 processes: {med['2'] / med['1']:.2f}x (ideal 2.00x)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Run the sweeps, print the tables, write the JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-leaves", action="store_true", help="also time BranchGRPO training iterations")
    parser.add_argument("--processes", action="store_true", help="also run bench.scale_out on 1 and 2 processes")
    parser.add_argument("--process-rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    parser.add_argument("--replot", type=Path, default=None, help="print and plot a JSON written before; no runs")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.replot is not None:
        res = json.loads(args.replot.read_text())
    else:
        torch.set_num_threads(1)
        phases = {"rollouts": lambda: rollout_points(args.rounds)}
        if args.train_leaves:
            phases["train_leaves"] = lambda: train_leaf_points(args.rounds)
        if args.processes:
            phases["processes"] = lambda: process_points(args.process_rounds)
        res: dict[str, Any] = {"rounds": args.rounds}
        for name, phase in phases.items():
            res[name] = phase()
            if args.json is not None:  # after every phase, so a later failure keeps what was measured
                args.json.write_text(json.dumps(res, indent=1))
    print(f"{res.get('rounds', '?')} interleaved rounds, 1 thread\n" + report(res))
    if args.plot is not None:
        _plot(res, args.plot)


def _ticks(ax: Any, xs: list[int]) -> None:
    """Plain numbers at the measured x on a log-log panel."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xticks(xs)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rollouts"]["rows"]
    base = [r for r in rows if r["sweep"] != "tokens"]
    a, b = fit_calls_nfe([Cost(r["calls"], r["nfe"]) for r in base], [r["s"] for r in base])
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.2))
    labels = {"samples": "samples (5 steps)", "steps": "steps (20 samples)", "tokens": "image tokens (8 samples)"}
    for ax, sweep in zip(axes.flat, ("samples", "steps", "tokens", "leaves")):
        pts = [r for r in rows if r["sweep"] == sweep]
        xs, ts, fs = [r["x"] for r in pts], [r["s"] for r in pts], [r["gflop"] for r in pts]
        ax.loglog(xs, ts, "o-", label="rollout, measured")
        ax.loglog(xs, [ts[-1] * f / fs[-1] for f in fs], "--", label="FLOP model (through the last point)")
        if sweep != "tokens":
            fit = [a * r["calls"] + b * r["nfe"] for r in pts]
            ax.loglog(xs, fit, "-.", color="C2", label=f"{a * 1e3:.0f} ms x calls + {b * 1e3:.1f} ms x NFE (fit)")
        if sweep == "leaves":
            ax.loglog(xs, [ts[0] * x / xs[0] for x in xs], ":", color="grey", label="leaves x steps (flat)")
            ax.set_title("tree rollout, 10 trees x 10 steps", fontsize=9)
        ax.set_xlabel(labels.get(sweep, "leaves per tree"))
        ax.set_ylabel("s")
        _ticks(ax, xs)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes.flat[4]
    if "train_leaves" in res:
        tl = res["train_leaves"]["rows"]
        xs = [r["leaves"] for r in tl]
        ax.loglog(xs, [r["s"] for r in tl], "o-", label="iteration, measured")
        ax.loglog(xs, [r["rollout_s"] for r in tl], "s-", label="of it rollout (+ decode, rewards)")
        ax.loglog(xs, [tl[-1]["s"] * r["gflop"] / tl[-1]["gflop"] for r in tl], "--", label="FLOP model")
        ax.set_xlabel("leaves per tree")
        ax.set_ylabel("s / iteration")
        _ticks(ax, xs)
        ax.set_title("BranchGRPO training iteration, 10 trees", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    ax = axes.flat[5]
    if "processes" in res:
        pr = res["processes"]["runs"]
        for n, runs in pr.items():
            ax.plot([int(n)] * len(runs), [r["samples_s"] for r in runs], "o", color="C0")
        med = [statistics.median(r["samples_s"] for r in pr[n]) for n in ("1", "2")]
        ax.plot([1, 2], med, "-", color="C0", label="median")
        ax.plot([1, 2], [med[0], 2 * med[0]], "--", color="C1", label="ideal (linear)")
        ax.set_xticks([1, 2])
        ax.set_xlabel("processes (gloo)")
        ax.set_ylabel("samples / s")
        ax.set_title("Flow-GRPO training, global batch 32", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.suptitle("Cost against samples, steps, tokens, tree leaves and processes (embedded model, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
