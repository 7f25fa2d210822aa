"""Run configuration: typed dataclasses, defaults ⊕ YAML files ⊕ ``key=value`` overrides, validation.

Reading the files and the overrides lives in :mod:`flowrl.config_files`; building a typed section from a
mapping (types, ranges, unknown keys) in :mod:`flowrl.config_fields`.

A config file is a diff against the defaults below; the defaults are the embedded job. Every
unknown key or bad value is reported as one :class:`ConfigError` line that names the key, the
file and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from .config_checks import DEFAULT_PROMPTS, validate_rewards, validate_sections
from .config_fields import build_section
from .config_files import ConfigError, UniqueKeyLoader, merge_layers, parse_overrides, read_yaml

__all__ = ["ConfigError", "Config", "UniqueKeyLoader", "load_config", "parse_overrides", "read_yaml", "to_dict"]


def _rng(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False, note: str = ""
) -> dict[str, Any]:
    """Field metadata: the allowed range ``[lo, hi]`` (open ends with ``lo_open`` / ``hi_open``), for each list item.

    ``note`` is appended to the error message (why the bound exists, what is typical).
    """
    return {"lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "note": note}


MAX_SIDE = 16384  # pixels per side of model.resolution; no supported model goes near it
MAX_STEPS = 1000  # sampler.num_steps, train.eval_steps; flow models sample in 1..100 steps
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


@dataclass
class ModelConfig:
    """The model to align (``model``): which weights, their dtype and device, and the sampling geometry."""

    path: str = "flowrl-digits"  # "flowrl-digits" (embedded) or a local diffusers folder
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"  # cpu, cuda, cuda:N or mps (checked against the machine by flowrl.resources.check_machine)
    resolution: int | list[int] | None = field(
        default=None, metadata=_rng(1, MAX_SIDE, note="pixels per side")
    )  # an int (square) or [height, width]; None = the model's default
    num_frames: int | None = field(
        default=None, metadata=_rng(1, 1025)
    )  # video models (Wan: 4k + 1); None = the model's default
    distilled_guidance: float | None = field(
        default=None, metadata=_rng(0, 100)
    )  # FLUX.1-dev guidance embedding; None = model default (3.5); null for schnell


@dataclass
class PromptConfig:
    """Prompt sets and batching (``prompts``): train/eval sources, prompts per iteration and group size."""

    train: str = DEFAULT_PROMPTS  # built-in set, a .txt/.jsonl/.csv/.json file, or a folder (its train.* file)
    eval: str = DEFAULT_PROMPTS  # same; a folder gives its test.* file
    per_iteration: int = field(default=20, metadata=_rng(1, 100_000))  # distinct prompts per iteration
    group_size: int = field(default=8, metadata=_rng(1, 10_000))  # samples per prompt (GRPO group K; 1 with per_prompt)
    test_fraction: float | None = field(
        default=None, metadata=_rng(0, 1, lo_open=True, hi_open=True)
    )  # hold out this share of prompts.train (by prompt hash) as the eval set
    cache_dir: str | None = None  # persistent prompt-embedding cache (<dir>/<model fingerprint>/<sha256>.safetensors)
    negative: str = ""  # negative prompt of true CFG (used when sampler.guidance_scale != 1)


@dataclass
class TreeConfig:
    """Branching tree rollouts (BranchGRPO; flowrl/tree/rollouts.py, docs/trees.md)."""

    split_steps: list[int] = field(
        default_factory=lambda: [0, 3, 6, 9], metadata=_rng(0, MAX_STEPS - 1)
    )  # steps where every node branches
    factors: list[int] = field(
        default_factory=lambda: [2], metadata=_rng(1, 1024)
    )  # children per split: one value, or one per split
    split_noise_scale: float = field(
        default=4.0, metadata=_rng(0, lo_open=True)
    )  # std multiplier at splits (stored density matches)
    fusion: Literal["mean", "softmax"] = "mean"  # inner-node reward: mean of leaves | softmax over child log-probs
    depth_prune: list[int] = field(default_factory=list, metadata=_rng(0, MAX_STEPS))  # child depths not trained
    depth_prune_slide_every: int = field(
        default=0, metadata=_rng(0)
    )  # slide the window 1 depth rootward every N iterations
    depth_prune_stop: int | None = field(
        default=None, metadata=_rng(0, MAX_STEPS)
    )  # the window stops sliding at this depth (None = last split step)
    width_keep: float = field(default=1.0, metadata=_rng(0, 1, lo_open=True))  # share of last-segment edges trained
    width_mode: Literal["best_worst", "per_branch"] = (
        "best_worst"  # per tree: best + worst halves | per last-split node: best children
    )
    # prune only in the first N iterations (None = always)
    prune_until: int | None = field(default=None, metadata=_rng(0))


@dataclass
class SamplerConfig:
    """Rollout sampling (``sampler``): sigma schedule, SDE/solver, guidance, SDE windows and tree rollouts."""

    num_steps: int = field(default=10, metadata=_rng(1, MAX_STEPS))
    schedule: Literal["linear", "shift", "dynamic_shift", "model"] = (
        "linear"  # "model": the pipeline's own grid (FLUX, Qwen-Image)
    )
    shift: float = field(default=1.0, metadata=_rng(0, lo_open=True))
    noise_level: float = field(default=0.7, metadata=_rng(0, 100))  # sampler.sde: cps needs <= 1
    # true CFG weight w (SD3, Wan); 1.0 = no CFG, one pass
    guidance_scale: float = field(default=1.0, metadata=_rng(0, 100))
    sde: Literal["flow", "dance", "cps", "sage"] = "flow"  # SDE step of GRPO-style rollouts (flowrl.samplers.SDE_STEPS)
    # SDE windows for Flow-GRPO (MixGRPO / Flow-GRPO-Fast) and trees (BranchGRPO's mixed ODE/SDE tree, splits stay SDE):
    # noise, storage and training only inside
    window: Literal["none", "random", "progressive", "fixed"] = "none"
    window_size: int = field(default=2, metadata=_rng(1, MAX_STEPS))
    window_start: int = field(default=0, metadata=_rng(0, MAX_STEPS))  # "fixed"
    window_range: list[int] = field(
        default_factory=lambda: [0, 9], metadata=_rng(0, MAX_STEPS)
    )  # "random": window inside [lo, hi)
    window_shift_every: int = field(default=25, metadata=_rng(1))  # "progressive"
    # rollouts of solver-based objectives (DiffusionNFT, AWM); Flow-GRPO always uses the Flow-SDE
    solver: Literal["euler", "heun", "dpmpp_2m", "sde_window", "tree"] = "dpmpp_2m"  # "tree": leaves of sampler.tree
    sde_window: list[float] = field(
        default_factory=lambda: [0.3, 0.9], metadata=_rng(0, 1, note="sigmas lie in [0, 1]")
    )  # sigma range with noise, for "sde_window"
    chunk_size: int = field(default=40, metadata=_rng(1, 100_000))  # rollout micro-batch (also the train micro-batch)
    tree: TreeConfig = field(default_factory=TreeConfig)  # tree rollouts: BranchGRPO, or solver "tree"


@dataclass
class AdvantageConfig:
    """Reward -> advantage normalisation (flowrl/advantages/, built by ``AdvantageEstimator.from_config``)."""

    # weighted sum then GRPO | GDPO | MC-GRPO median | DDPO per-prompt reward history (one sample per prompt)
    method: Literal["sum", "gdpo", "median", "per_prompt"] = "sum"
    std: Literal["global", "group", "none"] = "global"  # sum and median; gdpo and per_prompt use their own std
    clip: float = field(default=5.0, metadata=_rng(0, lo_open=True))
    eps: float = field(default=1e-4, metadata=_rng(0))
    buffer_size: int = field(default=16, metadata=_rng(1))  # per_prompt: last rewards kept per prompt
    # per_prompt: rewards before a prompt's own history is used
    min_count: int = field(default=16, metadata=_rng(1))


def validate_advantage(section: AdvantageConfig, group_size: int, where: str) -> None:
    """Cross-key check of the ``advantage`` section (the per-key ranges are checked on load).

    Args:
        section: the ``advantage`` section.
        group_size: ``prompts.group_size``.
        where: the config source named in errors.

    Raises:
        ConfigError: ``advantage.min_count > advantage.buffer_size``, or a single-sample group with a
            group-relative method.
    """
    if group_size < 2 and section.method != "per_prompt":
        raise ConfigError(
            f"{where}: 'prompts.group_size' must be >= 2 for advantage.method={section.method} (group-relative); "
            "got 1. Raise it, or set advantage.method=per_prompt (DDPO's per-prompt history)"
        )
    if section.min_count > section.buffer_size:
        raise ConfigError(
            f"{where}: 'advantage.min_count' must be <= 'advantage.buffer_size' ({section.buffer_size}); "
            f"got {section.min_count}. Lower min_count or raise buffer_size"
        )


def _default_objective() -> dict[str, Any]:
    # the objective's own dataclass holds its defaults; the embedded job adds a KL guard
    return {"name": "flow_grpo", "kl_beta": 0.004}  # per-step kernel KL: 0.04 on s^2 before (docs/alignment.md)


@dataclass
class MemoryConfig:
    """GPU memory controls (flowrl/policy/memory.py); all off by default."""

    gradient_checkpointing: bool = False
    autocast: Literal["none", "bf16", "fp16"] = "none"  # around the denoiser only; log-probs stay fp32
    vae_tiling: bool = False
    vae_slicing: bool = False
    offload_encoders: bool = False  # text encoders on the CPU outside prompt encoding
    offload_vae: bool = False  # VAE on the CPU outside decoding
    free_encoders_when_cached: bool = False  # encode every train/eval prompt once, then drop the encoders
    attention_backend: Literal["sdpa", "xformers"] = "sdpa"  # xformers: CUDA + `pip install xformers`
    # torch.compile the denoiser; cudagraphs (CUDA only): CUDA graphs of the eager kernels, seconds to trace
    compile: Literal["none", "default", "reduce-overhead", "max-autotune", "cudagraphs"] = "none"
    compile_scope: Literal["model", "blocks"] = "model"  # blocks: each repeated block; a block class compiles once


@dataclass
class LoraConfig:
    """LoRA adapter of the trained denoiser (``lora``): rank, alpha and target modules."""

    rank: int = field(
        default=8, metadata=_rng(1, 1024, note="LoRA ranks of 4-128 are usual; above 1024 it is no longer low-rank")
    )
    alpha: float = field(default=16.0, metadata=_rng(0, lo_open=True))
    targets: list[str] | None = None  # None = the model adapter's defaults


@dataclass
class OptimConfig:
    """AdamW optimizer of the LoRA weights (``optim``), with gradient-norm clipping."""

    lr: float = field(default=1e-3, metadata=_rng(0, 1, lo_open=True))
    weight_decay: float = field(default=1e-4, metadata=_rng(0, 1))  # decoupled: each step scales weights by 1 - lr * wd
    beta1: float = field(default=0.9, metadata=_rng(0, 1))  # < 1 as well (checked with the section)
    beta2: float = field(default=0.999, metadata=_rng(0, 1))
    eps: float = field(default=1e-8, metadata=_rng(0, 1, lo_open=True))
    max_grad_norm: float = field(default=1.0, metadata=_rng(0, lo_open=True))


@dataclass
class TrainConfig:
    """Training loop (``train``): iterations and time budget, seed, threads, eval/save cadence, async scoring."""

    iterations: int = field(default=70, metadata=_rng(1))
    time_budget_s: float | None = field(default=None, metadata=_rng(0, lo_open=True))  # stop early after this many s
    seed: int = field(default=0, metadata=_rng(0, MAX_SEED))
    # torch intra-op threads; None = 1 on <= 2 cores, else cores // 2 (at most 4 x the cores, checked on the machine)
    threads: int | None = field(default=None, metadata=_rng(1, 1024))
    eval_every: int = field(default=10, metadata=_rng(1))
    eval_seeds: int = field(default=4, metadata=_rng(1, 10_000))  # held-out seeds per eval prompt
    eval_steps: int | None = field(
        default=None, metadata=_rng(1, MAX_STEPS)
    )  # Euler ODE steps of evaluation; None = sampler.num_steps
    save_every: int = field(default=50, metadata=_rng(1))
    progress: bool = True
    # decode + score rollout chunk k while chunk k+1 samples (bit-identical results): false | true (= "thread")
    # | "thread" | "process" (a spawned worker process: overlaps even when sampling and scoring are Python-bound,
    # as on a CPU)
    rewards_async: bool | Literal["thread", "process"] = False
    # rows per decode + score call; null = sampler.chunk_size. Smaller pieces let the trainer score the
    # last chunk together with the worker (async modes), which shortens the part of scoring that can't overlap
    score_chunk_size: int | None = field(default=None, metadata=_rng(1, 100_000))
    # update guards: an update whose rewards, advantages, loss, gradients or new LoRA weights are non-finite or
    # exploding is skipped (weights and optimizer state restored) and counted; the run stops after this many
    # consecutive skips, naming the first bad quantity
    max_skipped_updates: int = field(default=3, metadata=_rng(1))
    max_abs_reward: float = field(default=1e6, metadata=_rng(0, lo_open=True))  # |total reward| above it: exploding
    max_lora_weight: float = field(default=1e3, metadata=_rng(0, lo_open=True))  # |LoRA weight| above it: exploding
    # several processes (accelerate launch): which samples of the global batch each rank owns (flowrl/distributed.py):
    # contiguous = whole prompt groups per rank | spread = every group split over the ranks
    placement: Literal["contiguous", "spread"] = "contiguous"
    # several processes: none = every rank holds the whole denoiser | fsdp2 = its base and LoRA sharded over the
    # ranks (flowrl/sharding.py; implied by an accelerate FSDP launch) | zero1 = DeepSpeed ZeRO-1 (LoRA's AdamW
    # state sharded) | zero2 = ZeRO-2 (its gradients too) | zero3 = ZeRO-3 (base and LoRA too; flowrl/zero.py;
    # implied by a DeepSpeed launch)
    sharding: Literal["none", "fsdp2", "zero1", "zero2", "zero3"] = "none"
    # several processes: how long a rank waits in a collective for the others (torch's NCCL default is 10 min,
    # shorter than rank 0's evaluation and checkpoint of a large model, which the other ranks wait for)
    collective_timeout_s: float = field(default=3600.0, metadata=_rng(0, lo_open=True))


@dataclass
class OutputConfig:
    """Run outputs (``output``): the run folder, the before/after grid columns and the checkpoints kept."""

    dir: str = "runs/digits-bold-thin"
    grid_seeds: int = field(default=4, metadata=_rng(1, 256))  # columns per prompt in the before/after grid
    keep_checkpoints: int = field(default=3, metadata=_rng(1))  # newest checkpoints/iter-N kept; older ones deleted
    # the held-out evaluation's samples as an image grid (TensorBoard, wandb, samples/iter-N.png) every N
    # iterations; None = at every evaluation (train.eval_every), 0 = never; a multiple of train.eval_every
    image_every: int | None = field(default=None, metadata=_rng(0))
    wandb: bool = False  # also log to Weights & Biases (`pip install wandb`; never required); TensorBoard always
    wandb_project: str = "flowrl"


@dataclass
class SolRLConfig:
    """Sol-RL rollouts (``solrl``; flowrl/solrl/, docs/solrl.md): explore cheaply, train at full precision.

    ``regenerate``: per prompt, ``candidates`` seeds sampled by a low-precision explore copy of the
    sampling policy with ``explore_steps`` deterministic steps, scored; ``selection`` keeps
    ``prompts.group_size`` of them, regenerated at full precision through the normal rollout
    (solver objectives: DiffusionNFT, AWM). ``correct``: SDE rollouts sampled by the explore copy,
    trained with truncated importance weights (Flow-GRPO, SAGE-GRPO).
    """

    mode: Literal["off", "regenerate", "correct"] = "off"
    precision: Literal["fp32", "bf16", "nvfp4", "fp8_e4m3", "int8_dynamic", "native_nvfp4"] = "nvfp4"
    activations: bool = False  # nvfp4 / fp8_e4m3: quantise the quantised layers' inputs too (W4A4 / W8A8)
    fp8_scaling: Literal["tensor", "row"] = "row"  # fp8_e4m3: amax scales per row (H100: 0.91x bf16 vs 0.75x)
    fp8_fast_accum: bool = False  # fp8_e4m3 on torch._scaled_mm (CUDA): the tensor cores' fast accumulator
    min_features: int = field(default=0, metadata=_rng(0))  # layers with max(in, out) <= this stay full precision
    candidates: int = field(default=16, metadata=_rng(1, 100_000))  # N explored seeds per prompt (Sol-RL: 96)
    explore_steps: int = field(default=6, metadata=_rng(1, MAX_STEPS))  # deterministic explore steps (Sol-RL: 6)
    explore_solver: Literal["euler", "heun", "dpmpp_2m"] = "dpmpp_2m"
    selection: Literal["best_worst", "max_variance", "mean_deviation", "random"] = "best_worst"
    seed: int | None = field(default=None, metadata=_rng(0, MAX_SEED))  # candidate seeds; None = train.seed
    is_clip: float = field(default=2.0, metadata=_rng(1))  # correct: truncation C of min(p_full / p_explore, C)


_SOLRL_MODE_KEYS = {
    "regenerate": ("candidates", "explore_steps", "explore_solver", "selection", "seed"),
    "correct": ("is_clip",),
}
"""The ``solrl`` keys only one mode reads (the others, precision and its options, serve both)."""


def unused_solrl_line(s: SolRLConfig) -> str | None:
    """The warning for ``solrl`` keys set away from their defaults that the chosen mode never reads, or None.

    With ``solrl.mode: off`` every other key is unused (a file that forgot the mode trains plain single
    stage), ``correct`` reads no candidate pool and ``regenerate`` no importance-weight clip. A warning,
    not an error: switching a Sol-RL file off (``solrl.mode=off``) is how its single-stage baseline runs.
    """
    defaults = SolRLConfig()
    unused = [f.name for f in dataclasses.fields(s) if f.name != "mode"]
    if s.mode != "off":
        unused = [k for mode, keys in _SOLRL_MODE_KEYS.items() if mode != s.mode for k in keys]
    changed = [f"solrl.{k}={getattr(s, k)}" for k in unused if getattr(s, k) != getattr(defaults, k)]
    if not changed:
        return None
    if s.mode == "off":
        return (
            f"solrl.mode=off, so {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not read and this run "
            "trains single-stage; set solrl.mode=regenerate (solver objectives) or correct (SDE objectives) to use them"
        )
    return f"solrl.mode={s.mode} does not read {', '.join(changed)} (docs/solrl.md)"


def unread_key_lines(cfg: Config) -> list[str]:
    """Warnings for keys set away from their defaults that this run never reads (a feature left off).

    Refused combinations fail when the config loads (:func:`validate_rollout_options`, :func:`validate_solrl`);
    these are legal but inert: ``solrl`` keys the mode does not read (:func:`unused_solrl_line`),
    ``sampler.solver`` with Flow-SDE or tree rollouts, ``sampler.tree`` without trees, and
    ``prompts.negative`` without true CFG (``sampler.guidance_scale: 1``).

    Returns:
        One line per inert key group, for ``flowrl: warning:`` (``flowrl train`` and ``--check``).
    """
    from .objectives import OBJECTIVES

    s, name = cfg.sampler, cfg.objective["name"]
    rollout = OBJECTIVES[name](**cfg.objective).rollout
    lines = [line] if (line := unused_solrl_line(cfg.solrl)) is not None else []
    if rollout != "solver" and s.solver != SamplerConfig.solver:
        lines.append(
            f"sampler.solver={s.solver} is not read: objective.name={name} samples its rollouts on the Flow-SDE "
            "(sampler.sde); drop it"
        )
    grows_trees = rollout == "tree" or s.solver == "tree"
    tree = [f.name for f in dataclasses.fields(s.tree) if getattr(s.tree, f.name) != getattr(TreeConfig(), f.name)]
    if tree and not grows_trees:
        lines.append(
            f"sampler.tree.{tree[0]} is not read: only tree rollouts grow trees (objective.name=branch_grpo, "
            "sage_grpo with objective.tree=true, or sampler.solver=tree for diffusion_nft / awm); drop it"
        )
    if cfg.prompts.negative and s.guidance_scale == 1:
        lines.append(
            "prompts.negative is not read: the negative prompt is true CFG's, used when sampler.guidance_scale != 1"
        )
    return lines


def validate_solrl(cfg: Config, where: str) -> None:
    """Cross-key checks of the ``solrl`` section against the objective, the sampler and the batch.

    Raises:
        ConfigError: one line naming the keys and the fix.
    """
    s = cfg.solrl
    if s.mode == "off":
        return
    from .objectives import OBJECTIVES

    objective = cfg.objective["name"]
    rollout = OBJECTIVES[objective](**cfg.objective).rollout
    k = cfg.prompts.group_size
    if s.mode == "regenerate" and rollout != "solver":
        raise ConfigError(
            f"{where}: solrl.mode=regenerate trains on clean samples (diffusion_nft, awm); objective.name={objective} "
            "trains on stored transitions: use solrl.mode=correct for an SDE objective, or a solver objective"
        )
    if s.mode == "regenerate" and cfg.sampler.solver == "tree":
        raise ConfigError(f"{where}: solrl.mode=regenerate needs one noise per sample; sampler.solver=tree grows trees")
    if s.mode == "regenerate" and k > s.candidates:
        raise ConfigError(
            f"{where}: 'prompts.group_size' (K={k}, the seeds kept per prompt) must be <= 'solrl.candidates' "
            f"(N={s.candidates}); raise solrl.candidates or lower prompts.group_size"
        )
    if s.mode == "correct" and rollout != "sde":
        raise ConfigError(
            f"{where}: solrl.mode=correct reweights stored SDE transitions (flow_grpo, sage_grpo without a tree); "
            f"objective.name={objective} has rollout {rollout!r}: use solrl.mode=regenerate for it"
        )
    if s.activations and s.precision not in ("nvfp4", "fp8_e4m3"):
        raise ConfigError(
            f"{where}: 'solrl.activations' applies to nvfp4 and fp8_e4m3; got solrl.precision={s.precision}"
        )
    if s.fp8_scaling != SolRLConfig.fp8_scaling and s.precision != "fp8_e4m3":
        raise ConfigError(f"{where}: 'solrl.fp8_scaling' applies to fp8_e4m3; got solrl.precision={s.precision}")
    if s.fp8_fast_accum and s.precision != "fp8_e4m3":
        raise ConfigError(
            f"{where}: 'solrl.fp8_fast_accum' applies to fp8_e4m3 on CUDA; got solrl.precision={s.precision}"
        )
    if s.precision == "int8_dynamic" and (cfg.model.device != "cpu" or cfg.model.dtype != "float32"):
        raise ConfigError(
            f"{where}: solrl.precision=int8_dynamic is torch.ao's CPU fp32 path; model is {cfg.model.dtype} on "
            f"{cfg.model.device}: on a CPU set model.dtype=float32; on a GPU use bf16 (fewer explore steps) or fp8_e4m3"
        )


def validate_rollout_options(cfg: Config, where: str) -> None:
    """Refuse sampler keys that make an objective's rollouts ignore them or leave nothing to train.

    DiffusionNFT and AWM sample with ``sampler.solver``; only its ``tree`` leaves use ``sampler.sde`` and
    SDE windows (``sampler.solver: sde_window`` has its own ``sampler.sde_window`` on the Flow-SDE). An
    objective trained on stored SDE transitions or tree edges has none with a density at
    ``sampler.noise_level: 0``: every iteration would plan no optimizer step.

    Raises:
        ConfigError: ``sampler.window`` or a ``sampler.sde`` other than flow with such rollouts, or
            ``sampler.noise_level: 0`` for an SDE or tree objective (one line: the fix).
    """
    from .objectives import OBJECTIVES

    s, name = cfg.sampler, cfg.objective["name"]
    rollout = OBJECTIVES[name](**cfg.objective).rollout
    if rollout != "solver" and s.noise_level == 0:
        raise ConfigError(
            f"{where}: 'sampler.noise_level' is 0: objective.name={name} trains on stochastic rollout steps and "
            "every step would be deterministic, so nothing would train; set it > 0 (e.g. 0.7)"
        )
    if rollout != "solver" or s.solver == "tree":
        return
    if s.window != "none":
        raise ConfigError(
            f"{where}: 'sampler.window' ({s.window}) applies to SDE and tree rollouts; objective.name={name} samples "
            f"with sampler.solver={s.solver}: for a noise window use sampler.solver=sde_window (sampler.sde_window)"
        )
    if s.sde != "flow":
        raise ConfigError(
            f"{where}: 'sampler.sde' ({s.sde}) applies to SDE and tree rollouts; objective.name={name} samples with "
            f"sampler.solver={s.solver} (sde_window steps the Flow-SDE): remove sampler.sde or use sampler.solver=tree"
        )


def _default_rewards() -> dict[str, dict[str, Any]]:
    # the style scored on the real digits' ink band (rewards/ink_band.py): the plain ``ink`` ("more is better")
    # is won by blotting and fading (docs/alignment.md)
    return {"ink_band": {"weight": 1.0}, "digit_correctness": {"weight": 0.5}}


@dataclass
class Config:
    """The whole run configuration; its defaults are the embedded bold/thin alignment job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    rewards: dict[str, dict[str, Any]] = field(default_factory=_default_rewards)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    objective: dict[str, Any] = field(default_factory=_default_objective)  # validated per objective
    lora: LoraConfig = field(default_factory=LoraConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # reward-hacking guards: name -> {tolerance, relative, on_trip, **reward options}; scored on the held-out
    # evaluation, never trained on (flowrl/evaluation/guard_rewards.py, docs/alignment.md)
    guards: dict[str, dict[str, Any]] = field(default_factory=dict)
    solrl: SolRLConfig = field(default_factory=SolRLConfig)  # Sol-RL two-stage / corrected rollouts


def _read_layers(paths: list[str | Path]) -> dict[str, Any]:
    """Merge YAML files left to right; each is checked on its own first, so errors name its file.

    A later file's ``rewards`` section replaces the earlier one whole (as a file's rewards replace
    the defaults); every other section is merged key by key (presets stack on a model config).
    """
    data: dict[str, Any] = {}
    for path in paths:
        layer = read_yaml(path)
        if not isinstance(layer.get("rewards", {}), dict):
            raise ConfigError(f"{path}: 'rewards' must be a mapping of reward name -> options")
        build_section(Config, {k: v for k, v in layer.items() if k != "rewards"}, "", str(path))
        rewards = layer.pop("rewards", None)
        data = merge_layers(data, layer)
        if rewards is not None:
            data["rewards"] = rewards
    return data


def load_config(path: str | Path | Sequence[str | Path] | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file(s) in order, then ``key=value`` overrides, validated.

    Args:
        path: a YAML file, several (e.g. a model config then a GPU preset), or None for the
            embedded default job.
        overrides: dotted ``key=value`` strings.

    Returns:
        A validated :class:`Config`.

    Raises:
        ConfigError: one line naming the key, the file and what is allowed.
    """
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    where = " + ".join(str(p) for p in paths) if paths else "default config"
    data = _read_layers(paths)
    data.setdefault("rewards", _default_rewards())  # a file's rewards replace the defaults whole
    if overrides:
        extra = parse_overrides(overrides)
        data = merge_layers(data, extra)
        where = f"{where} + command line"
    cfg = build_section(Config, data, "", where)
    validate_rewards(cfg.rewards, where)
    validate_sections(cfg, where)
    validate_advantage(cfg.advantage, cfg.prompts.group_size, where)
    cfg.objective = validate_objective(cfg.objective, where)
    validate_guards(cfg, where)
    validate_solrl(cfg, where)
    validate_rollout_options(cfg, where)
    return cfg


def validate_guards(cfg: Config, where: str) -> None:
    """Check the ``guards`` section (:func:`flowrl.guard_spec.parse_guards`) and ``output.image_every``.

    Raises:
        ConfigError: one line naming the key and the fix.
    """
    from .guard_spec import parse_guards

    try:
        specs = parse_guards(cfg.guards, cfg.rewards)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if any(s.name == "diversity" for s in specs) and cfg.train.eval_seeds < 2:
        raise ConfigError(
            f"{where}: guards.diversity needs 'train.eval_seeds' >= 2 (pairs of samples per prompt); "
            f"got {cfg.train.eval_seeds}"
        )
    every = cfg.output.image_every
    if every and every % cfg.train.eval_every:
        raise ConfigError(
            f"{where}: 'output.image_every' ({every}) must be a multiple of 'train.eval_every' "
            f"({cfg.train.eval_every}): the images are the held-out evaluation's samples"
        )


def validate_objective(section: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the ``objective`` section against the chosen objective's own fields."""
    from .objectives import OBJECTIVES

    name = section.get("name", "flow_grpo")
    if not isinstance(name, str) or name not in OBJECTIVES:
        raise ConfigError(f"{where}: 'objective.name' must be one of {', '.join(map(repr, OBJECTIVES))}; got {name!r}")
    try:
        built = build_section(OBJECTIVES[name], {**section, "name": name}, "objective.", where)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (for the resolved config file)."""
    return dataclasses.asdict(cfg)
