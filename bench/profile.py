"""Where the time of one training iteration goes, per objective, on the real training path.

Usage: ``python -m bench.profile [--models digits tiny64] [--objectives flow_grpo awm ...]
[--iterations 3] [--warmup 1] [--device cpu|cuda] [--write docs/benchmarks.md]``.

Each objective's shipped config (``configs/<algo>/digits.yaml``) is built by ``flowrl.recipe.Run``
(the same policy stack, trainer, rewards and prompts as ``flowrl train``) and
``Trainer.train_step`` runs ``--warmup`` + ``--iterations`` times; the rest of a real iteration
(``MetricsLogger.log`` and the checkpoint, amortised over ``train.save_every``) is timed beside it.
Periodic evaluation is not part of an iteration and is left out; its side effect, a warm prompt
cache, is kept (``Trainer.warm_prompts``: otherwise BranchGRPO, 10 of its 20 prompts per
iteration, would time first-time prompt encodings). Scoring runs inline
(``train.rewards_async=false``) so decode and rewards are attributed, not overlapped.

Attribution: the functions below are wrapped at runtime with timers (the wrappers call the real
function; nothing is replaced); each category gets the time spent inside its functions minus the
time of timed functions nested inside them (exclusive time), so the categories add up to the
iteration. On CUDA every timer boundary synchronises the device.

| category | what is timed |
|---|---|
| forward | the denoiser's ``forward`` (``SD3Transformer2DModel``), grad or no grad |
| backward | ``Tensor.backward`` (the autograd pass: the denoiser's backward and the loss's) |
| adapter | ``policy.model.velocity`` outside the forward: wrappers, guidance, casts, timestep |
| sampler | SDE steps (``GaussianSDE``, the fused Flow-SDE kernel on CUDA), rollout / solver / tree loops |
| objective | ``objective.prepare`` and ``loss`` outside model and sampler, ``after_update``, ``after_iteration`` |
| decode | ``policy.model.decode`` outside the VAE: scaling, casts, clamping, the adapter stack |
| vae | the VAE's own ``decode`` (``pipe.vae.decode``: the decoder network) |
| rewards | ``MultiReward`` (``__call__``, ``score_parts``, ``combine``) outside the reward networks: image
  pre-processing, targets, checks, the deadline thread, the weighted sum |
| reward_nets | ``forward`` of every ``nn.Module`` a reward component holds (the digit classifier, CLIP, ...) |
| advantages | group / tree-edge advantages and ``objective.plan`` (micro-batch bookkeeping) |
| data | ``Tensor.to/.cpu/.cuda/.float/.double`` outside the model (data movement and casts) |
| optimizer | gradient clipping, ``optimizer.step`` with its guard snapshot and weight check |
| logging | ``MetricsLogger.log`` + ``save_checkpoint`` / ``train.save_every`` |
| rest | everything else in ``train_step`` (prompt sampling and cache, metrics, Python glue) |

Framework overhead = wall time outside the denoiser's forward and backward, as a share of the
rollout (``Trainer.collect``) and of the training step (``Trainer.update``). Model-side work that
is not the denoiser (the VAE, the reward networks) is overhead by that definition; the second table
gives it three ways: outside the denoiser, outside every network (denoiser, VAE, reward networks:
what is left is loops, casts, copies, pre-processing, checks and glue), and without decode and
rewards at all.
FLOPs of each phase are counted with ``FlopCounterMode`` (one extra, untimed iteration) and
divided by the achieved matmul rate on the denoiser's shapes (``bench/flop_floor.py``): the floor.

Sol-RL (``configs/solrl/digits.yaml``): the explore stage runs a separate merged, quantised copy of
the denoiser; its ``forward`` is wrapped too and counts as "forward" (model work at the explore
precision). Refreshing that copy from the trained weights every iteration lands in "rest".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from bench.flop_floor import count_flops, linear_shapes, matmul_rate

OBJECTIVES = {
    "flow_grpo": "configs/grpo/digits.yaml",
    "branch_grpo": "configs/branch/digits.yaml",
    "sage_grpo": "configs/sage/digits.yaml",
    "diffusion_nft": "configs/nft/digits.yaml",
    "awm": "configs/awm/digits.yaml",
    "sol_rl": "configs/solrl/digits.yaml",
}
CATEGORIES = (
    "forward",
    "backward",
    "adapter",
    "sampler",
    "objective",
    "decode",
    "vae",
    "rewards",
    "reward_nets",
    "advantages",
    "data",
    "optimizer",
    "logging",
    "rest",
)
PHASES = ("collect", "update", "other")
MODEL_CATEGORIES = ("forward", "backward")  # the denoiser's
NETWORK_CATEGORIES = (*MODEL_CATEGORIES, "vae", "reward_nets")  # every network's
SECTION = "## Where the time goes"
DATA_METHODS = ("to", "cpu", "cuda", "float", "double")


class Timers:
    """Exclusive-time timers per (phase, category); timed calls may nest.

    Args:
        sync: called at every timer boundary (``torch.cuda.synchronize`` on a GPU, else a no-op).
    """

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.stack: list[list[float]] = []  # [start, time of timed children]
        self.cats: list[str] = []
        self.phase = "other"
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.events = 0

    def inside(self, *categories: str) -> bool:
        """True while a call of one of ``categories`` is running."""
        return any(c in categories for c in self.cats)

    @contextlib.contextmanager
    def timed(self, category: str) -> Iterator[None]:
        """Attribute the block's exclusive time to ``category`` in the current phase."""
        self.sync()
        self.events += 1
        self.stack.append([time.perf_counter(), 0.0])
        self.cats.append(category)
        try:
            yield
        finally:
            self.sync()
            start, children = self.stack.pop()
            self.cats.pop()
            elapsed = time.perf_counter() - start
            self.seconds[(self.phase, category)] += elapsed - children
            if self.stack:
                self.stack[-1][1] += elapsed

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Run the block as ``phase``; its untimed time is that phase's "rest"."""
        outer, self.phase = self.phase, phase
        t0 = time.perf_counter()
        try:
            with self.timed("rest"):
                yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - t0
            self.phase = outer

    def wrap(self, category: str, fn: Callable) -> Callable:
        """``fn`` with its calls timed as ``category``."""

        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            with self.timed(category):
                return fn(*args, **kwargs)

        return timed_call

    def reset(self) -> None:
        self.seconds.clear()
        self.phase_seconds.clear()
        self.events = 0


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.name = value`` for the block (restored after)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def patched_item(mapping: dict[str, Any], key: str, value: Any) -> Iterator[None]:
    """Set ``mapping[key] = value`` for the block (restored after)."""
    old = mapping[key]
    mapping[key] = value
    try:
        yield
    finally:
        mapping[key] = old


