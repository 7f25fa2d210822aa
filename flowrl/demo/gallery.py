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
import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

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
    bank: CheckpointBank,
    run_dir: Path,
    out: Path,
    seeds: int = 4,
    prompts: int = MAX_PROMPTS,
    steps: int | None = None,
    name: str | None = None,
) -> list[Path]:
    """The run's base | aligned grid (and frame strip for video) on its first eval prompts and fixed seeds.

    The files are ``<name>-before-after.png`` and ``<name>-frames.png``; ``name`` defaults to the folder's name.
    """
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
    name = name or run_dir.name
    written = [_save_png(torch.cat([left, gap, right], dim=2), out / f"{name}-before-after.png")]
    if before.ndim == 5:  # clips: base (top) and aligned (bottom), first prompt and seed
        strip = frame_strip(torch.stack([before[0], after[0]]), size=size)
        written.append(_save_png(strip, out / f"{name}-frames.png"))
    return written


def reward_curve(run_dir: Path, out: Path, name: str | None = None) -> Path:
    """The run's train and eval reward against iteration, as ``<name>-reward-curve.png`` (default: folder name)."""
    name = name or run_dir.name
    rows = read_rows(run_dir)
    keys = [k for k in REWARD_KEYS if any(k in r for r in rows)] or list(REWARD_KEYS)
    fig = curves_figure({name: rows}, keys, title=name)
    return save_figure(fig, out / f"{name}-reward-curve.png")


def unique_stems(paths: Sequence[Path], what: str, base: Callable[[Path], str]) -> dict[Path, str]:
    """A distinct file-name stem for each path: ``base`` of it, or with the fewest parent folders that tell it apart.

    ``runs/a`` and ``dup/a`` get ``runs-a`` and ``dup-a``; a path given twice (``a`` and ``./a``) counts once.

    Args:
        paths: run folders or benchmark files, as given.
        what: what they are, for the error (``run folders``, ``benchmark files``).
        base: the stem of one absolute path on its own (e.g. the folder's name).

    Returns:
        path as given -> its stem, in the order given.

    Raises:
        ValueError: two paths no suffix tells apart (``benchmarks-x.json`` and ``x.json`` in one folder).
    """
    given: dict[Path, Path] = {}
    for path in paths:
        given.setdefault(Path(os.path.abspath(path)), Path(path))  # the first spelling of each path wins
    parts = {p: [*p.parent.parts[1:], base(p)] for p in given}
    length = dict.fromkeys(parts, 1)
    while True:
        stems = {p: "-".join(parts[p][-length[p] :]) for p in parts}
        owners: dict[str, list[Path]] = {}
        for p, stem in stems.items():
            owners.setdefault(stem, []).append(p)
        clash = [group for group in owners.values() if len(group) > 1]
        if not clash:
            return {given[p]: stem for p, stem in stems.items()}
        longer = [p for group in clash for p in group if length[p] < len(parts[p])]
        if not longer:
            a, b = (given[p] for p in clash[0][:2])
            name = parts[clash[0][0]][-1]
            raise ValueError(f"{what} {a} and {b} would get the same image names ({name}); rename or move one of them")
        for p in longer:
            length[p] += 1


def read_benchmark(path: Path) -> tuple[dict[str, list[dict[str, Any]]], str, bool]:
    """A ``bench.convergence`` JSON file, checked: every point has the plotted keys, each a finite number.

    Returns:
        (algorithm -> its eval points, the compute axis key ``compute`` or ``nfe``, whether every point has ``reader``).

    Raises:
        ValueError: not JSON (or nested too deeply to read), not algorithm -> list of points, a point without a
            plotted key, or a plotted value that is no finite number (one line naming the file).
    """
    wrong = f"{path} is not a bench.convergence result (algorithm -> list of eval points); pass the file it wrote"
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{wrong} ({str(err).splitlines()[0]})") from None
    except RecursionError:
        raise ValueError(f"{wrong} (nested too deeply to read)") from None
    if not isinstance(results, dict) or not all(isinstance(v, list) for v in results.values()):
        raise ValueError(wrong)
    every = [p for v in results.values() for p in v]
    x_compute = "compute" if every and all("compute" in p for p in every if isinstance(p, dict)) else "nfe"
    read = all(isinstance(p, dict) and "reader" in p for p in every)
    need = ("eval/reward_mean", x_compute, "reader" if read else "wall_s")
    if not every or not all(isinstance(p, dict) and all(k in p for k in need) for p in every):
        raise ValueError(f"{wrong}: every point needs {', '.join(need)}")
    for name, points in results.items():
        for point in points:
            key = next((k for k in need if not _finite_number(point[k])), None)
            if key is not None:
                value = json.dumps(point[key])[:40]
                raise ValueError(f"{wrong}: {name}: {key} is {value}, not a finite number")
    return results, x_compute, read


