"""FP8 explore vs bf16 on the full-size SD3.5-M and FLUX.1-dev denoisers: candidates per second and rank agreement.

Sol-RL's stage 1 (docs/solrl.md, issue 15) on a GPU: N seeds per prompt sampled with a few
deterministic Euler steps by an explore copy of the policy, decoded and scored; only the rewards
are kept. Each explore copy is built by flowrl's own :func:`flowrl.policy.precision.build_explore`
(deep copy, LoRA merged, Linear layers at the precision: FP8 E4M3 on ``torch._scaled_mm`` with
per-tensor or per-row scales on CUDA), put in the adapter's place by
:func:`flowrl.solrl.explore.explore_transformer` and sampled by
:func:`flowrl.rollouts.chunked.chunked_solve`, as ``SolRL.explore_stage`` does. The ``:fused`` FP8
variants build the copy with ``fuse_under_compile=True``: under ``--compile`` the activation quantiser is
traced from torch operators, which the compiler may fuse into the norm or modulation before it,
instead of the opaque kernel operator (eager calls run the kernel either way). The ``:unshared`` variants
quantise each Linear's input separately, as before 2026-11-29; the others quantise a tensor that several
Linears read (q / k / v, FLUX's ``proj_mlp``) once (:mod:`flowrl.policy.shared_input`). The ``:fastacc``
variants run the FP8 GEMMs with ``use_fast_accum`` (``build_explore(fast_accum=True)``: the tensor cores' own
accumulator, as inference stacks run FP8 forwards), the others with torch's default promotion to fp32.

Models: the transformers of ``bench/gpu_plan.py`` built from their published configs with random
bf16 weights and the shipped LoRA (``bench.gpu_measure``'s builder: nothing is downloaded; speed does
not depend on the values), inside a real ``StableDiffusion3Pipeline`` / ``FluxPipeline`` with the
16-channel ``AutoencoderKL`` (random init) and the published scheduler configs, driven through
``SD3Adapter`` / ``FluxAdapter``. 512² images (64 x 64 x 16 latents). The text conditioning is random
tensors of the text encoders' output shapes (one per prompt; the encoders are not built).

Reward: JPEG compressibility (``flowrl.rewards``' ``jpeg_compressibility``, DDPO): it needs no weights
and reads every pixel, so it ranks the decoded samples by their content. Random weights make the
images noise-like, so part of any agreement comes from the shared initial noise; the row
"seed noise only" (the initial noise decoded, no denoiser) gives that floor, and "image diff"
is ``|img - img_ref| / |img_ref - img_noise|``: the explore copy's deviation over the reference
model's own contribution. Trained weights are needed for the agreement Sol-RL reports.

Printed per model and explore copy: quantised layers, the seconds to build the copy and make its
first call (one chunk: kernel choice; with ``--compile MODE``, flowrl's ``memory.compile`` of the copy,
tracing and code generation too), sampling seconds (median of ``--repeats`` full runs), candidates per
second of the denoiser alone and with decode + reward, the speed-up over the reference (first
variant), peak GPU memory (building the copy and sampling), and the
reward agreement with the reference's samples of the same seeds: Kendall tau and Spearman rho over
all samples, the mean per-prompt Kendall tau, and the overlap of Sol-RL's best-worst sets (top and
bottom eighth of each prompt's seeds).

Usage::

    python -m bench.fp8_explore [--models SD3.5-M FLUX.1-dev] [--seeds 24] [--steps 6] [--repeats 2]
        [--compile default] [--compile-scope blocks]
    python -m bench.fp8_explore --tiny        # CPU: tiny random SD3 and FLUX pipelines, fp32 reference
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flowrl.models.adapter import Cond, model_latent_shape, select_cond
from flowrl.models.pipeline_schedule import pipeline_sigmas
from flowrl.policy.memory import COMPILE_MODES, COMPILE_SCOPES, compile_denoiser, trainable_attention
from flowrl.policy.precision import build_explore
from flowrl.rewards import build_reward
from flowrl.rollouts.chunked import chunked_solve
from flowrl.runtime import seeded_noise
from flowrl.solrl.diagnostics import extreme_overlap, kendall_tau, spearman_rho
from flowrl.solrl.explore import explore_transformer

GIB = 1024**3
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (precision, build_explore options)
    "fp32": ("fp32", {}),
    "bf16": ("bf16", {}),
    "fp8_e4m3:tensor": ("fp8_e4m3", {"scaling": "tensor"}),
    "fp8_e4m3:row": ("fp8_e4m3", {"scaling": "row"}),
    "fp8_e4m3:tensor:fused": ("fp8_e4m3", {"scaling": "tensor", "fuse_under_compile": True}),
    "fp8_e4m3:row:fused": ("fp8_e4m3", {"scaling": "row", "fuse_under_compile": True}),
    "fp8_e4m3:row:unshared": ("fp8_e4m3", {"scaling": "row", "share_inputs": False}),
    "fp8_e4m3:tensor:fastacc": ("fp8_e4m3", {"scaling": "tensor", "fast_accum": True}),
    "fp8_e4m3:row:fastacc": ("fp8_e4m3", {"scaling": "row", "fast_accum": True}),
    "fp8_e4m3:row:fused:fastacc": ("fp8_e4m3", {"scaling": "row", "fuse_under_compile": True, "fast_accum": True}),
    "nvfp4": ("nvfp4", {}),
    "nvfp4:act": ("nvfp4", {"activations": True}),
    "nvfp4:act:unshared": ("nvfp4", {"activations": True, "share_inputs": False}),
    "int8_dynamic": ("int8_dynamic", {}),
    "native_nvfp4": ("native_nvfp4", {}),
}
CUDA_VARIANTS = ["bf16", "fp8_e4m3:tensor", "fp8_e4m3:row"]
CPU_VARIANTS = ["fp32", "bf16", "fp8_e4m3:tensor", "fp8_e4m3:row", "int8_dynamic", "nvfp4"]
# published scheduler configs: SD3.5 (static shift 3) and FLUX.1-dev (resolution-dependent shift)
SD3_SCHEDULER = {"shift": 3.0}
FLUX_SCHEDULER = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


@dataclass
class Case:
    """One model to explore with: its adapter, the prompts' conditioning and the sampling geometry.

    Attributes:
        name: the model's name in the table.
        adapter: an ``SD3Adapter`` or ``FluxAdapter`` (policy transformer with its LoRA, VAE, scheduler).
        cond: conditioning of the P prompts (one row each).
        resolution: (height, width) in pixels.
        chunk: samples per model call.
        compile: ``memory.compile`` mode of each explore copy ("none": eager).
        compile_scope: ``memory.compile_scope``: the whole copy ("model") or each repeated block ("blocks").
    """

    name: str
    adapter: Any
    cond: Cond
    resolution: tuple[int, int]
    chunk: int
    compile: str = "none"
    compile_scope: str = "model"


# --------------------------------------------------------------------------- models


def pipeline_from_parts(family: str, transformer: torch.nn.Module, vae: torch.nn.Module, scheduler: dict) -> Any:
    """A diffusers SD3 / FLUX pipeline around ``transformer`` and ``vae``, without text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline

    sched = FlowMatchEulerDiscreteScheduler(**scheduler)
    if family == "sd3":
        none = dict.fromkeys(
            ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
        )
        return StableDiffusion3Pipeline(transformer=transformer, scheduler=sched, vae=vae, **none)
    none = dict.fromkeys(("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"))
    return FluxPipeline(transformer=transformer, scheduler=sched, vae=vae, **none)


