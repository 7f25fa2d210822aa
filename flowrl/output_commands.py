"""The ``flowrl`` commands that read or write models and images: sample, export, eval, gallery, demo, pretrain-digits.

:mod:`flowrl.cli` parses the command line and dispatches here; user errors raise ``ValueError`` /
``FileNotFoundError`` / ``FileExistsError`` with one line naming the fix.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from .config_files import split_config_args


def _check_sample_args(ns: argparse.Namespace) -> None:
    """Refuse ``flowrl sample`` arguments that cannot work, naming the flag and the fix.

    Raises:
        ValueError: ``--seeds``, ``--steps`` or ``--seed`` out of range
            (:func:`~flowrl.resources.check_sampling_flags`), ``--out`` a folder or a name not ending ``.png``,
            or a place that cannot be written (:func:`~flowrl.outputs.check_writable_place`).
    """
    from .outputs import check_writable_place
    from .resources import check_sampling_flags

    check_sampling_flags(ns.seeds, ns.steps, ns.seed)
    out = Path(ns.out)
    check_writable_place(out)
    if out.is_dir() or str(ns.out).endswith(("/", os.sep)):  # Path() drops the slash of a folder not made yet
        raise ValueError(f"--out {ns.out} is a folder; name a PNG file, e.g. --out {out / 'samples.png'}")
    if out.suffix and out.suffix.lower() != ".png":
        raise ValueError(
            f"--out {ns.out}: flowrl sample writes a PNG grid; name a .png file, e.g. --out {out.with_suffix('.png')}"
        )


def cmd_sample(ns: argparse.Namespace) -> int:
    """``flowrl sample``: sample ``ns.seeds`` images per prompt (optionally with a LoRA) and save a PNG grid.

    Args:
        ns: parsed arguments (``args``, ``lora``, ``prompt``, ``seeds``, ``seed``, ``steps``, ``out``,
            ``overwrite``).

    Returns:
        The exit code, 0.

    Raises:
        ValueError: ``--seeds``, ``--steps`` or ``--seed`` out of range, more work than
            :data:`~flowrl.resources.MAX_SAMPLE_STEPS`, or ``--out`` a folder or a non-PNG file name.
        FileExistsError: ``--out`` exists and ``--overwrite`` was not given.
    """
    import torch

    from .config import load_config
    from .export import run_config_file
    from .outputs import image_grid, save_png
    from .policy import build_policy
    from .prompts.sets import load_prompts
    from .resources import check_machine, check_sampling_work
    from .rollouts.chunked import sample_images
    from .runtime import configure_threads

    _check_sample_args(ns)
    config, overrides = split_config_args(ns.args)
    run_config = run_config_file(ns.lora) if config is None and ns.lora is not None else None
    if run_config is not None:
        config = [str(run_config)]  # the run's own model, guidance and sigma grid; overrides on top
    cfg = load_config(config, overrides)
    check_machine(cfg, training=False)
    configure_threads(cfg.train.threads)
    texts = ns.prompt or [p.text for p in load_prompts(cfg.prompts.eval, split="test")]
    steps = ns.steps or cfg.train.eval_steps or cfg.sampler.num_steps
    check_sampling_work(len(texts) * ns.seeds, steps, f"{len(texts)} prompts x --seeds {ns.seeds}")
    if Path(ns.out).exists() and not ns.overwrite:  # last of the checks: a grid is never replaced unasked
        raise FileExistsError(f"--out {ns.out} already exists; pass --overwrite to replace it, or name another file")
    policy = build_policy(cfg, lora=ns.lora)  # the guidance, memory settings and sigma grid training used
    prompts = [t for t in texts for _ in range(ns.seeds)]
    seeds = [ns.seed + j for _ in texts for j in range(ns.seeds)]
    sigmas = policy.sigmas(steps)  # the run's evaluation grid, as its own samples, flowrl eval, gallery and demo use it
    with torch.no_grad():
        images = sample_images(
            policy.model, prompts, seeds, sigmas, resolution=policy.resolution, frames=cfg.model.num_frames
        )
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_png(image_grid(images, len(texts), scale=max(1, 64 // policy.resolution[0])), out)
    print(f"wrote {len(prompts)} samples ({len(texts)} prompts x {ns.seeds} seeds) to {out}")
    return 0


def _out_folder(out: str, example: str, writes: tuple[str, ...] = (), overwrite: bool = True) -> Path:
    """The ``--out`` folder of a command that writes several files, checked before any work starts.

    Args:
        out: the ``--out`` value.
        example: a folder name to suggest instead of a file.
        writes: the files the command writes into the folder (checked only when ``overwrite`` is false).
        overwrite: whether the command may replace those files (its ``--overwrite``).

    Returns:
        ``out`` as a path.

    Raises:
        ValueError: ``out`` is an existing file, or a place that cannot be written
            (:func:`~flowrl.outputs.check_writable_place`).
        FileExistsError: ``out`` already holds one of ``writes`` and ``overwrite`` is false.
    """
    from .outputs import check_writable_place

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder to write into, e.g. --out {path.parent / example}")
    check_writable_place(path)
    held = [name for name in writes if (path / name).exists()]
    if held and not overwrite:
        raise FileExistsError(
            f"--out {out} already holds {', '.join(held)} of an earlier run; pass --overwrite to replace "
            "them, or name another folder"
        )
    return path


def cmd_export(ns: argparse.Namespace) -> int:
    """``flowrl export --merge``: write the base model with the trained LoRA fused in, as a diffusers folder.

    Args:
        ns: parsed arguments (``merge``, ``out``, ``base``, ``dtype``, ``overwrite``).

    Returns:
        The exit code, 0.

    Raises:
        ValueError: ``--merge`` is missing, or ``--out`` is a file.
    """
    from .export import export_merged

    if not ns.merge:
        raise ValueError(
            "flowrl export needs --merge RUN_OR_LORA (the only export kind: base + LoRA fused, diffusers format)"
        )
    out = export_merged(ns.merge, _out_folder(ns.out, "merged"), base=ns.base, dtype=ns.dtype, overwrite=ns.overwrite)
    print(
        f"wrote merged diffusers model to {out}; "
        f"load it with {_pipeline_class(out)}.from_pretrained({str(out)!r}) or model.path={out}"
    )
    return 0


def _pipeline_class(folder: Path) -> str:
    """The diffusers pipeline class a model folder names in its ``model_index.json`` (``DiffusionPipeline`` if none)."""
    import json

    try:
        return str(json.loads((Path(folder) / "model_index.json").read_text())["_class_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return "DiffusionPipeline"


def cmd_pretrain_digits(ns: argparse.Namespace) -> int:
    """``flowrl pretrain-digits``: rebuild the embedded digits model (its own parser reads ``ns.args``).

    Args:
        ns: parsed arguments (``args``: the raw arguments after the subcommand).

    Returns:
        The exit code of the pretraining script.
    """
    from .models.digits.pretrain import main as pretrain_main

    return pretrain_main(ns.args)


def cmd_eval(ns: argparse.Namespace) -> int:
    """``flowrl eval``: score the runs' checkpoints and the base model on a prompt set (fixed seeds, ODE).

    Args:
        ns: parsed arguments (``runs``, ``prompts``, ``rewards``, ``seeds``, ``seed``, ``steps``, ``out``,
            ``overwrite``).

    Returns:
        The exit code, 0.

    Raises:
        FileExistsError: ``--out`` already holds ``eval.json`` or ``eval.md`` and ``--overwrite`` was not given.
    """
    from .comparison.checkpoints import CheckpointBank
    from .comparison.evaluate import (
        EVAL_FILES,
        EvalSettings,
        checkpoints_of,
        eval_meta,
        evaluate_checkpoints,
        guard_spec,
        reward_spec,
        write_report,
    )
    from .prompts.sets import load_prompts
    from .runtime import configure_threads

    out = _out_folder(ns.out, "eval", EVAL_FILES, ns.overwrite)
    configure_threads(None)
    runs = [Path(r) for r in ns.runs]
    prompts = load_prompts(ns.prompts, split="test")
    names = [n.strip() for n in ns.rewards.split(",") if n.strip()] if ns.rewards else None
    rewards = reward_spec(runs, names)
    settings = EvalSettings(seeds=ns.seeds, first_seed=ns.seed, steps=ns.steps)
    rows = evaluate_checkpoints(CheckpointBank(), checkpoints_of(runs), prompts, rewards, guard_spec(runs), settings)
    paths = write_report(rows, out, eval_meta(runs, ns.prompts, len(prompts), settings, rewards))
    print((out / "eval.md").read_text(), end="")
    print(f"wrote {', '.join(map(str, paths))}")
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    """``flowrl demo``: serve the Gradio comparison app (127.0.0.1 unless ``--host``; ``--share`` is opt-in).

    Args:
        ns: parsed arguments (``runs``, ``host``, ``port``, ``share``, ``device``).

    Returns:
        The exit code, 0 (after the server stops).
    """
    from .comparison.checkpoints import CheckpointBank
    from .demo.app import build_app, check_port, launch
    from .demo.registry import RunRegistry
    from .runtime import configure_threads

    check_port(ns.port)
    if ns.device is not None:  # every model's device: a typo or a missing GPU fails here, not at the first Generate
        from .config_checks import check_device_string
        from .resources import check_device

        check_device_string(ns.device, "--device", "flowrl demo")
        check_device(ns.device, "--device")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # started with `&`, SIGINT comes ignored: Ctrl-C stops
    configure_threads(None)
    registry = RunRegistry(ns.runs)
    app = build_app(registry, CheckpointBank(device=ns.device))
    print(f"flowrl demo: {len(registry.labels)} checkpoints ({', '.join(registry.labels)}); Ctrl-C stops", flush=True)
    launch(app, host=ns.host, port=ns.port, share=ns.share)
    return 0


def cmd_gallery(ns: argparse.Namespace) -> int:
    """``flowrl gallery``: regenerate the README images (before/after grids, reward curves, algorithm plots).

    Args:
        ns: parsed arguments (``runs``, ``out``, ``benchmarks``, ``seeds``, ``prompts``, ``steps``).

    Returns:
        The exit code, 0.
    """
    from .demo.gallery import DEFAULT_BENCHMARKS, build_gallery
    from .runtime import configure_threads

    out = _out_folder(ns.out, "gallery")
    configure_threads(None)
    benchmarks = ns.benchmarks if ns.benchmarks is not None else [p for p in DEFAULT_BENCHMARKS if Path(p).is_file()]
    written = build_gallery(
        [Path(r) for r in ns.runs],
        out,
        benchmarks=[Path(b) for b in benchmarks],
        seeds=ns.seeds,
        prompts=ns.prompts,
        steps=ns.steps,
    )
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1024:.1f} KB)")
    return 0
