"""The memory estimate of a run (``flowrl train --check`` and :func:`flowrl.resources.check_machine`).

The memory estimate reads the model's geometry without loading weights
(:mod:`flowrl.models.geometry`: the folder's JSON configs and the headers of its
``*.safetensors`` files). It is order-of-magnitude honest, not exact. It counts, in bytes:

- model weights: every component's parameters in ``model.dtype``;
- LoRA: ``lora.rank`` x (in + out) of each targeted linear layer, x 24 bytes (fp32 weights,
  gradients, two AdamW moments and two extra adapter copies, e.g. DiffusionNFT's old and ema);
- the prompt cache (host memory): every prompt a run encodes, ``text tokens x text width`` in
  ``model.dtype`` (twice under true CFG: the negative prompt rides along);
- one iteration: the rollout latents (fp32; every step for SDE and tree rollouts, the last one
  for solver rollouts), the decoded images (fp32), the conditioning of the batch, the fresh
  training noise a forward-process objective's plan holds (fp32, ``Objective.noise_per_row``
  latents per sample: DiffusionNFT, AWM), the activations
  of one training chunk (``sampler.chunk_size`` rows; 28 values per token, hidden unit and layer,
  or layer inputs + 28 with ``memory.gradient_checkpointing``, calibrated on the H100
  measurements of docs/gpu-plan.md) and one VAE decode;
- Sol-RL (``solrl.mode`` not ``off``): the explore copy of the denoiser at ``solrl.precision``
  (alive through the run), and under ``regenerate`` stage 1 as its own phase: the final latents,
  conditioning, one sampling chunk and one decode of ``prompts.per_iteration`` x
  ``solrl.candidates`` candidates (:func:`_explore`);
- one evaluation: its trajectory, images and activations (``train.eval_seeds`` x eval prompts);
- the before/after grids (``output.grid_seeds`` x up to 20 eval prompts);
- the process itself (host memory): Python with torch, diffusers and transformers imported,
  :data:`PROCESS_BYTES` (each process of a launch pays it again).

The host pool counts every process a launch starts on this machine (``host_processes``).
Not counted: attention score matrices (flash / memory-efficient kernels do not store them),
optimizer temporaries, allocator fragmentation and CUDA's own context. When the model folder
is not available locally, only devices, threads and the work limit are checked, and loading the
model then fails with its own message.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from .models.geometry import Geometry

if TYPE_CHECKING:
    from .config import Config

# Activation values per token and hidden unit, calibrated on the H100 measurements of docs/gpu-plan.md
# (SD3.5-M, Wan2.1-1.3B: ~28 per layer kept for the backward pass; a no-grad forward peaks near 16 in all)
TRAIN_VALUES = 28
INFER_VALUES = 16
LORA_BYTES = 24  # per LoRA parameter: fp32 weight, gradient, 2 AdamW moments, 2 extra adapter copies
GRID_MAX_PROMPTS = 20  # as flowrl.recipe: the before/after grid shows at most this many prompts
EVAL_MIN_CHUNK = 64  # as the trainer: evaluation samples in chunks of max(sampler.chunk_size, 64)
PROCESS_BYTES = 0.5e9
"""Host memory of one process before any tensor: Python with torch, diffusers, transformers, peft and
flowrl's trainer imported (0.52 GB unique set size measured on the CPU test machine, 2026-12-07, torch 2.11)."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_EXPLORE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8_dynamic": 1.0, "native_nvfp4": 0.5 + 1 / 16}  # per parameter


class Part(NamedTuple):
    """One term of the memory estimate.

    Attributes:
        name: what it is, with the config values that size it.
        nbytes: its size.
        fix: the settings that shrink it, for the message.
        on_device: whether it lives on the model's device (else in host memory).
    """

    name: str
    nbytes: float
    fix: str
    on_device: bool = True