def adapter_for(family: str, pipe: Any, resolution: tuple[int, int]) -> Any:
    """The flowrl model adapter of the family over ``pipe``."""
    from flowrl.models.flux import FluxAdapter
    from flowrl.models.sd3 import SD3Adapter

    if family == "sd3":
        return SD3Adapter(pipe, resolution=resolution, model_id="sd3-random")
    return FluxAdapter(pipe, resolution=resolution, model_id="flux-random")


def random_cond(prompts: int, text_tokens: int, text_dim: int, pooled_dim: int, like: torch.Tensor) -> Cond:
    """Conditioning of the text encoders' output shapes, standard normal: (P, L, D) and (P, pooled)."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "encoder_hidden_states": torch.randn(prompts, text_tokens, text_dim, generator=gen).to(like),
        "pooled_projections": torch.randn(prompts, pooled_dim, generator=gen).to(like),
    }


def full_case(name: str, prompts: int, chunk: int) -> Case:
    """SD3.5-M or FLUX.1-dev at 512² on CUDA: random bf16 weights and LoRA (``bench.gpu_measure``'s builder)."""
    from bench.gpu_measure import _build, _models
    from bench.gpu_plan import image_vae

    builder, _, targets, rank = _models()[name]
    transformer = _build(builder, targets, rank)
    family = "sd3" if name.startswith("SD3") else "flux"
    with torch.device("cuda"):
        vae = image_vae().to(torch.bfloat16).eval()  # diffusers' default init; scaling of the published VAEs
    vae.register_to_config(
        **(
            {"scaling_factor": 1.5305, "shift_factor": 0.0609}
            if family == "sd3"
            else {"scaling_factor": 0.3611, "shift_factor": 0.1159}
        )
    )
    pipe = pipeline_from_parts(family, transformer, vae, SD3_SCHEDULER if family == "sd3" else FLUX_SCHEDULER)
    adapter = adapter_for(family, pipe, (512, 512))
    weight = next(transformer.parameters())
    text = (333, 4096, 2048) if family == "sd3" else (512, 4096, 768)  # CLIP-L + bigG + T5 / T5 tokens
    return Case(name, adapter, random_cond(prompts, *text, like=weight), (512, 512), chunk)


def tiny_cases(prompts: int, chunk: int) -> list[Case]:
    """Tiny random SD3 and FLUX pipelines of the test suite (real classes, fp32 on the CPU), with a LoRA r4."""
    from flowrl.models.flux import flux_lora_targets
    from flowrl.models.sd3 import SD3_LORA_TARGETS
    from flowrl.policy.lora import add_lora

    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests), str(tests / "models")]
    from conftest import tiny_sd3_pipeline
    from tiny_flow_pipelines import tiny_flux_pipeline

    sd3 = tiny_sd3_pipeline(0, size=16, num_layers=2, attention_head_dim=16, caption_projection_dim=32)
    flux = tiny_flux_pipeline(seed=0)
    cases = []
    for name, family, pipe, targets, side in (
        ("tiny SD3", "sd3", sd3, SD3_LORA_TARGETS, 16),
        ("tiny FLUX", "flux", flux, flux_lora_targets(flux.transformer.config.num_single_layers), 16),
    ):
        add_lora(pipe.transformer, rank=4, alpha=4, targets=targets)
        parts = pipeline_from_parts(family, pipe.transformer, pipe.vae, dict(pipe.scheduler.config))
        adapter = adapter_for(family, parts, (side, side))
        config = pipe.transformer.config
        cond = random_cond(prompts, 6, config.joint_attention_dim, config.pooled_projection_dim, torch.zeros(()))
        cases.append(Case(name, adapter, cond, (side, side), chunk))
    return cases


