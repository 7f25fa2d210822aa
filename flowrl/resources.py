"""Machine checks before a run starts: devices that exist, thread counts, work and memory.

:func:`check_machine` runs before any model is built (``flowrl train``, ``flowrl train --check``,
``flowrl sample``). A config file stays loadable on any machine (:func:`flowrl.config.load_config`
checks only what does not depend on the machine); this module compares it with the machine at
hand and refuses, in one line, what cannot run here. The memory estimate itself, and what it
counts, is :mod:`flowrl.memory_estimate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .distributed import launch_world_size, local_world_size
from .memory_estimate import Estimate, estimate_memory, human_bytes, prompt_counts, sample_sizes, stage1_candidates
from .models.geometry import Geometry, model_folder, read_geometry
from .runtime import check_threads

if TYPE_CHECKING:
    from .config import Config

MAX_SAMPLE_STEPS = 10**7
"""Most samples x denoising steps one iteration (or one evaluation) may take: far beyond any real run,
low enough that an absurd size is refused instead of running for days."""


# -- sampling commands (flowrl sample / eval / gallery) ------------------------------------------


def check_sampling_flags(seeds: int, steps: int | None, first_seed: int | None = None) -> None:
    """Refuse ``--seeds``, ``--steps`` or ``--seed`` values a sampling command cannot use, naming the flag.

    ``--steps`` has the config's cap (``sampler.num_steps``, :data:`flowrl.config.MAX_STEPS`); the
    seeds ``--seed .. --seed + --seeds - 1`` must be valid ``torch.Generator`` seeds, as ``train.seed``.

    Raises:
        ValueError: one line naming the flag, the allowed range and the value.
    """
    from .config import MAX_SEED, MAX_STEPS

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1; got {seeds}")
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"--steps must be in [1, {MAX_STEPS}] (as sampler.num_steps); got {steps}")
    if first_seed is not None and not 0 <= first_seed <= MAX_SEED - seeds + 1:
        raise ValueError(
            f"--seed must be in [0, {MAX_SEED - seeds + 1}] (the seeds run from --seed to --seed + --seeds - 1); "
            f"got {first_seed}"
        )


def check_sampling_work(samples: int, steps: int, what: str) -> None:
    """Refuse a sampling command whose samples x steps is above :data:`MAX_SAMPLE_STEPS` (days of work).

    Args:
        samples: images the command samples in all.
        steps: denoising steps per image.
        what: how ``samples`` is made up, e.g. ``"3 prompts x --seeds 8"``.

    Raises:
        ValueError: one line with the product, the limit and the flags to lower.
    """
    if samples * steps > MAX_SAMPLE_STEPS:
        raise ValueError(
            f"{what} = {samples:,} samples x {steps} steps = {samples * steps:,} model evaluations is above the "
            f"limit of {MAX_SAMPLE_STEPS:,}; lower --seeds, --steps or the number of prompts"
        )


# -- devices and threads ----------------------------------------------------------------------


def check_device(device: str, key: str) -> None:
    """Refuse a device this machine does not have.

    Args:
        device: a device string whose spelling the config already checked (cpu, cuda, cuda:N, mps).
        key: the config key, named in the message.

    Raises:
        ValueError: one line naming the device, what the machine has and the setting to use.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{key}={device!r} but this machine has no CUDA device; use {key}=cpu")
        if dev.index is not None and dev.index >= count:
            have = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
            raise ValueError(f"{key}={device!r} but this machine has {count} CUDA device(s) ({have}); use {key}=cuda:0")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{key}={device!r} but this machine has no MPS (Apple GPU) device; use {key}=cpu")
        if dev.index not in (None, 0):
            raise ValueError(f"{key}={device!r} but a machine has one MPS device; use {key}=mps")


def check_devices(cfg: Config) -> None:
    """``model.device`` and every reward's ``device`` option against the machine (:func:`check_device`)."""
    check_device(cfg.model.device, "model.device")
    for name, opts in cfg.rewards.items():
        if isinstance(opts, dict) and isinstance(opts.get("device"), str):
            check_device(opts["device"], f"rewards.{name}.device")