def _finite_number(value: Any) -> bool:
    """Whether a JSON value is a finite number a float can hold (not a bool, text, null, NaN, inf or 1e400 as int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def algorithm_comparison(path: Path, out: Path, name: str | None = None) -> Path:
    """Eval reward for each algorithm of a ``bench.convergence`` JSON file, as ``algorithms-<name>.png``.

    Left: against wall time, or, when every point carries the independent reader's accuracy
    (``reader``), that accuracy against compute (the wall time of a shared host says little).
    Right: eval reward against compute (or NFE for older files). ``name`` defaults to the file's stem
    without ``benchmarks-``.

    Raises:
        ValueError: a file of another format (:func:`read_benchmark`).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    results, x_compute, read = read_benchmark(path)
    fig = Figure(figsize=(9, 3.2), dpi=80)
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    for algorithm, points in results.items():
        reward = [p["eval/reward_mean"] for p in points]
        if read:
            reader = [100 * p["reader"] for p in points]
            axes[0].plot([p[x_compute] for p in points], reader, "o-", ms=3, label=algorithm)
        else:
            axes[0].plot([p["wall_s"] for p in points], reward, "o-", ms=3, label=algorithm)
        axes[1].plot([p[x_compute] for p in points], reward, "o-", ms=3, label=algorithm)
    x_label = "compute equivalent (NFE + 2 x backprop NFE)" if x_compute == "compute" else "NFE"
    axes[0].set_xlabel(x_label if read else "training wall time (s)")
    axes[0].set_ylabel("independent reader accuracy (%)" if read else "eval reward (held-out seeds)")
    axes[1].set_xlabel(x_label)
    axes[1].set_ylabel("eval reward (held-out seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out / f"algorithms-{name or _benchmark_stem(Path(path))}.png")


def _benchmark_stem(path: Path) -> str:
    """``docs/benchmarks-convergence.json`` -> ``convergence``."""
    return path.stem.replace("benchmarks-", "")


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

    Runs (and benchmark files) with the same name get distinct file names (:func:`unique_stems`); a run
    given twice is drawn once.

    Raises:
        FileNotFoundError: a run folder or benchmark file is missing.
        ValueError: a bad count, a benchmark file of another format, or two runs no file name tells apart.
    """
    from ..resources import check_sampling_flags

    check_sampling_flags(seeds, steps)
    if prompts < 1:
        raise ValueError(f"--prompts must be >= 1; got {prompts}")
    runs = unique_stems(run_dirs, "run folders", lambda p: p.name)
    files = unique_stems(benchmarks, "benchmark files", _benchmark_stem)
    for path in files:  # a missing or bad file is refused before the minutes of sampling
        if not path.is_file():
            raise FileNotFoundError(f"no benchmark file {path}; pass --benchmarks FILE (bench.convergence JSON)")
        read_benchmark(path)
    bank = bank or CheckpointBank()
    written: list[Path] = []
    for run, name in runs.items():
        written += before_after(bank, run, out, seeds=seeds, prompts=prompts, steps=steps, name=name)
        written.append(reward_curve(run, out, name=name))
    for path, name in files.items():
        written.append(algorithm_comparison(path, out, name=name))
    return written