# --------------------------------------------------------------------------- stage 1


@dataclass
class Explored:
    """What one explore copy gave: rewards (P, S), images (P * S, 3, H, W) on the CPU, and its figures."""

    rewards: torch.Tensor
    images: torch.Tensor
    layers: int
    build_s: float
    sample_s: float
    score_s: float
    peak_gib: float


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_and_score(
    case: Case, latents: torch.Tensor, reward: Callable, texts: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode (chunk by chunk) and score; returns the images in [0, 1] on the CPU and their rewards."""
    images = torch.cat(
        [case.adapter.decode(latents[i : i + case.chunk]).cpu() for i in range(0, latents.shape[0], case.chunk)]
    )
    return images, reward(images, texts)


def explore(case: Case, variant: str | None, seeds: list[int], steps: int, repeats: int, reward: Callable) -> Explored:
    """Stage 1 with one explore copy (None: no denoiser, the seed noise decoded): time, sample, decode, score."""
    adapter, device = case.adapter, case.adapter.device
    prompts = case.cond["encoder_hidden_states"].shape[0]
    per = len(seeds) // prompts
    rows = torch.arange(prompts).repeat_interleave(per)
    cond, texts = select_cond(case.cond, rows), [f"prompt {int(p)}" for p in rows]
    noise = seeded_noise(model_latent_shape(adapter, case.resolution), seeds).to(device)
    sigmas = pipeline_sigmas(adapter.pipe.scheduler.config, steps, noise.shape[-1] * noise.shape[-2] // 4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if variant is None:
        start = time.perf_counter()
        images, rewards = decode_and_score(case, noise, reward, texts)
        return Explored(rewards.view(prompts, per), images, 0, 0.0, 0.0, time.perf_counter() - start, 0.0)
    precision, options = VARIANTS[variant]
    start = time.perf_counter()
    model = build_explore(adapter, precision, **options)
    compile_denoiser(model.module, case.compile, case.compile_scope)

    def run(x: torch.Tensor, c: Cond) -> torch.Tensor:
        with torch.no_grad(), explore_transformer(adapter, model.module), trainable_attention():  # as Trainer.collect
            return chunked_solve(adapter, c, x, sigmas, solver="euler", chunk_size=case.chunk)

    run(noise[: case.chunk], select_cond(cond, slice(0, case.chunk)))  # warm-up: kernel choice, allocator, compile
    sync(device)
    build_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        latents = run(noise, cond)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else 0.0
    layers = len(model.quantised)
    model = None  # free the copy (FLUX: 24 GB) before the next one is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start = time.perf_counter()
    images, rewards = decode_and_score(case, latents, reward, texts)
    score_s = time.perf_counter() - start
    return Explored(rewards.view(prompts, per), images, layers, build_s, statistics.median(times), score_s, peak)


def agreement(got: Explored, ref: Explored, noise: Explored) -> dict[str, float]:
    """Rank agreement of ``got``'s rewards with the reference's, and its image deviation."""
    a, b = got.rewards.double(), ref.rewards.double()
    k = max(1, a.shape[1] // 8)
    model_part = (ref.images - noise.images).norm()
    return {
        "kendall": kendall_tau(a.reshape(-1), b.reshape(-1)),
        "spearman": spearman_rho(a.reshape(-1), b.reshape(-1)),
        "per_prompt": statistics.mean(kendall_tau(x, y) for x, y in zip(a, b)),
        "overlap": statistics.mean(extreme_overlap(y, x, k) for x, y in zip(a, b)),
        "image_diff": float((got.images - ref.images).norm() / model_part) if model_part > 0 else float("nan"),
    }


def rows_for(case: Case, variants: list[str], seeds_per_prompt: int, steps: int, repeats: int) -> Iterator[str]:
    """Table rows of one model, each as soon as it is measured: the reference, the seed-noise floor, the others."""
    reward = build_reward("jpeg_compressibility")
    prompts = case.cond["encoder_hidden_states"].shape[0]
    seeds = [1000 + i for i in range(prompts * seeds_per_prompt)]
    noise = explore(case, None, seeds, steps, repeats, reward)
    ref = explore(case, variants[0], seeds, steps, repeats, reward)
    yield row(case.name, variants[0], ref, ref, noise, steps)
    yield row(case.name, "seed noise only (no denoiser)", noise, ref, noise, steps)
    for variant in variants[1:]:
        yield row(case.name, variant, explore(case, variant, seeds, steps, repeats, reward), ref, noise, steps)


def row(model: str, name: str, got: Explored, ref: Explored, noise: Explored, steps: int) -> str:
    """One table row: speed of ``got`` and its agreement with the reference ``ref`` (floor: ``noise``)."""
    agree, n, sampled = agreement(got, ref, noise), got.rewards.numel(), got.sample_s > 0
    cells = (
        [steps, got.layers, f"{got.build_s:.1f}", f"{got.sample_s:.2f}", f"{n / got.sample_s:.1f}"]
        if sampled
        else ["-"] * 5
    )
    cells += [f"{ref.sample_s / got.sample_s:.2f}" if sampled else "-", f"{n / (got.sample_s + got.score_s):.1f}"]
    cells += [f"{got.peak_gib:.1f}" if sampled and got.peak_gib else "-"]
    cells += [f"{agree[key]:.3f}" for key in ("kendall", "spearman", "per_prompt", "overlap", "image_diff")]
    return f"| {model} | {name} | " + " | ".join(map(str, cells)) + " |"


HEADER = (
    "| model | explore copy | steps | quantised layers | build + first call s | sample s | candidates/s | x ref | "
    "candidates/s with decode + reward | peak GiB | Kendall tau | Spearman rho | per-prompt tau | "
    "best-worst overlap | image diff |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def cases(args: argparse.Namespace) -> Iterator[Case]:
    """The models to explore with, built lazily (each full-size one after the last is dropped)."""
    if args.tiny:
        yield from tiny_cases(args.prompts or 2, args.chunk or 16)
        return
    for name in args.models:
        sd3 = name == "SD3.5-M"
        yield full_case(name, args.prompts or (4 if sd3 else 2), args.chunk or (16 if sd3 else 8))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["SD3.5-M", "FLUX.1-dev"], choices=["SD3.5-M", "FLUX.1-dev"])
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), help="first = reference")
    parser.add_argument("--prompts", type=int, default=None, help="default: 4 for SD3.5-M, 2 for FLUX, 2 tiny")
    parser.add_argument("--seeds", type=int, default=24, help="seeds per prompt")
    parser.add_argument("--steps", type=int, default=6, help="deterministic Euler steps (Sol-RL's stage 1: 6)")
    parser.add_argument("--chunk", type=int, default=None, help="samples per call; default 16 SD3.5-M, 8 FLUX")
    parser.add_argument("--repeats", type=int, default=2, help="timed full runs per explore copy (median)")
    parser.add_argument("--compile", default="none", choices=COMPILE_MODES, help="memory.compile of each copy")
    parser.add_argument("--compile-scope", default="model", choices=COMPILE_SCOPES, help="memory.compile_scope")
    parser.add_argument("--tiny", action="store_true", help="tiny SD3 and FLUX pipelines on the CPU (a test)")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        raise SystemExit(f"--seeds must be >= 2 per prompt (rank agreement); got {args.seeds}")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench.fp8_explore needs a CUDA GPU for the full-size models; --tiny runs on the CPU")
    variants = args.variants or (CPU_VARIANTS if args.tiny else CUDA_VARIANTS)
    device = "cpu" if args.tiny else torch.cuda.get_device_name()
    print(
        f"# {device}, torch {torch.__version__}, random weights, {args.seeds} seeds per prompt, {args.steps} Euler "
        f"steps, reward jpeg_compressibility, reference {variants[0]}, median of {args.repeats} timed runs, "
        f"memory.compile={args.compile}, memory.compile_scope={args.compile_scope}"
    )
    print(HEADER)
    for case in cases(args):  # full-size models are built one at a time
        case.compile, case.compile_scope = args.compile, args.compile_scope
        for line in rows_for(case, variants, args.seeds, args.steps, args.repeats):
            print(line, flush=True)
        case = None  # drop the model before the generator builds the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