def check_memory(est: Estimate) -> None:
    """Refuse a run whose estimated peak exceeds what its pool has available.

    Raises:
        ValueError: one line with the estimate, the largest part, what is available and what to lower.
    """
    device_pool = "device" if "device" in est.need else "host"
    for pool, need in est.need.items():
        free = est.available.get(pool)
        if free is None or need <= free:
            continue
        parts = [p for p in est.parts if (device_pool if p.on_device else "host") == pool]
        top = max(parts, key=lambda p: p.nbytes)
        where = f"GPU memory on {est.device}" if pool == "device" else "host memory"
        shared = est.shared(pool)
        each = f"{shared}; " if shared else ""
        fix = f"{top.fix}, or launch fewer processes" if shared else top.fix
        raise ValueError(
            f"the run needs ~{human_bytes(need)} of {where} ({each}largest part: {top.name}, "
            f"~{human_bytes(top.nbytes)}), but this machine has {human_bytes(free)} available; {fix}"
        )


def check_resolution(cfg: Config, g: Geometry) -> None:
    """Refuse a resolution beyond what the transformer's position embedding covers.

    Raises:
        ValueError: one line with the largest side the model takes.
    """
    z = sample_sizes(cfg, g)
    if g.max_side is not None and max(z.height, z.width) > g.max_side:
        raise ValueError(
            f"model.resolution={z.height}x{z.width} is larger than {cfg.model.path} covers (at most {g.max_side} "
            f"pixels per side: its transformer's pos_embed_max_size); lower model.resolution"
        )


