"""Pictures of runs: reward curves and training metrics from ``metrics.jsonl``, image rows, frame strips.

Every function here is deterministic: the same inputs give byte-identical PNGs (the gallery relies on it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

REWARD_KEYS = ("reward_mean", "eval/reward_mean")
PNG_METADATA = {"Software": None}  # no library version in the file: identical bytes across matplotlib builds


def read_rows(run_dir: str | Path) -> list[dict[str, float]]:
    """The rows of a run's ``metrics.jsonl`` (null -> NaN; rows a kill cut short are skipped).

    Values that are no number (text, lists, objects) are left out, and so is an integer too large for a float
    (``1`` and 400 zeros); a row whose ``step`` is such an integer is skipped (it has no place on the x axis).
    """
    from ..outputs import read_metrics

    rows = []
    for _, line in read_metrics(Path(run_dir) / "metrics.jsonl"):
        row = {k: math.nan if v is None else v for k, v in json.loads(line).items() if _plottable(v)}
        if "step" in row:
            rows.append(row)
    return rows


def _plottable(value: Any) -> bool:
    """Whether a logged value can be drawn: null, a float, or an integer a float can hold."""
    if value is None or isinstance(value, float):
        return True
    if not isinstance(value, int):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def metric_keys(runs: Mapping[str, Sequence[Mapping[str, float]]]) -> list[str]:
    """Every metric any run logged (``step`` excluded), reward curves first, then sorted."""
    keys = sorted({k for rows in runs.values() for row in rows for k in row if k != "step"})
    return [k for k in REWARD_KEYS if k in keys] + [k for k in keys if k not in REWARD_KEYS]


def curves_figure(runs: Mapping[str, Sequence[Mapping[str, float]]], keys: Sequence[str], title: str = "") -> Any:
    """A matplotlib figure: one panel per metric key, one line per run.

    Args:
        runs: run label -> its metrics rows.
        keys: metric names to plot (panels), e.g. ``("reward_mean", "eval/reward_mean")``.
        title: the figure title.

    Returns:
        The ``matplotlib.figure.Figure`` (Agg backend).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    keys = list(keys) or list(REWARD_KEYS)
    fig = Figure(figsize=(5.2 * min(len(keys), 2), 3.2 * math.ceil(len(keys) / 2)), dpi=80)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(math.ceil(len(keys) / 2), min(len(keys), 2), i + 1)
        for label, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
            if points:
                ax.plot(*zip(*points), "o-" if len(points) < 12 else "-", label=label, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: Path) -> Path:
    """Save a figure as PNG without version metadata (deterministic bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata=PNG_METADATA)
    return path


def upscale(images: Tensor, size: int) -> Tensor:
    """Nearest-neighbour upscale (N, 3, H, W) so the short side is about ``size`` pixels (never down)."""
    factor = max(1, size // min(images.shape[-2:]))
    return images.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1) if factor > 1 else images


def to_pil(image: Tensor) -> Any:
    """A (3, H, W) image in [0, 1] as a PIL image (uint8, rounded)."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).cpu().numpy()
    return Image.fromarray(array)


def frame_strip(clips: Tensor, size: int = 64, pad: int = 2) -> Tensor:
    """Clips (N, F, 3, H, W) as one (3, H', W') image: one row per clip, its frames left to right."""
    from ..outputs import image_grid

    n, f = clips.shape[:2]
    frames = upscale(clips.reshape(n * f, *clips.shape[2:]), size)
    return image_grid(frames, rows=n, pad=pad)


def save_gif(clip: Tensor, path: Path, size: int = 96, fps: int = 8) -> Path:
    """Write a clip (F, 3, H, W) in [0, 1] as a looping animated GIF (plays in any browser, no ffmpeg)."""
    frames = [to_pil(f) for f in upscale(clip, size)]
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path
