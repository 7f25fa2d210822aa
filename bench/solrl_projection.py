"""Sol-RL on paper: the two-stage iteration on an H100 (FP8 explore) and a B200 (NVFP4 explore).

A projection, not a measurement. Per prompt of one iteration of the shipped Sol-RL configs
(``configs/solrl/{sd3.5m,flux1dev}_pickscore.yaml`` stacked on their ``gpu80`` preset: N = 96
candidates explored in 6 DPM-Solver++(2M) steps, K = 24 kept and regenerated with the 10 rollout
steps, DiffusionNFT trained on them), the script counts

- stage 1: ``N x explore_steps`` forwards of the explore copy plus N VAE decodes;
- stage 2: ``K x steps`` bf16 forwards plus K decodes;
- training: ``K x trained timesteps x (forward-equivalents x F + B)``, from
  :func:`bench.gpu_plan.train_passes` (DiffusionNFT: the trained forward, the "old" adapter's
  forward, the KL reference forward, a recomputed forward under checkpointing, and the backward);

with the per-sample forward / backward / decode TFLOP of :mod:`bench.gpu_plan` (FlopCounterMode
on meta models built from the published configs). The share of a forward that the explore copy
can run at low precision is counted per module: the Linear layers that
:class:`flowrl.policy.precision.QuantRule` selects (``solrl.min_features``, embedders and final
layers kept) and whose dims are multiples of 16; attention (SDPA) and everything else stays bf16.

Seconds = TFLOP / (dense peak x MFU). The bf16 MFU of rollout and training passes is the one
measured on an H100 (docs/gpu-plan.md, "Measured on an H100"); the low-precision GEMMs are given the
same MFU and half of it. Text encoding, rewards and host work are not counted (docs/gpu-plan.md
does not count them either); decodes run at the rollout MFU (not measured).

Run: ``python -m bench.solrl_projection`` (about a minute on a CPU; no downloads, no GPU).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench.gpu_plan import (
    decode_tflop,
    flux_dev_pass,
    flux_inputs,
    flux_transformer,
    image_vae,
    params,
    sd3_inputs,
    sd3_medium_pass,
    sd3_transformer,
    train_passes,
)
from flowrl.kernels.roofline import B200 as B200_PEAKS
from flowrl.kernels.roofline import H100_SXM, GpuPeaks
from flowrl.policy.precision import QuantRule

GB = 1e9
H100_BF16_PEAK = H100_SXM.bf16_flops / 1e12


@dataclass(frozen=True)
class Device:
    """Dense tensor-core peaks, TFLOP/s per format (vendor datasheet figures; sparse figures are 2x)."""

    name: str
    peaks: dict[str, float]


def device(peaks: GpuPeaks) -> Device:
    """A :class:`Device` from the datasheet table of :mod:`flowrl.kernels.roofline`, in TFLOP/s."""
    formats = {"bf16": peaks.bf16_flops, "fp8": peaks.fp8_flops, "fp4": peaks.fp4_flops}
    return Device(peaks.name, {fmt: flops / 1e12 for fmt, flops in formats.items() if flops is not None})


H100 = device(H100_SXM)
B200 = device(B200_PEAKS)
# (device, explore format): bf16 = fewer steps only; fp8 = torch._scaled_mm W8A8; fp4 = NVFP4 W4A4 (native_nvfp4).
# B200 FP8 is left out: FP8 is 2x bf16 on both GPUs, so its ratios are the H100 FP8 row's.
SCENARIOS = ((H100, "bf16"), (H100, "fp8"), (B200, "bf16"), (B200, "fp4"))
LOW_PRECISION_MFU = (1.0, 0.5)  # low-precision GEMM MFU as a fraction of the measured bf16 rollout MFU

# Achieved TFLOP/s on one H100 80GB HBM3 (docs/gpu-plan.md "Measured on an H100":
# `python -m bench.gpu_measure --batch 1 4 16 --repeats 3`, 2026-11-22), at the largest batch measured,
# the training pass as the gpu80 preset runs it (SD3.5-M without, FLUX.1-dev with gradient checkpointing).
MEASURED_TFLOPS = {
    "sd3.5m": {"rollout": 183.0, "train": 168.0},
    "flux1dev": {"rollout": 269.0, "train": 229.0},
}
MEASURED_BATCH = {"sd3.5m": 16, "flux1dev": 4}

# Sol-RL (reference: /work/shared/reference/nft-awm-solrl-sage.md §3.4): best convergence speed-up over
# DiffusionNFT 24-in-24, and one reading of its Fig. 3a (seconds per iteration on 8x B200).
TARGET_SPEEDUP = 4.64
PAPER_SECONDS = {"bf16_rollout_96": 451.0, "solrl_rollout": 184.0, "train": 240.0}
STEP_GRID = (2, 4, 6, 8)
ISSUE_FP8_TARGET = 1.5  # issue 15: FP8 explore candidates/s >= 1.5x bf16 on an H100


@dataclass(frozen=True)
class Workload:
    """One prompt of one Sol-RL iteration.

    Attributes:
        candidates: N, seeds explored (``solrl.candidates``).
        kept: K, seeds regenerated and trained (``prompts.group_size``).
        explore_steps: stage-1 steps (DPM-Solver++(2M): one evaluation per step).
        steps: rollout steps (``sampler.num_steps``).
        pairs: trained timesteps per kept sample (DiffusionNFT: ``int(steps x train_fraction)``).
        train_forwards: forward-equivalents per trained pair besides the backward (trained + "old" + KL
            reference + recompute under checkpointing).
        guidance: 2 with true CFG (both branches in one call), else 1.
        min_features: ``solrl.min_features`` of the quantisation rule.
    """

    candidates: int
    kept: int
    explore_steps: int
    steps: int
    pairs: int
    train_forwards: float
    guidance: int
    min_features: int


@dataclass(frozen=True)
class PassFlops:
    """Per-sample TFLOP of one model at one resolution (bench.gpu_plan's counts).

    Attributes:
        forward: one denoiser forward.
        backward: its backward with the base frozen (LoRA training).
        quantised: share of ``forward`` in the Linear layers the explore copy quantises.
        decode: one VAE decode.
    """

    forward: float
    backward: float
    quantised: float
    decode: float


def workload(cfg) -> Workload:
    """The per-prompt workload of a loaded Sol-RL config (``flowrl.config.load_config``)."""
    pairs, extra = train_passes(cfg.objective, cfg.sampler.num_steps, cfg.memory.gradient_checkpointing)
    return Workload(
        candidates=cfg.solrl.candidates,
        kept=cfg.prompts.group_size,
        explore_steps=cfg.solrl.explore_steps,
        steps=cfg.sampler.num_steps,
        pairs=pairs,
        train_forwards=1.0 + extra,
        guidance=2 if cfg.sampler.guidance_scale != 1.0 else 1,
        min_features=cfg.solrl.min_features,
    )


def stage_tflop(w: Workload, f: PassFlops, explore_steps: int | None = None) -> dict[str, float]:
    """TFLOP per prompt of each part of a two-stage iteration (explore counted at any precision)."""
    e = w.explore_steps if explore_steps is None else explore_steps
    return {
        "explore": w.candidates * e * w.guidance * f.forward,
        "explore_decode": w.candidates * f.decode,
        "regenerate": w.kept * w.steps * w.guidance * f.forward,
        "regenerate_decode": w.kept * f.decode,
        "train": train_tflop(w, f),
    }


def train_tflop(w: Workload, f: PassFlops) -> float:
    """DiffusionNFT training on the K kept samples: pairs x (forward-equivalents x F + B) each."""
    return w.kept * w.pairs * w.guidance * (w.train_forwards * f.forward + f.backward)


def single_stage_tflop(w: Workload, f: PassFlops, sampled: int) -> dict[str, float]:
    """Single-stage DiffusionNFT: ``sampled`` seeds rolled out at bf16 with the full steps, K trained."""
    return {
        "rollout": sampled * w.steps * w.guidance * f.forward,
        "decode": sampled * f.decode,
        "train": train_tflop(w, f),
    }


@dataclass(frozen=True)
class Throughput:
    """Achieved TFLOP/s: bf16 rollout (and decode), bf16 training, the explore copy's quantised GEMMs."""

    rollout: float
    train: float
    explore: float


def throughput(device: Device, model: str, fmt: str, low_mfu: float) -> Throughput:
    """The H100-measured bf16 MFU applied to ``device``; quantised GEMMs at ``low_mfu`` x that MFU."""
    mfu_rollout = MEASURED_TFLOPS[model]["rollout"] / H100_BF16_PEAK
    mfu_train = MEASURED_TFLOPS[model]["train"] / H100_BF16_PEAK
    explore = device.peaks[fmt] * mfu_rollout * (1.0 if fmt == "bf16" else low_mfu)
    return Throughput(device.peaks["bf16"] * mfu_rollout, device.peaks["bf16"] * mfu_train, explore)


def solrl_seconds(w: Workload, f: PassFlops, tp: Throughput, explore_steps: int | None = None) -> dict[str, float]:
    """Seconds per prompt of each part: the quantised share of the explore forwards at ``tp.explore``."""
    t = stage_tflop(w, f, explore_steps)
    return {
        "explore": t["explore"] * ((1.0 - f.quantised) / tp.rollout + f.quantised / tp.explore),
        "explore_decode": t["explore_decode"] / tp.rollout,
        "regenerate": (t["regenerate"] + t["regenerate_decode"]) / tp.rollout,
        "train": t["train"] / tp.train,
    }


def single_stage_seconds(w: Workload, f: PassFlops, tp: Throughput, sampled: int) -> float:
    """Seconds per prompt of single-stage DiffusionNFT sampling ``sampled`` seeds at bf16."""
    t = single_stage_tflop(w, f, sampled)
    return (t["rollout"] + t["decode"]) / tp.rollout + t["train"] / tp.train


def paper_learning_gain() -> tuple[float, float]:
    """(t_24in24 / t_solrl per iteration, learning gain G) implied by the paper's 4.64x and Fig. 3a.

    24-in-24 rolls out a quarter of 24-in-96's seeds (rollout seconds scaled by 24/96) and trains the
    same; convergence speed-up = G x t_24in24 / t_solrl, so G = 4.64 x t_solrl / t_24in24.
    """
    p = PAPER_SECONDS
    single = p["bf16_rollout_96"] * 24 / 96 + p["train"]
    solrl = p["solrl_rollout"] + p["train"]
    return single / solrl, TARGET_SPEEDUP * solrl / single


@dataclass(frozen=True)
class Projection:
    """One model, device, explore format and MFU case: seconds per prompt and the ratios."""

    solrl: dict[str, float]
    same_k: float  # (a) single stage, K sampled and trained
    all_n: float  # (b) single stage, N sampled at bf16, K trained

    @property
    def total(self) -> float:
        return sum(self.solrl.values())

    @property
    def stage1_share(self) -> float:
        return (self.solrl["explore"] + self.solrl["explore_decode"]) / self.total

    @property
    def rollout_speedup(self) -> float:
        """Sol-RL's sampling (both stages) against sampling all N at bf16 (the paper's 2.45x)."""
        return (self.all_n - self.solrl["train"]) / (self.total - self.solrl["train"])


def project(w: Workload, f: PassFlops, tp: Throughput, explore_steps: int | None = None) -> Projection:
    return Projection(
        solrl_seconds(w, f, tp, explore_steps),
        single_stage_seconds(w, f, tp, w.kept),
        single_stage_seconds(w, f, tp, w.candidates),
    )


def explore_forward_speedup(quantised: float, peak_ratio: float, low_mfu: float) -> float:
    """Explore forward speed-up over bf16: the quantised share at ``peak_ratio x low_mfu`` the bf16 rate (Amdahl)."""
    return 1.0 / ((1.0 - quantised) + quantised / (peak_ratio * low_mfu))


def low_mfu_needed(quantised: float, peak_ratio: float, target: float) -> float:
    """Low-precision MFU (fraction of bf16's) for an explore forward ``target`` x faster than bf16 (inf: none)."""
    rest = 1.0 / target - (1.0 - quantised)
    return quantised / (peak_ratio * rest) if rest > 0 else math.inf


def explore_budget(p: Projection, gain: float) -> float:
    """Stage-1 forward seconds left for Sol-RL to be TARGET_SPEEDUP x faster than (a) at learning gain ``gain``."""
    return gain * p.same_k / TARGET_SPEEDUP - (p.total - p.solrl["explore"])


# --------------------------------------------------------------------------- counting on meta models


def quantised_layers(model: nn.Module, rule: QuantRule) -> dict[str, nn.Linear]:
    """Linear layers the explore copy holds at low precision: the rule's choice, dims multiples of 16."""
    return {n: m for n, m in model.named_modules() if rule.selects(n, m) and not any(d % 16 for d in m.weight.shape)}


def quantised_share(model: nn.Module, inputs: dict, rule: QuantRule) -> float:
    """Share of one no-grad forward's FLOPs spent in :func:`quantised_layers` (FlopCounterMode per module)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    per_module = counter.get_flop_counts()
    root = type(model).__name__
    chosen = sum(sum(per_module.get(f"{root}.{n}", {}).values()) for n in quantised_layers(model, rule))
    return chosen / counter.get_total_flops()


def explore_copy_bytes(model: nn.Module, rule: QuantRule, fmt: str) -> float:
    """Bytes of the LoRA-merged explore copy: quantised Linear weights at ``fmt``, everything else bf16.

    fp8: 1 byte per weight + one fp32 tensor scale per layer; fp4 (NVFP4): half a byte per weight +
    one E4M3 scale (1 byte) per 16 values along in_features + one fp32 tensor scale per layer;
    bf16: 2 bytes. Other parameters (biases, norms, embedders, small layers) and buffers stay bf16.
    """
    layers = quantised_layers(model, rule).values()
    weights = sum(m.weight.numel() for m in layers)
    if fmt == "fp8":
        low = weights + 4 * len(layers)
    elif fmt == "fp4":
        low = weights / 2 + sum(m.out_features * math.ceil(m.in_features / 16) for m in layers) + 4 * len(layers)
    elif fmt == "bf16":
        low = 2 * weights
    else:
        raise ValueError(f"unknown explore format {fmt!r}; use bf16, fp8 or fp4")
    others = 2 * (params(model) - weights) + 2 * sum(b.numel() for b in model.buffers())
    return low + others


def count(name: str, side: int) -> tuple[PassFlops, nn.Module]:
    """PassFlops of ``name`` ("sd3.5m" / "flux1dev") with a side x side latent (side x 8 px), and the meta model."""
    build, inputs, measure = {
        "sd3.5m": (sd3_transformer, sd3_inputs, sd3_medium_pass),
        "flux1dev": (flux_transformer, flux_inputs, flux_dev_pass),
    }[name]
    with torch.device("meta"):
        model = build().to(torch.bfloat16)
        vae = image_vae().to(torch.bfloat16)
        latents = torch.empty(1, 16, side, side, dtype=torch.bfloat16)
    rule = QuantRule(min_features=load(name, side).solrl.min_features)
    share = quantised_share(model, {k: v.detach() for k, v in inputs(side).items()}, rule)
    p = measure(model, side)
    return PassFlops(p.forward_tflop, p.backward_tflop, share, decode_tflop(vae, latents)), model


def load(name: str, side: int):
    """The shipped Sol-RL config on its gpu80 preset, at ``side x 8`` px."""
    from flowrl.config import load_config

    return load_config(
        [f"configs/solrl/{name}_pickscore.yaml", f"configs/presets/{name}/gpu80.yaml"],
        [f"model.resolution={side * 8}"],
    )


# --------------------------------------------------------------------------- tables

LABELS = {"sd3.5m": "SD3.5-M", "flux1dev": "FLUX.1-dev"}


def table(header: list[str], rows: list[list[str]], numbers: bool = True) -> None:
    """A markdown table; with ``numbers`` every column but the first is right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if numbers and i else "---" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def assumptions_table() -> None:
    ratio, gain = paper_learning_gain()
    rows = [
        ["H100 SXM dense peaks", "bf16 989, FP8 1979 TFLOP/s", "NVIDIA H100 datasheet (dense; sparse is 2x)"],
        [
            "B200 dense peaks",
            "bf16 2250, FP8 4500, FP4 9000 TFLOP/s",
            "NVIDIA B200 datasheet figures (dense; not checked on hardware)",
        ],
    ]
    for model, m in MEASURED_TFLOPS.items():
        rows.append(
            [
                f"{LABELS[model]} bf16 MFU (rollout / train)",
                f"{m['rollout'] / H100_BF16_PEAK:.1%} / {m['train'] / H100_BF16_PEAK:.1%} "
                f"({m['rollout']:.0f} / {m['train']:.0f} TFLOP/s at batch {MEASURED_BATCH[model]})",
                "measured on an H100 at 512², docs/gpu-plan.md (bench.gpu_measure); "
                "the same fraction assumed at 1024² and on a B200",
            ]
        )
    rows += [
        [
            "low-precision GEMM MFU",
            " or ".join(f"{x:g} x" for x in LOW_PRECISION_MFU) + " the bf16 rollout MFU",
            "assumption: FP8/FP4 kernels rarely reach the bf16 fraction on small batches",
        ],
        [
            "what runs at low precision",
            "Linear layers of QuantRule(min_features=1000), dims % 16 = 0; attention, norms, embedders bf16",
            "flowrl/policy/precision.py, configs/solrl (Sol-RL's replace_linear_with_te)",
        ],
        ["VAE decode", "bf16 at the rollout MFU", "assumption (decode not measured on the GPU)"],
        ["not counted", "text encoding, reward models, host work, quantising activations", "as docs/gpu-plan.md"],
        [
            "paper timings (Fig. 3a reading)",
            f"24-in-96 bf16 rollout {PAPER_SECONDS['bf16_rollout_96']:.0f} s, Sol-RL rollout "
            f"{PAPER_SECONDS['solrl_rollout']:.0f} s, train {PAPER_SECONDS['train']:.0f} s per iteration",
            "reference §3.4 (secondary summary of the paper, 8x B200)",
        ],
        [
            "paper learning gain G",
            f"t(24-in-24) / t(Sol-RL) = {ratio:.2f} per iteration, so G = {TARGET_SPEEDUP} / {ratio:.2f} = {gain:.2f}",
            "derived: 4.64x over that per-iteration ratio; 24-in-24's rollout taken as 24/96 of 24-in-96's",
        ],
    ]
    print("### Assumptions\n")
    table(["assumption", "value", "source"], rows, numbers=False)


def flop_table(cases: list[tuple[str, int, Workload, PassFlops, int]]) -> None:
    print("### TFLOP per prompt per iteration (N = 96 explored, K = 24 kept; x prompts.per_iteration per iteration)\n")
    rows = []
    for model, side, w, f, _ in cases:
        t = stage_tflop(w, f)
        a = sum(single_stage_tflop(w, f, w.kept).values())
        b = sum(single_stage_tflop(w, f, w.candidates).values())
        rows.append(
            [
                f"{LABELS[model]} {side * 8}²",
                f"{f.forward:.2f} / {f.backward:.2f} / {f.decode:.2f}",
                f"{f.quantised:.1%}",
                f"{w.candidates}x{w.explore_steps}: {t['explore']:,.0f}",
                f"{t['explore_decode']:,.0f}",
                f"{w.kept}x{w.steps}: {t['regenerate']:,.0f} + {t['regenerate_decode']:,.0f}",
                f"{w.kept}x{w.pairs}x({w.train_forwards:g}F+B): {t['train']:,.0f}",
                f"{sum(t.values()):,.0f}",
                f"{a:,.0f}",
                f"{b:,.0f}",
            ]
        )
    table(
        [
            "model",
            "F / B / decode per sample",
            "F quantisable",
            "stage 1 explore",
            "stage 1 decode",
            "stage 2 regenerate + decode",
            "train (DiffusionNFT)",
            "Sol-RL total",
            "(a) 24-in-24",
            "(b) 24-in-96 bf16",
        ],
        rows,
    )


def time_table(cases: list[tuple[str, int, Workload, PassFlops, int]]) -> None:
    ratio, gain = paper_learning_gain()
    print(
        "### Seconds per prompt per iteration and speed-ups (one GPU; "
        f"x{TARGET_SPEEDUP} needs G = {TARGET_SPEEDUP} x t(Sol-RL) / t(a))\n"
    )
    rows = []
    for model, side, w, f, prompts in cases:
        for device, fmt in SCENARIOS:
            for low in LOW_PRECISION_MFU if fmt != "bf16" else (1.0,):
                p = project(w, f, throughput(device, model, fmt, low))
                s = p.solrl
                rows.append(
                    [
                        f"{LABELS[model]} {side * 8}²",
                        f"{device.name} {fmt.upper()}" + (f" @ {low:g}x MFU" if fmt != "bf16" else ""),
                        f"{s['explore']:.2f} + {s['explore_decode']:.2f}",
                        f"{s['regenerate']:.2f}",
                        f"{s['train']:.2f}",
                        f"{p.total:.2f}",
                        f"{prompts * p.total:.1f}",
                        f"{p.same_k:.2f}",
                        f"{p.all_n:.2f}",
                        f"{p.stage1_share:.0%}",
                        f"{s['train'] / p.total:.0%}",
                        f"{p.rollout_speedup:.2f}x",
                        f"{p.all_n / p.total:.2f}x",
                        f"{p.same_k / p.total:.2f}x",
                        f"{TARGET_SPEEDUP * p.total / p.same_k:.1f}",
                        f"{gain * p.same_k / p.total:.2f}x",
                    ]
                )
    table(
        [
            "model",
            "GPU, explore",
            "stage 1 s (forwards + decode)",
            "stage 2 s",
            "train s",
            "Sol-RL s",
            "Sol-RL s per iteration (prompts.per_iteration)",
            "(a) s",
            "(b) s",
            "stage-1 share",
            "train share",
            "sampling vs (b)",
            "iteration vs (b)",
            "iteration vs (a)",
            f"G for {TARGET_SPEEDUP}x",
            f"vs (a) at G = {gain:.2f}",
        ],
        rows,
    )


def steps_table(cases: list[tuple[str, int, Workload, PassFlops, int]]) -> None:
    _, gain = paper_learning_gain()
    print(
        f"### What stage 1 needs for {TARGET_SPEEDUP}x over (a) at the paper's learning gain G = {gain:.2f} "
        "(projected speed-up vs (a) by explore steps; low-precision GEMMs at the bf16 MFU)\n"
    )
    rows = []
    for model, side, w, f, _ in cases:
        for device, fmt in SCENARIOS:
            tp = throughput(device, model, fmt, 1.0)
            p = project(w, f, tp)
            bf16_explore = solrl_seconds(w, f, throughput(device, model, "bf16", 1.0))["explore"]
            budget = explore_budget(p, gain)
            need = f"{bf16_explore / budget:.1f}x" if budget > 0 else "impossible (even free)"
            per_step = p.solrl["explore"] / w.explore_steps
            cells = [f"{gain * p.same_k / project(w, f, tp, e).total:.2f}x" for e in STEP_GRID]
            reached = f"{bf16_explore / p.solrl['explore']:.2f}x"
            steps = str(math.floor(budget / per_step)) if budget > 0 else "0"
            rows.append([f"{LABELS[model]} {side * 8}²", f"{device.name} {fmt.upper()}", *cells, reached, need, steps])
    table(
        [
            "model",
            "GPU, explore",
            *[f"{e} steps" for e in STEP_GRID],
            "explore speed-up over bf16 (6 steps)",
            "needed at 6 steps",
            "most steps for 4.64x",
        ],
        rows,
    )


def forward_table(cases: list[tuple[str, int, Workload, PassFlops, int]]) -> None:
    print(
        "### Explore forward speed-up over a bf16 forward (attention and unquantised layers stay bf16; "
        "the same on both GPUs: FP8 = 2x, FP4 = 4x the bf16 peak)\n"
    )
    rows = []
    for model, side, _, f, _ in cases:
        cells = [
            f"{explore_forward_speedup(f.quantised, r, low):.2f}x" for r in (2.0, 4.0) for low in LOW_PRECISION_MFU
        ]
        need = low_mfu_needed(f.quantised, 2.0, ISSUE_FP8_TARGET)
        rows.append(
            [
                f"{LABELS[model]} {side * 8}²",
                f"{f.quantised:.1%}",
                *cells,
                f"{1.0 / (1.0 - f.quantised):.1f}x",
                f"{need:.2f}" if math.isfinite(need) else "out of reach",
            ]
        )
    table(
        [
            "model",
            "quantisable share of F",
            *[f"{fmt} @ {low:g}x MFU" for fmt in ("FP8", "FP4") for low in LOW_PRECISION_MFU],
            "ceiling (free GEMMs)",
            f"FP8 MFU (x bf16's) for the issue's {ISSUE_FP8_TARGET:g}x",
        ],
        rows,
    )


def memory_table(models: dict[str, nn.Module]) -> None:
    print("### Explore copy in GPU memory (LoRA merged; a second denoiser beside the bf16 policy)\n")
    rows = []
    for name, model in models.items():
        rule = QuantRule(min_features=load(name, 64).solrl.min_features)
        chosen = sum(m.weight.numel() for m in quantised_layers(model, rule).values())
        total = params(model)
        rows.append(
            [
                LABELS[name],
                f"{total / 1e6:,.0f} M",
                f"{chosen / total:.1%}",
                *[f"{explore_copy_bytes(model, rule, fmt) / GB:.2f}" for fmt in ("bf16", "fp8", "fp4")],
            ]
        )
    table(
        ["model", "parameters", "quantised", "bf16 GB", "FP8 GB (per-tensor scales)", "NVFP4 GB (+ E4M3 block scales)"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="image sides in pixels")
    args = parser.parse_args(argv)
    cases, models = [], {}
    for name in ("sd3.5m", "flux1dev"):
        for px in args.sizes:
            flops, models[name] = count(name, px // 8)
            cfg = load(name, px // 8)
            cases.append((name, px // 8, workload(cfg), flops, cfg.prompts.per_iteration))
    print("## Sol-RL on paper (python -m bench.solrl_projection)\n")
    assumptions_table()
    flop_table(cases)
    forward_table(cases)
    time_table(cases)
    steps_table(cases)
    memory_table(models)


if __name__ == "__main__":
    main()