def check_work(cfg: Config, eval_prompts: int, processes: int = 1) -> None:
    """Refuse sizes that would run for days rather than run out of memory (:data:`MAX_SAMPLE_STEPS`).

    Raises:
        ValueError: one line naming the product and the keys to lower.
    """
    p, s, t = cfg.prompts, cfg.sampler, cfg.train
    rows = [
        (
            -(-p.per_iteration * p.group_size // processes) * s.num_steps,
            f"one iteration (prompts.per_iteration={p.per_iteration} x prompts.group_size={p.group_size} x "
            f"sampler.num_steps={s.num_steps}{f' / {processes} processes' if processes > 1 else ''})",
            "prompts.per_iteration, prompts.group_size or sampler.num_steps",
        ),
        (
            eval_prompts * t.eval_seeds * (t.eval_steps or s.num_steps),
            f"one evaluation ({eval_prompts} prompts x train.eval_seeds={t.eval_seeds} x "
            f"{t.eval_steps or s.num_steps} steps)",
            "train.eval_seeds or train.eval_steps",
        ),
    ]
    if cfg.solrl.mode == "regenerate":  # Sol-RL stage 1, before the iteration's own rollout
        o = cfg.solrl
        rows.append(
            (
                stage1_candidates(cfg, processes) * o.explore_steps,
                f"Sol-RL stage 1 of one iteration (prompts.per_iteration={p.per_iteration} x "
                f"solrl.candidates={o.candidates} x solrl.explore_steps={o.explore_steps}"
                f"{f' / {processes} processes' if processes > 1 else ''})",
                "solrl.candidates, solrl.explore_steps or prompts.per_iteration",
            )
        )
    for steps, what, keys in rows:
        if steps > MAX_SAMPLE_STEPS:
            raise ValueError(
                f"{what} is {steps:,} sample-steps, above the limit of {MAX_SAMPLE_STEPS:,} (days of compute); "
                f"lower {keys}"
            )


def check_explore_precision(cfg: Config, processes: int = 1) -> None:
    """Refuse a Sol-RL setting this machine or launch cannot run, before the model loads.

    A ``solrl.precision`` this device or ``model.dtype`` cannot run, ``solrl.fp8_fast_accum`` where FP8
    is emulated, and ``solrl.mode=correct`` on several processes (it runs on one;
    :class:`flowrl.solrl.pipeline.SolRL` refuses it again).

    Raises:
        ValueError: one line naming the ``solrl`` key and the fix.
    """
    if cfg.solrl.mode == "off":
        return
    if cfg.solrl.mode == "correct" and processes > 1:
        raise ValueError(
            f"solrl.mode=correct runs on one process, not {processes}; launch one process (--processes 1), "
            "or use solrl.mode=regenerate with a solver objective"
        )
    import torch

    from .policy.precision import check_explore_device

    dtype = getattr(torch, cfg.model.dtype)
    try:
        emulate = check_explore_device(
            cfg.solrl.precision, torch.device(cfg.model.device), dtype, activations=cfg.solrl.activations
        )
    except ValueError as err:
        raise ValueError(f"solrl.precision={cfg.solrl.precision}: {err}") from None
    if cfg.solrl.fp8_fast_accum and emulate:
        raise ValueError(
            f"solrl.fp8_fast_accum=true needs fp8_e4m3 on torch._scaled_mm (a CUDA GPU); model.device="
            f"{cfg.model.device} emulates FP8; set solrl.fp8_fast_accum=false"
        )


def check_machine(
    cfg: Config, *, training: bool = True, processes: int = 1, host_processes: int = 1
) -> Estimate | None:
    """Check a validated config against this machine before any model is built.

    Devices (``model.device``, ``rewards.<name>.device``), ``train.threads``, the precision (no fp16 training;
    a ``solrl.precision`` the device runs) and the work of one iteration and one evaluation (training only),
    and the memory estimate when the model folder is available locally.

    Args:
        cfg: a validated config (:func:`flowrl.config.load_config`).
        training: ``flowrl train`` (True) or ``flowrl sample`` (False: devices, threads and the
            memory of one sampling chunk).
        processes: processes of the launch sharing each iteration's batch (the work and memory
            checked are one process's share).
        host_processes: those of them on this machine, whose host memory adds up (the launch's check
            before any rank starts passes all of them; a started rank passes 1, since the others may
            already hold theirs and this machine's available memory counts it).

    Returns:
        The memory :class:`Estimate`, or None when the model folder is not available locally.

    Raises:
        ValueError: one line naming the setting, what this machine has and the fix.
        FileNotFoundError: a prompt source that does not exist (training only).
    """
    check_devices(cfg)
    check_threads(cfg.train.threads)
    train_prompts, eval_prompts = prompt_counts(cfg) if training else (0, 0)
    if training:
        from .policy.memory import check_trainable_precision

        check_trainable_precision(cfg.model.dtype, cfg.memory.autocast)
        check_explore_precision(cfg, processes)
        check_work(cfg, eval_prompts, processes)
    folder = model_folder(cfg.model.path)
    geometry = read_geometry(folder, cfg.lora.targets) if folder is not None else None
    if geometry is None:
        return None
    check_resolution(cfg, geometry)
    counts = {"train_prompts": train_prompts, "eval_prompts": eval_prompts}
    est = estimate_memory(
        cfg, geometry, training=training, processes=processes, host_processes=host_processes, **counts
    )
    check_memory(est)
    return est


def check_report(cfg: Config, processes: int | None = None) -> str:
    """:func:`check_machine` for ``flowrl train --check``: the one line printed when the config fits this machine.

    Args:
        cfg: the run config.
        processes: estimate one process's share of a launch of this many on this machine
            (``train.sharding`` splits the denoiser too; the host memory of all of them adds up);
            None = this launch's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (1 outside a launcher).

    Raises:
        ValueError: as :func:`check_machine`, or ``processes`` < 1.
    """
    local = local_world_size() if processes is None else processes
    processes = launch_world_size() if processes is None else processes
    if processes < 1:
        raise ValueError(f"--processes must be >= 1; got {processes}")
    from .rewards import check_reward_options

    check_reward_options(cfg.rewards)  # a misspelt option: here, not when the run builds its rewards
    est = check_machine(cfg, processes=processes, host_processes=local)
    if est is None:
        return f"config OK for this machine (model {cfg.model.path!r} is not available locally: memory not estimated)"
    return f"config OK for this machine: {est.summary()}"