def instrument(stack: contextlib.ExitStack, timers: Timers, trainer: Any) -> None:
    """Wrap the real code paths of ``trainer`` with ``timers`` (undone when ``stack`` closes)."""
    import flowrl.rollouts.chunked as chunked
    import flowrl.rollouts.collect as collect
    from flowrl.rewards.combine import MultiReward
    from flowrl.samplers.sde_finish import GaussianSDE
    from flowrl.samplers.sde_steps import SDE_STEPS

    ode_solve = importlib.import_module("flowrl.samplers.ode_solve")  # the package re-exports the function's name
    window_solve = importlib.import_module("flowrl.samplers.window_solve")
    model, objective = trainer.model, trainer.objective
    transformer = model.transformer

    def wrap(obj: Any, name: str, category: str) -> None:
        stack.enter_context(patched(obj, name, timers.wrap(category, getattr(obj, name))))

    wrap(transformer, "forward", "forward")
    if trainer.solrl is not None:  # Sol-RL's explore copy: a second denoiser module
        wrap(trainer.solrl.explore.module, "forward", "forward")
    wrap(torch.Tensor, "backward", "backward")
    wrap(model, "velocity", "adapter")
    wrap(model, "decode", "decode")
    if model.pipe.vae is not None:
        wrap(model.pipe.vae, "decode", "vae")
    for network in reward_networks(trainer.reward):
        wrap(network, "forward", "reward_nets")
    wrap(GaussianSDE, "__call__", "sampler")
    for name, step in SDE_STEPS.items():  # "flow" dispatches to the fused kernel on CUDA (not a GaussianSDE)
        if not isinstance(step, GaussianSDE):
            stack.enter_context(patched_item(SDE_STEPS, name, timers.wrap("sampler", step)))
    wrap(chunked, "rollout", "sampler")
    wrap(ode_solve, "ode_solve", "sampler")
    wrap(window_solve, "sde_window_solve", "sampler")
    wrap(collect, "chunked_tree_rollout", "sampler")
    for name in ("__call__", "score_parts", "combine"):
        wrap(MultiReward, name, "rewards")
    wrap(trainer, "advantages", "advantages")
    wrap(collect, "edge_advantages", "advantages")
    for name in ("plan",):
        wrap(objective, name, "advantages")
    for name in ("prepare", "loss", "after_update", "after_iteration"):
        wrap(objective, name, "objective")
    wrap(trainer, "_step", "optimizer")
    wrap(torch.nn.utils, "clip_grad_norm_", "optimizer")
    for name in DATA_METHODS:
        method = getattr(torch.Tensor, name)

        def moved(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
            if timers.inside(*NETWORK_CATEGORIES, "decode", "rewards", "data"):
                return _method(*args, **kwargs)
            with timers.timed("data"):
                return _method(*args, **kwargs)

        stack.enter_context(patched(torch.Tensor, name, moved))


def reward_networks(reward: Any) -> list[torch.nn.Module]:
    """The ``nn.Module`` s each reward component of a ``MultiReward`` holds (itself, or as an attribute)."""
    found: dict[int, torch.nn.Module] = {}
    for fn, _ in reward.rewards.values():
        for value in (fn, *getattr(fn, "__dict__", {}).values()):
            if isinstance(value, torch.nn.Module):
                found[id(value)] = value
    return list(found.values())


def config_at(config: str, rev: str | None, folder: Path) -> str:
    """``config`` from the working tree (``rev`` None) or as committed at git revision ``rev``."""
    if rev is None:
        return config
    text = subprocess.run(["git", "show", f"{rev}:{config}"], capture_output=True, text=True, check=True).stdout
    path = folder / config.replace("/", "_")
    path.write_text(text)
    return str(path)


def run_for(config: str, overrides: list[str], out: Path) -> Any:
    """A ``flowrl.recipe.Run`` for ``config`` with ``overrides``, writing under ``out``."""
    from flowrl.config import load_config
    from flowrl.recipe import Run

    cfg = load_config(config, [*overrides, f"output.dir={out}", "train.progress=false", "train.rewards_async=false"])
    return Run(cfg, overwrite=True)


def iteration(run: Any, timers: Timers, logger: Any) -> dict[str, float]:
    """One timed training iteration as the run loop does it (without the periodic evaluation)."""
    trainer = run.trainer
    timers.reset()
    t0 = time.perf_counter()
    with patched(trainer, "collect", _phase_wrap(timers, "collect", trainer.collect)):
        with patched(trainer, "update", _phase_wrap(timers, "update", trainer.update)):
            with timers.in_phase("other"):
                metrics = trainer.train_step()
    with timers.in_phase("other"):
        with timers.timed("logging"):
            logger.log(trainer.iteration, metrics)
        t1 = time.perf_counter()
        with timers.timed("logging"):
            run._save_checkpoint()
        ckpt = time.perf_counter() - t1
    save_every = run.cfg.train.save_every
    timers.seconds[("other", "logging")] -= ckpt * (1 - 1 / save_every)  # amortised over train.save_every
    wall = time.perf_counter() - t0 - ckpt * (1 - 1 / save_every)
    row = {f"{p}/{c}": timers.seconds.get((p, c), 0.0) for p in PHASES for c in CATEGORIES}
    row.update({f"{p}/wall": timers.phase_seconds.get(p, 0.0) for p in ("collect", "update")})
    row["wall"] = wall
    row["events"] = float(timers.events)
    return row


def _phase_wrap(timers: Timers, phase: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def in_phase(*args: Any, **kwargs: Any) -> Any:
        with timers.in_phase(phase):
            return fn(*args, **kwargs)

    return in_phase


def flops_of(run: Any) -> dict[str, float]:
    """FLOPs of one rollout and one training step (an extra iteration under ``FlopCounterMode``)."""
    trainer = run.trainer
    (batch, _), rollout_all, rollout_model = count_flops(trainer.collect)
    _, update_all, update_model = count_flops(lambda: trainer.update(batch))
    return {
        "collect/flops": rollout_all,
        "collect/model_flops": rollout_model,
        "update/flops": update_all,
        "update/model_flops": update_model,
    }


def profile_objective(name: str, config: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Median per-category seconds of ``args.iterations`` iterations after ``args.warmup``."""
    from flowrl.outputs import MetricsLogger

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="flowrl-profile-") as tmp:
        run = run_for(config_at(config, args.config_rev, Path(tmp)), overrides, Path(tmp) / "run")
        run.out.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(run.out, resume_step=None)
        run.trainer.warm_prompts()  # as the run's start evaluation does; a timed iteration encodes nothing new
        timers = Timers(sync)
        rows = []
        with contextlib.ExitStack() as stack:
            instrument(stack, timers, run.trainer)
            for i in range(args.warmup + args.iterations):
                row = iteration(run, timers, logger)
                if i >= args.warmup:
                    rows.append(row)
        flops = flops_of(run)
        trainer = run.trainer
        shapes = linear_shapes(trainer.model.transformer, trainer.latent_shape, run.cfg.sampler.chunk_size)
        logger.close()
        trainer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med.update(flops)
    med["shapes"] = shapes
    med["latent_shape"] = list(trainer.latent_shape)
    med["samples"] = run.cfg.prompts.per_iteration * run.cfg.prompts.group_size
    return med


def tiny_sd3_64(folder: Path, seed: int = 0) -> Path:
    """A random-init SD3 pipeline at 64² (1024 image tokens) saved as a diffusers folder: the real classes.

    Transformer: 2 joint blocks, 2 heads x 16, patch 2 on a 4 x 64 x 64 latent (a one-block VAE,
    scale 1); two tiny CLIP text encoders on the digits tokenizer (the embedded prompts apply).
    Built by the test suite's ``tiny_sd3_pipeline`` (tests/conftest.py), so bench and tests share one builder.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline(seed, size=64, num_layers=2, attention_head_dim=16, caption_projection_dim=32)
    pipe.save_pretrained(str(folder))
    (folder / "flowrl.json").write_text(json.dumps({"adapter": "sd3", "resolution": 64, "max_sequence_length": 6}))
    return folder


TINY64 = [  # 4 prompts x group 4, 10 steps, chunks of 16, LoRA r8 (the peer comparison's geometry)
    "prompts.per_iteration=4",
    "prompts.group_size=4",
    "sampler.chunk_size=16",
]
TINY64_PER_OBJECTIVE = {"branch_grpo": ["prompts.per_iteration=1", "prompts.group_size=16"]}
# the shipped Sol-RL config explores with torch.ao's int8 copy, a CPU-only path; a GPU explores in FP8 E4M3
# on ``torch._scaled_mm`` (configs/solrl/flux1dev_pickscore.yaml on an H100; the config check suggests it too)
CUDA_PER_OBJECTIVE = {"sol_rl": ["solrl.precision=fp8_e4m3"]}


def overheads(m: dict[str, Any]) -> dict[str, float]:
    """Framework overhead shares of each phase, three ways.

    ``collect`` / ``update``: outside the denoiser's forward + backward; ``*_networks``: outside every
    network's (denoiser, VAE, reward networks); ``*_framework``: outside decode and rewards as well.
    """
    out = {}
    for phase in ("collect", "update"):
        wall = m[f"{phase}/wall"]
        model = sum(m[f"{phase}/{c}"] for c in MODEL_CATEGORIES)
        networks = sum(m.get(f"{phase}/{c}", 0.0) for c in NETWORK_CATEGORIES)
        side = sum(m.get(f"{phase}/{c}", 0.0) for c in ("decode", "vae", "rewards", "reward_nets"))
        out[phase] = (wall - model) / wall if wall else 0.0
        out[f"{phase}_networks"] = (wall - networks) / wall if wall else 0.0
        out[f"{phase}_framework"] = (wall - model - side) / wall if wall else 0.0
    return out


def table(results: dict[str, dict[str, dict[str, Any]]], rates: dict[str, dict[int, float]]) -> str:
    """The markdown tables: seconds per category, overhead shares, and time over the FLOP floor."""
    lines = ["| model | objective | iteration s | " + " | ".join(CATEGORIES) + " |"]
    lines.append("|---|---|---|" + "---|" * len(CATEGORIES))
    for model, objs in results.items():
        for name, m in objs.items():
            if "missing" in m:
                lines.append(f"| {model} | {name} | {m['missing']} |" + " |" * len(CATEGORIES))
                continue
            cells = []
            for c in CATEGORIES:
                s = sum(m.get(f"{p}/{c}", 0.0) for p in PHASES)
                cells.append(f"{s:.3f} ({100 * s / m['wall']:.0f} %)")
            lines.append(f"| {model} | {name} | {m['wall']:.3f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| model | objective | rollout s | overhead of rollout: outside the denoiser / outside every network "
        "(without decode+rewards) | train step s | overhead of train step: outside the denoiser / outside every "
        "network (without decode+rewards) | rollout / FLOP floor | train step / FLOP floor "
        "| GFLOP rollout (denoiser) | GFLOP train (denoiser) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, objs in results.items():
        rate = max(rates.get(model, {0: float("nan")}).values())
        for name, m in objs.items():
            if "missing" in m:
                continue
            o = overheads(m)
            floor_c, floor_u = m["collect/flops"] / rate, m["update/flops"] / rate
            lines.append(
                f"| {model} | {name} | {m['collect/wall']:.3f} | {100 * o['collect']:.1f} % / "
                f"{100 * o['collect_networks']:.1f} % ({100 * o['collect_framework']:.1f} %) | "
                f"{m['update/wall']:.3f} | {100 * o['update']:.1f} % / {100 * o['update_networks']:.1f} % "
                f"({100 * o['update_framework']:.1f} %) | {_times(m['collect/wall'], floor_c)} | "
                f"{_times(m['update/wall'], floor_u)} | {m['collect/flops'] / 1e9:.2f} "
                f"({m['collect/model_flops'] / 1e9:.2f}) "
                f"| {m['update/flops'] / 1e9:.2f} ({m['update/model_flops'] / 1e9:.2f}) |"
            )
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    """Replace (or append) the "Where the time goes" section of ``path``; other sections untouched."""
    doc = path.read_text()
    start = doc.find(SECTION)
    if start < 0:
        path.write_text(doc.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
        return
    end = doc.find("\n## ", start + len(SECTION))
    path.write_text(doc[:start] + text.rstrip("\n") + "\n" + (doc[end:] if end >= 0 else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["digits", "tiny64"], choices=["digits", "tiny64"])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--override", nargs="*", default=[], help="extra key=value config overrides")
    parser.add_argument("--write", type=Path, default=None, help="write the section into this markdown file")
    parser.add_argument("--config-rev", default=None, help="read the configs as committed at this git revision")
    parser.add_argument("--json", type=Path, default=None, help="write the raw medians here")
    parser.add_argument("--from-json", type=Path, default=None, help="only render (and --write) a saved --json run")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        rates = {m: {int(n): r for n, r in per.items()} for m, per in saved["rates"].items()}
        render(saved["header"], saved["results"], rates, args.write)
        return
    load = _load()
    base = [f"model.device={args.device}", "train.threads=1", *args.override]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    rates: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-tiny64-") as tmp:
        for model in args.models:
            extra = [f"model.path={tiny_sd3_64(Path(tmp) / 'model')}", *TINY64] if model == "tiny64" else []
            results[model] = {}
            for name in args.objectives:
                results[model][name] = _profile_or_reason(name, model, [*base, *extra], args)
                if args.json is not None:  # saved as it goes: a long run that is stopped keeps its rows
                    args.json.write_text(json.dumps({"header": "", "rates": rates, "results": results}, indent=1))
            shapes = next((m["shapes"] for m in results[model].values() if "shapes" in m), None)
            if shapes is not None and args.device == "cpu":
                rates[model] = {n: matmul_rate(shapes, n) for n in (1, 2)}
    header = _header(args, load, _load(), rates)
    if args.json is not None:
        args.json.write_text(json.dumps({"header": header, "rates": rates, "results": results}, indent=1))
    render(header, results, rates, args.write)


def _load() -> list[str]:
    return open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]


def _profile_or_reason(name: str, model: str, overrides: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The objective's medians, or ``{"missing": reason}`` (config not there yet, or the run failed)."""
    config = OBJECTIVES[name]
    if args.config_rev is None and not Path(config).is_file():
        return {"missing": f"not wired ({config} missing)"}
    per = TINY64_PER_OBJECTIVE.get(name, []) if model == "tiny64" else []
    per += CUDA_PER_OBJECTIVE.get(name, []) if args.device == "cuda" else []
    try:
        out = profile_objective(name, config, [*overrides, *per], args)
    except Exception as err:  # the other objectives' numbers are still worth having
        out = {"missing": f"failed: {type(err).__name__}: {str(err)[:120]}"}
    print(f"{model} {name}: {_summary(out)}", flush=True)
    return out


def _summary(out: dict[str, Any]) -> str:
    return out["missing"] if "missing" in out else f"{out['wall']:.3f} s/iteration"


def _times(wall: float, floor: float) -> str:
    """``wall`` over the FLOP floor, or "-" where no floor was measured (a CUDA run: the CPU matmul rate is not its)."""
    return f"{wall / floor:.1f}×" if math.isfinite(floor) else "-"


def _header(args: argparse.Namespace, load: list[str], load_end: list[str], rates: dict[str, dict[int, float]]) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rate_text = "; ".join(
        f"{model}: " + ", ".join(f"{n} thread(s) {r / 1e9:.1f} GFLOP/s" for n, r in per.items())
        for model, per in rates.items()
    )
    return (
        f"Command: `HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python -m bench.profile "
        f"--models {' '.join(args.models)} --objectives {' '.join(args.objectives)} "
        f"--iterations {args.iterations} --warmup {args.warmup} --device {args.device}"
        + (f" --config-rev {args.config_rev}" if args.config_rev else "")
        + "`. "
        f"Machine: {device}, {os.cpu_count()} cores, torch {torch.__version__}, 1 torch thread; load average "
        f"{' '.join(load)} at the start, {' '.join(load_end)} at the end. Date: {date}. "
        f"Medians of {args.iterations} iterations after {args.warmup} warm-up; the categories are medians too, "
        "so they need not add up to the iteration exactly. "
        + (
            "Every timer boundary synchronises the GPU; no FLOP floor (the floor is the CPU's matmul rate)."
            if args.device == "cuda"
            else "Achieved fp32 matmul rate on each model's denoiser "
            f"linear shapes ({rate_text or 'not measured'}); the floor uses the best rate of the model."
        )
    )


def render(header: str, results: dict[str, Any], rates: dict[str, dict[int, float]], write: Path | None) -> None:
    """Print the tables and, with ``write``, put them into that markdown file's section."""
    text = table(results, rates)
    print(header)
    print(text)
    if write is not None:
        write_section(write, f"{SECTION}\n\n{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
