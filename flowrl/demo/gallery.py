"""``flowrl gallery``: regenerate the README's images from run folders and benchmark results.

For each run: ``<run>-before-after.png`` (base | aligned, the run's eval prompts x fixed seeds, ODE),
``<run>-reward-curve.png`` (train and eval reward from ``metrics.jsonl``) and, for video models,
``<run>-frames.png`` (a frame strip, base above aligned). For each benchmark file
(``docs/benchmarks-convergence*.json``): ``algorithms-<name>.png`` (eval reward against wall time
and against compute). Sampling is deterministic (fixed seeds, Euler ODE) and the PNGs carry no
version or time metadata, so the same run and seeds give byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from ..comparison.checkpoints import CheckpointBank, base_checkpoint, run_checkpoints
from ..comparison.evaluate import sample_checkpoint
from .plots import REWARD_KEYS, curves_figure, frame_strip, read_rows, save_figure, upscale

GALLERY_SEED_BASE = 4_000_000
MAX_PROMPTS = 20
DEFAULT_BENCHMARKS = ("docs/benchmarks-convergence.json", "docs/benchmarks-convergence-sage.json")


def _save_png(image: torch.Tensor, path: Path) -> Path:
    """(3, H, W) in [0, 1] -> PNG with no metadata (PIL writes none by default), optimised for size."""
    from .plots import to_pil

    path.parent.mkdir(parents=True, exist_ok=True)
    to_pil(image).save(path, optimize=True)
    return path


def before_after(
    bank: CheckpointBank, run_dir: Path, out: Path, seeds: int = 4, prompts: int = MAX_PROMPTS, steps: int | None = None
) -> list[Path]:
    """The run's base | aligned grid (and frame strip for video) on its first eval prompts and fixed seeds."""
    from ..outputs import image_grid, middle_frame
    from ..prompts.sets import load_prompts

    final = run_checkpoints(run_dir)[0]
    base = base_checkpoint(final.model_path, run_dir)
    cfg = bank.config(final)
    chosen = load_prompts(cfg.prompts.eval, split="test")[:prompts]
    texts = [p.text for p in chosen for _ in range(seeds)]
    seed_list = [GALLERY_SEED_BASE + j for _ in chosen for j in range(seeds)]
    before = sample_checkpoint(bank, base, texts, seed_list, steps)
    after = sample_checkpoint(bank, final, texts, seed_list, steps)
    size = max(64, min(before.shape[-2:]))  # tiny images at 8x or more (full zoom), big ones as they are
    left = image_grid(upscale(middle_frame(before), size), len(chosen))
    right = image_grid(upscale(middle_frame(after), size), len(chosen))
    gap = torch.ones(3, left.shape[1], 6)
    written = [_save_png(torch.cat([left, gap, right], dim=2), out / f"{run_dir.name}-before-after.png")]
    if before.ndim == 5:  # clips: base (top) and aligned (bottom), first prompt and seed
        strip = frame_strip(torch.stack([before[0], after[0]]), size=size)
        written.append(_save_png(strip, out / f"{run_dir.name}-frames.png"))
    return written


def reward_curve(run_dir: Path, out: Path) -> Path:
    """The run's train and eval reward against iteration."""
    rows = read_rows(run_dir)
    keys = [k for k in REWARD_KEYS if any(k in r for r in rows)] or list(REWARD_KEYS)
    fig = curves_figure({run_dir.name: rows}, keys, title=run_dir.name)
    return save_figure(fig, out / f"{run_dir.name}-reward-curve.png")


def algorithm_comparison(path: Path, out: Path) -> Path:
    """Eval reward for each algorithm of a ``bench.convergence`` JSON file.

    Left: against wall time, or, when every point carries the independent reader's accuracy
    (``reader``), that accuracy against compute (the wall time of a shared host says little).
    Right: eval reward against compute (or NFE for older files).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    wrong = f"{path} is not a bench.convergence result (algorithm -> list of eval points); pass the file it wrote"
    try:
        results: dict[str, list[dict[str, Any]]] = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{wrong} ({str(err).splitlines()[0]})") from None
    if not isinstance(results, dict) or not all(isinstance(v, list) for v in results.values()):
        raise ValueError(wrong)
    every = [p for v in results.values() for p in v]
    x_compute = "compute" if every and all("compute" in p for p in every if isinstance(p, dict)) else "nfe"
    read = all(isinstance(p, dict) and "reader" in p for p in every)
    need = ("eval/reward_mean", x_compute, "reader" if read else "wall_s")
    if not every or not all(isinstance(p, dict) and all(k in p for k in need) for p in every):
        raise ValueError(f"{wrong}: every point needs {', '.join(need)}")
    fig = Figure(figsize=(9, 3.2), dpi=80)
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    for name, points in results.items():
        reward = [p["eval/reward_mean"] for p in points]
        if read:
            axes[0].plot([p[x_compute] for p in points], [100 * p["reader"] for p in points], "o-", ms=3, label=name)
        else:
            axes[0].plot([p["wall_s"] for p in points], reward, "o-", ms=3, label=name)
        axes[1].plot([p[x_compute] for p in points], reward, "o-", ms=3, label=name)
    x_label = "compute equivalent (NFE + 2 x backprop NFE)" if x_compute == "compute" else "NFE"
    axes[0].set_xlabel(x_label if read else "training wall time (s)")
    axes[0].set_ylabel("independent reader accuracy (%)" if read else "eval reward (held-out seeds)")
    axes[1].set_xlabel(x_label)
    axes[1].set_ylabel("eval reward (held-out seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = Path(path).stem.replace("benchmarks-", "")
    return save_figure(fig, out / f"algorithms-{name}.png")


def build_gallery(
    run_dirs: Sequence[Path],
    out: Path,
    *,
    benchmarks: Sequence[Path] = (),
    seeds: int = 4,
    prompts: int = MAX_PROMPTS,
    steps: int | None = None,
    bank: CheckpointBank | None = None,
) -> list[Path]:
    """Write every gallery image; returns the paths written.

    Raises:
        FileNotFoundError: a run folder or benchmark file is missing.
        ValueError: a bad count, or a benchmark file of another format.
    """
    from ..resources import check_sampling_flags

    check_sampling_flags(seeds, steps)
    if prompts < 1:
        raise ValueError(f"--prompts must be >= 1; got {prompts}")
    bank = bank or CheckpointBank()
    written: list[Path] = []
    for run in run_dirs:
        written += before_after(bank, Path(run), out, seeds=seeds, prompts=prompts, steps=steps)
        written.append(reward_curve(Path(run), out))
    for path in benchmarks:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no benchmark file {path}; pass --benchmarks FILE (bench.convergence JSON)")
        written.append(algorithm_comparison(Path(path), out))
    return written