class Estimate(NamedTuple):
    """The memory a run needs, split by where it lives, and what the machine has.

    Attributes:
        device: the model's device (``model.device``).
        parts: the terms that are alive together at the peak.
        need: bytes by pool ("device" for a CUDA model, else everything is "host"); the host pool counts
            every process on this machine (``host_processes`` x one process's host parts).
        available: bytes available by pool (None where it could not be read).
        host_processes: processes of the launch on this machine: their host memory adds up (each CUDA
            process has a GPU of its own, so the device pool is one process's).
    """

    device: str
    parts: list[Part]
    need: dict[str, float]
    available: dict[str, float | None]
    host_processes: int = 1

    def shared(self, pool: str) -> str:
        """``4 processes x ~300 MB`` where several processes share ``pool`` (the host), else ``""``."""
        if pool != "host" or self.host_processes <= 1:
            return ""
        return f"{self.host_processes} processes x ~{human_bytes(self.need[pool] / self.host_processes)}"

    def summary(self) -> str:
        """One line: the estimate per pool against what is available."""
        pools = [
            f"~{human_bytes(n)} of {k} memory" + (f" ({s})" if (s := self.shared(k)) else "")
            for k, n in self.need.items()
        ]
        free = [f"{human_bytes(a)} {k}" for k, a in self.available.items() if a is not None]
        return f"the run needs {' and '.join(pools)}; available: {', '.join(free) or 'unknown'}"


def human_bytes(n: float) -> str:
    """``1.2 GB``-style size (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


# -- the estimate -------------------------------------------------------------------------------


class Sizes(NamedTuple):
    """Per-sample sizes at the run's resolution: output (height, width, frames) and element counts."""

    height: int
    width: int
    frames: int
    latent: int  # latent elements
    pixels: int  # decoded elements (3 x frames x height x width)
    tokens: int  # transformer tokens, text included


def sample_sizes(cfg: Config, g: Geometry) -> Sizes:
    """The :class:`Sizes` of one sample under ``model.resolution`` / ``model.num_frames`` (or the model's defaults)."""
    res = cfg.model.resolution
    height, width = g.default_resolution if res is None else (res, res) if isinstance(res, int) else res
    frames = (cfg.model.num_frames or g.default_frames) if g.default_frames else 1
    latent_frames = (frames - 1) // g.temporal_factor + 1
    h, w = -(-height // g.vae_factor), -(-width // g.vae_factor)
    tokens = latent_frames * -(-h // g.patch) * -(-w // g.patch) + g.text_tokens
    return Sizes(height, width, frames, g.latent_channels * latent_frames * h * w, 3 * frames * height * width, tokens)


def _activations(cfg: Config, g: Geometry, z: Sizes, rows: int, training: bool) -> float:
    """Activations of one transformer call on ``rows`` samples (all layers kept for backward when training)."""
    nbytes = 2 if cfg.memory.autocast != "none" or cfg.model.dtype != "float32" else 4
    guided = 2 if cfg.sampler.guidance_scale != 1 else 1  # true CFG runs [uncond; cond] in one call
    per_value = guided * rows * z.tokens * g.hidden * nbytes
    if not training:
        return per_value * INFER_VALUES
    kept = g.layers + TRAIN_VALUES if cfg.memory.gradient_checkpointing else g.layers * TRAIN_VALUES
    return per_value * kept


def _decode(cfg: Config, g: Geometry, z: Sizes, rows: int) -> float:
    """One VAE decode of ``rows`` samples: three fp32 feature maps of its largest decoder level alive at once."""
    rows = 1 if cfg.memory.vae_slicing else rows
    height, width = (min(z.height, 512), min(z.width, 512)) if cfg.memory.vae_tiling else (z.height, z.width)
    per_sample = max(c * (height >> i) * (width >> i) for i, c in enumerate(g.vae_widths))
    return 3 * rows * z.frames * per_sample * 4


PARAMETER_SHARDINGS = ("fsdp2", "zero3")
"""``train.sharding`` values that split the denoiser's parameters (the frozen base too) over the processes."""


def _weights(cfg: Config, g: Geometry, processes: int = 1) -> list[Part]:
    """Model weights in ``model.dtype``; text encoders / VAE in host memory when offloaded.

    With ``train.sharding`` fsdp2 / zero3 over several processes a rank keeps ``1 / processes`` of the
    denoiser plus two blocks' full weights (the block running and the one being gathered next).
    """
    nbytes = _DTYPE_BYTES[cfg.model.dtype]
    encoders = sum(n for name, n in g.params.items() if name.startswith("text_encoder"))
    vae = g.params.get("vae", 0)
    denoiser = sum(g.params.values()) - encoders - vae
    fix = "use model.dtype=bfloat16, memory.offload_encoders=true, or a machine with more memory"
    label = f"denoiser weights ({denoiser / 1e6:,.1f} M parameters, {cfg.model.dtype}"
    held, held_fix = float(denoiser), fix
    if processes > 1 and cfg.train.sharding in PARAMETER_SHARDINGS:
        held = denoiser / processes + 2 * denoiser / max(g.layers, 1)
        label += f"; {cfg.train.sharding}: 1/{processes} of them + 2 gathered blocks"
        held_fix = "launch more processes, " + fix
    return [
        Part(label + ")", held * nbytes, held_fix),
        Part("text encoder weights", encoders * nbytes, fix, not cfg.memory.offload_encoders),
        Part("VAE weights", vae * nbytes, fix, not cfg.memory.offload_vae),
    ]


def _cached_prompts(cfg: Config, train_prompts: int, eval_prompts: int) -> int:
    """Prompts the in-memory prompt cache ends up holding: every one a run encodes (all when warmed up front)."""
    if cfg.memory.free_encoders_when_cached:
        return train_prompts + eval_prompts
    return min(train_prompts, cfg.prompts.per_iteration * cfg.train.iterations) + eval_prompts


def _persistent(
    cfg: Config, g: Geometry, z: Sizes, train_prompts: int, eval_prompts: int, processes: int = 1
) -> list[Part]:
    """What lives through the whole run: weights, LoRA and optimizer state, prompt cache (host), the grids.

    Any ``train.sharding`` but none splits the LoRA's gradients and AdamW state over the processes.
    """
    grid = 2 * min(eval_prompts, GRID_MAX_PROMPTS) * cfg.output.grid_seeds
    prompts = _cached_prompts(cfg, train_prompts, eval_prompts)
    guided = 2 if cfg.sampler.guidance_scale != 1 else 1  # each entry also holds the negative prompt
    cache = guided * prompts * g.text_tokens * g.text_dim * _DTYPE_BYTES[cfg.model.dtype]
    shards = processes if cfg.train.sharding != "none" else 1
    return [
        *_weights(cfg, g, processes),
        Part(
            f"LoRA weights and optimizer state (lora.rank={cfg.lora.rank}"
            + (f", 1/{shards} per process)" if shards > 1 else ")"),
            g.lora_width * cfg.lora.rank * LORA_BYTES / shards,
            "lower lora.rank or target fewer layers (lora.targets)",
        ),
        Part(
            f"prompt cache ({prompts} prompts)", cache, "use smaller prompt sets (prompts.train, prompts.eval)", False
        ),
        Part(f"before/after grids ({grid} images)", grid * z.pixels * 4, "lower output.grid_seeds", False),
    ]


def _rollout_kind(cfg: Config) -> str:
    """The rollout kind of the configured objective (SAGE-GRPO's depends on its options)."""
    from .trainer import build_objective

    return build_objective(cfg).rollout


def _samples(
    cfg: Config, g: Geometry, z: Sizes, what: str, samples: int, steps: int, detail: str, fixes: list[str]
) -> list[Part]:
    """Latents (``samples`` x ``steps``), decoded images and conditioning of a batch.

    ``detail`` says what sizes the batch (e.g. the prompt and group keys); ``fixes`` name the keys to lower.
    """
    res = f"model.resolution={z.height}x{z.width}"
    return [
        Part(f"{what} latents ({detail} samples x {steps} steps at {res})", samples * steps * z.latent * 4, fixes[0]),
        Part(f"{what} images ({detail} at {res})", samples * z.pixels * 4, fixes[1], False),
        Part(
            f"{what} conditioning ({samples} samples)",
            samples * g.text_tokens * g.text_dim * _DTYPE_BYTES[cfg.model.dtype],
            fixes[2],
        ),
    ]


def _iteration(cfg: Config, g: Geometry, z: Sizes, processes: int) -> list[Part]:
    """One training iteration of one process: its rows of the rollout batch, conditioning, one chunk, one decode."""
    s, p, res = cfg.sampler, cfg.prompts, f"model.resolution={z.height}x{z.width}"
    batch = -(-p.per_iteration * p.group_size // processes)
    from .trainer import build_objective

    objective = build_objective(cfg)
    steps = s.num_steps + 1 if objective.rollout in ("sde", "tree") else 1
    chunk, rows = min(s.chunk_size, batch), min(cfg.train.score_chunk_size or s.chunk_size, batch)
    size = f"prompts.per_iteration={p.per_iteration} x prompts.group_size={p.group_size}"
    size += f" / {processes} processes" if processes > 1 else ""
    fixes = [
        "lower prompts.per_iteration, prompts.group_size, sampler.num_steps or model.resolution",
        "lower prompts.per_iteration, prompts.group_size or model.resolution",
        "lower prompts.per_iteration or prompts.group_size",
    ]
    chunk_fixes = [
        "lower sampler.chunk_size or model.resolution, or set memory.gradient_checkpointing=true",
        "lower train.score_chunk_size or model.resolution, or set memory.vae_slicing=true",
    ]
    noise = objective.noise_per_row(s.num_steps)
    plan = [
        Part(
            f"training noise of the plan ({size} samples x {noise} sigmas at {res})",
            batch * noise * z.latent * 4,
            f"lower prompts.per_iteration or prompts.group_size, or the training sigmas of {objective.name}",
        )
    ]
    return [
        *_samples(cfg, g, z, "rollout", batch, steps, size, fixes),
        *(plan if noise else []),
        *_chunk(
            cfg, g, z, f"training chunk (sampler.chunk_size={chunk} at {res})", chunk, rows, chunk_fixes, training=True
        ),
    ]


def _explore_bytes(cfg: Config) -> float:
    """Bytes per denoiser parameter of the Sol-RL explore copy (:mod:`flowrl.policy.precision`).

    Emulated NVFP4 / FP8 keep fake-quantised weights in ``model.dtype``; FP8 on CUDA stores E4M3
    (``torch._scaled_mm``); native NVFP4 half a byte plus one E4M3 scale per 16 values.
    """
    precision = cfg.solrl.precision
    if precision == "fp8_e4m3" and torch.device(cfg.model.device).type == "cuda":
        return 1.0
    return _EXPLORE_BYTES.get(precision, _DTYPE_BYTES[cfg.model.dtype])


def stage1_candidates(cfg: Config, processes: int) -> int:
    """Sol-RL stage-1 candidates the busiest process samples per iteration.

    Stage 1 deals whole prompts to the ranks (prompt ``p`` to rank ``p % processes``,
    :meth:`flowrl.solrl.pipeline.SolRL.explore_stage`), so rank 0 explores ``ceil(per_iteration /
    processes)`` prompts of ``solrl.candidates`` seeds each.
    """
    return -(-cfg.prompts.per_iteration // processes) * cfg.solrl.candidates


def _explore(cfg: Config, g: Geometry, z: Sizes, processes: int) -> tuple[list[Part], list[Part]]:
    """Sol-RL: (the explore copy, alive through the run; stage 1 of ``regenerate``, a phase of its own).

    The copy counts every denoiser parameter at :func:`_explore_bytes` (the quantised Linear layers
    are nearly all of it). Stage 1 keeps one process's ``prompts.per_iteration`` x ``solrl.candidates``
    final latents and conditioning, and runs one sampling chunk and one decode at a time.
    """
    s, p = cfg.solrl, cfg.prompts
    if s.mode == "off":
        return [], []
    encoders = sum(n for name, n in g.params.items() if name.startswith("text_encoder"))
    denoiser = sum(g.params.values()) - encoders - g.params.get("vae", 0)
    copy = Part(
        f"Sol-RL explore copy of the denoiser (solrl.precision={s.precision})",
        denoiser * _explore_bytes(cfg),
        "use solrl.precision=fp8_e4m3 (CUDA), int8_dynamic (CPU) or native_nvfp4 (Blackwell), or solrl.mode=off",
    )
    if s.mode != "regenerate":
        return [copy], []
    candidates = stage1_candidates(cfg, processes)
    size = f"prompts.per_iteration={p.per_iteration} x solrl.candidates={s.candidates}"
    size += f" / {processes} processes" if processes > 1 else ""
    fixes = ["lower solrl.candidates, prompts.per_iteration or model.resolution"] * 3
    chunk = min(cfg.sampler.chunk_size, candidates)
    stage1 = [
        *_samples(cfg, g, z, "Sol-RL stage-1", candidates, 1, size, fixes),
        *_chunk(
            cfg,
            g,
            z,
            f"explore chunk (sampler.chunk_size={chunk})",
            chunk,
            chunk,
            ["lower sampler.chunk_size or model.resolution", "lower sampler.chunk_size or set memory.vae_slicing=true"],
            training=False,
        ),
    ]
    return [copy], stage1


def _chunk(
    cfg: Config, g: Geometry, z: Sizes, what: str, chunk: int, rows: int, fixes: list[str], *, training: bool
) -> list[Part]:
    """Activations of one model call on ``chunk`` samples and one VAE decode of ``rows`` samples.

    ``training`` adds what autograd keeps for the backward pass; ``fixes`` name the keys that shrink each part.
    """
    res = f"model.resolution={z.height}x{z.width}"
    return [
        Part(f"activations of one {what}", _activations(cfg, g, z, chunk, training=training), fixes[0]),
        Part(f"VAE decode of {rows} samples at {res}", _decode(cfg, g, z, rows), fixes[1]),
    ]


def _evaluation(cfg: Config, g: Geometry, z: Sizes, samples: int, steps: int, label: str) -> list[Part]:
    """One evaluation or sampling pass of ``samples``: ODE trajectory, images, conditioning, one chunk, the decode."""
    chunk = min(max(cfg.sampler.chunk_size, EVAL_MIN_CHUNK), samples)
    res = f"model.resolution={z.height}x{z.width}"
    fixes = ["lower train.eval_seeds, train.eval_steps or model.resolution"] + ["lower train.eval_seeds"] * 2
    chunk_fixes = ["lower model.resolution", "lower model.resolution, or set memory.vae_slicing=true"]
    return [
        *_samples(cfg, g, z, label, samples, steps + 1, str(samples), fixes),
        *_chunk(cfg, g, z, f"sampling chunk ({chunk} samples at {res})", chunk, chunk, chunk_fixes, training=False),
    ]


def prompt_counts(cfg: Config) -> tuple[int, int]:
    """(train, eval) prompt counts, loaded as the run loads them (a hash split of ``prompts.train`` approximated).

    Raises:
        FileNotFoundError, ValueError: a prompt source that does not load (the run's own message).
    """
    from .prompts.sets import load_prompts

    p = cfg.prompts
    if p.test_fraction:
        total = len(load_prompts(p.train, split="train"))
        held = max(1, round(total * p.test_fraction))
        return max(1, total - held), held
    return len(load_prompts(p.train, split="train")), len(load_prompts(p.eval, split="test"))


def estimate_memory(
    cfg: Config,
    g: Geometry,
    *,
    training: bool = True,
    train_prompts: int = 1,
    eval_prompts: int = 1,
    processes: int = 1,
    host_processes: int = 1,
) -> Estimate:
    """The memory peak of a run (``training``) or of sampling one chunk, by pool, against what is available.

    Args:
        cfg: the run config.
        g: the model's geometry (:func:`read_geometry`).
        training: a training run; False estimates ``flowrl sample``: weights and one 64-sample chunk.
        train_prompts: training prompts (training only).
        eval_prompts: evaluation prompts (training only).
        processes: processes sharing the rollout batch (``accelerate launch --num_processes``); the
            estimate is per process (evaluation as on rank 0).
        host_processes: processes on this machine (``flowrl train --processes N`` starts all N here):
            the host pool's need is that many times one process's.

    Returns:
        The :class:`Estimate`.
    """
    z = sample_sizes(cfg, g)
    steps = cfg.train.eval_steps or cfg.sampler.num_steps
    if training:
        evaluation = _evaluation(cfg, g, z, eval_prompts * cfg.train.eval_seeds, steps, "evaluation")
        explore_copy, stage1 = _explore(cfg, g, z, processes)
        phases = [_iteration(cfg, g, z, processes), evaluation] + ([stage1] if stage1 else [])
        phase = max(phases, key=lambda parts: sum(p.nbytes for p in parts))
        parts = _persistent(cfg, g, z, train_prompts, eval_prompts, processes) + explore_copy + phase
    else:
        parts = _weights(cfg, g) + _evaluation(cfg, g, z, EVAL_MIN_CHUNK, cfg.sampler.num_steps, "sampling")
    parts.append(
        Part("the process itself (Python, torch, diffusers imported)", PROCESS_BYTES, "launch fewer processes", False)
    )
    pool = "device" if torch.device(cfg.model.device).type == "cuda" else "host"
    need: dict[str, float] = {}
    for part in parts:
        key = pool if part.on_device else "host"
        need[key] = need.get(key, 0.0) + part.nbytes * (host_processes if key == "host" else 1)
    available = {k: available_memory(k, cfg.model.device) for k in need}
    return Estimate(cfg.model.device, parts, need, available, host_processes)


def available_memory(pool: str, device: str) -> float | None:
    """Free bytes: the CUDA device's (``torch.cuda.mem_get_info``) or the host's available RAM; None if unknown."""
    if pool == "device":
        index = torch.device(device).index
        return float(torch.cuda.mem_get_info(torch.cuda.current_device() if index is None else index)[0])
    try:
        import psutil

        return float(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
