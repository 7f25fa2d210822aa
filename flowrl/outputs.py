"""Run-folder outputs: resolved config, metrics (JSONL + TensorBoard, optionally wandb), reward curve, image grids."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

RUN_MARKERS = ("config.yaml", "metrics.jsonl", "summary.json")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left on device; disk quota exceeded


class DiskFullError(ValueError):
    """No space left while writing a run file: one line naming the file, its size and the free space.

    A ``ValueError`` so the CLI reports it as a user error (``flowrl: error: ...``, exit code 2).
    """


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def disk_full_error(what: str, folder: Path, size: int | None, run_dir: Path | None = None) -> DiskFullError:
    """The one-line error for a write that ran out of space.

    Args:
        what: the file being written, as the message names it.
        folder: a folder on the full filesystem (its free space is reported).
        size: bytes being written, when known.
        run_dir: the run folder to resume, when known.

    Returns:
        The exception to raise (the earlier checkpoints are intact; the message says how to go on: the
        ``flowrl train --resume RUN``, which reads the run's own ``config.yaml``, whatever its config files were).
    """
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = _human(shutil.disk_usage(folder).free)
    need = f"{_human(size)} to write, " if size is not None else ""
    run = run_dir or Path("RUN_DIR")  # --resume RUN alone reads the run's own config.yaml
    return DiskFullError(
        f"{what}: no space left on device ({need}{free} free on that filesystem); free space, then continue with "
        f"`flowrl train --resume {run}` (earlier checkpoints intact)"
    )


def check_run_dir_free(path: str | Path, overwrite: bool, resume: str | None = None) -> None:
    """Refuse a run folder that already holds files, before anything is built or launched.

    Raises:
        FileExistsError: a file stands at ``path``; the folder holds files and ``overwrite`` is not given, or it
            is not a run (:func:`check_overwritable`); with ``resume``, it holds files and is not the resumed
            run's folder.
        ValueError: the folder, or the nearest one above it, is not writable or is a file
            (:func:`check_writable_place`).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output folder {path} is a file; set output.dir=<new folder>")
    if not path.is_dir():
        check_writable_place(path, "output.dir")  # the nearest folder above it
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"output.dir {path} is not writable; pass a folder you can write to")
    if not (path.is_dir() and any(path.iterdir())):
        return
    if resume is not None:  # a resume continues in its own run folder; any other folder's files are another run's
        run = resume_run_dir(resume)
        if run is not None and run.resolve() == path.resolve():
            return
        where = f"leave output.dir out to continue in {run}, or " if run is not None else ""
        raise FileExistsError(
            f"output folder {path} already holds files and is not the run of --resume {resume}; "
            f"{where}set output.dir=<new folder>"
        )
    if not overwrite:
        raise FileExistsError(
            f"output folder {path} already holds files; pass --overwrite or set output.dir=<new folder>"
        )
    check_overwritable(path)


def resume_run_dir(path: str | Path) -> Path | None:
    """The run folder a ``--resume`` path belongs to (the path itself, or above ``checkpoints/``), if any."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path
    if path.name == "checkpoints":
        return path.parent
    if path.parent.name == "checkpoints":
        return path.parent.parent
    return None


def check_run_config(path: Path, fix: str = "restore it, or pass the run's config file(s)") -> Path:
    """Refuse a run's ``config.yaml`` that holds nothing (empty, blank or only comments).

    ``flowrl train`` writes the whole resolved config into it, so an empty one was cut short or blanked; read as
    a config it would be the defaults, and the run's LoRA would be sampled, scored and resumed with another model,
    other rewards and no guards, without a word.

    Args:
        path: the run's ``config.yaml``.
        fix: what to do instead, for the message.

    Returns:
        ``path``.

    Raises:
        ValueError: one line naming the file and ``fix``.
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not any(line.strip() and not line.lstrip().startswith("#") for line in lines):
        raise ValueError(f"{path} is empty, but a run's config.yaml holds its whole resolved config; {fix}")
    return path


def check_writable_place(path: Path, flag: str = "--out") -> None:
    """Refuse an output ``path`` whose nearest existing folder above it is a file or not writable.

    Checked before any work starts, so a command does not sample or train for minutes and then fail to write.

    Args:
        path: the file or folder to be written (need not exist yet).
        flag: the option that named it, for the message.

    Raises:
        ValueError: a file stands where a folder above ``path`` should be, or that folder is not writable.
    """
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ValueError(f"{flag} {path}: {above} is a file, not a folder; pass a path inside a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {above} is not writable; pass a folder you can write to")


def check_overwritable(
    path: Path, markers: tuple[str, ...] = (*RUN_MARKERS, "checkpoints"), kind: str = "run", key: str = "output.dir"
) -> None:
    """Refuse to let ``--overwrite`` delete a folder that is not one flowrl wrote.

    Refused: the current folder or one above it, and any folder holding none of ``markers`` (a run's
    ``config.yaml``, ``metrics.jsonl``, ``summary.json`` or ``checkpoints/`` by default).

    Args:
        path: the folder ``--overwrite`` would replace.
        markers: names of which at least one marks a folder of this ``kind``.
        kind: what the folder should be, for the message ("run", "diffusers model").
        key: the option that named the folder, for the message.

    Raises:
        FileExistsError: ``path`` is not a folder of this kind.
    """
    here, target = Path.cwd().resolve(), path.resolve()
    if target == here or target in here.parents:
        raise FileExistsError(
            f"{key} {path} is the current folder or one above it; --overwrite would delete it; "
            f"set {key} to a {kind} folder"
        )
    if not any((path / name).exists() for name in markers):
        raise FileExistsError(
            f"folder {path} holds files but no {kind} (none of {', '.join(markers)}); --overwrite deletes only "
            f"{kind} folders: set {key} to a new folder or empty it yourself"
        )


def prepare_run_dir(path: str | Path, overwrite: bool) -> Path:
    """Create the run folder, refusing one that already holds a run unless ``overwrite``.

    Raises:
        FileExistsError: the folder holds files and overwrite is False, or it is not a run folder
            (:func:`check_overwritable`).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output path {path} is a file; set output.dir to a folder")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"output folder {path} already holds files; pass --overwrite or set output.dir=<new folder>"
            )
        check_overwritable(path)
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file and rename, so a crash never leaves a half-written file.

    Raises:
        DiskFullError: no space left (the temp file is removed, ``path`` is untouched).
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise disk_full_error(str(path), path.parent, len(text.encode()), path.parent) from None
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON with sorted keys, atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_metrics(path: Path) -> list[tuple[int, str]]:
    """The rows of a ``metrics.jsonl`` as (step, line): its lines that are JSON objects with an integer ``step``.

    Raises:
        ValueError: a line that is not UTF-8, or one before the last that is not JSON (:func:`metrics_lines`).
    """
    return [(step, line) for step, line in metrics_lines(path) if step is not None]


def metrics_lines(path: Path) -> list[tuple[int | None, str]]:
    """Every line of a ``metrics.jsonl`` worth keeping, as (step, line); the step is None for one that is no row.

    Only a last line that does not parse (a row cut short by a kill) and blank lines are dropped. A line that
    parses but is not a row (no integer ``step``) is kept with step None, so a rewrite of the file loses nothing.

    Raises:
        ValueError: a line that is not UTF-8, or one before the last that is not JSON (one line: the file, the
            line number and the fix).
    """
    if not path.is_file():
        return []
    lines = path.read_bytes().splitlines()
    kept = []
    for number, raw in enumerate(lines, 1):
        line = _metrics_text(path, number, raw)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # a row cut short by a kill
            raise ValueError(
                f"{path}: line {number} is not valid JSON (corrupt or edited); repair or remove that line"
            ) from None
        step = row.get("step") if isinstance(row, dict) else None
        kept.append((step if isinstance(step, int) and not isinstance(step, bool) else None, line))
    return kept


def _metrics_text(path: Path, number: int, raw: bytes) -> str:
    """One line of ``metrics.jsonl`` as text; one ValueError line naming the file and line when it is not UTF-8."""
    try:
        return raw.decode()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: line {number} is not UTF-8 text (byte {raw[err.start]:#04x}); repair or remove that line"
        ) from None


def json_row(row: dict[str, float]) -> dict[str, float | None]:
    """A metrics row as strict JSON allows it: non-finite values (inf, NaN) become ``null``."""
    return {k: v if math.isfinite(v) else None for k, v in row.items()}


def _append_line(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line)


def open_wandb(run_dir: Path, project: str, config: dict[str, Any] | None, resume: bool) -> Any:
    """Start a Weights & Biases run for ``output.wandb: true`` (its id is the run folder's, so a resume continues it).

    Args:
        run_dir: the run folder (wandb writes its files under ``run_dir/wandb``).
        project: ``output.wandb_project``.
        config: the resolved config, shown in wandb.
        resume: continue the run folder's wandb run.

    Returns:
        The ``wandb`` run.

    Raises:
        ValueError: wandb is not installed (one line: how to install it, or how to switch it off).
    """
    wandb = require_wandb()
    run_id = "flowrl-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(
        project=project,
        dir=str(run_dir),
        name=run_dir.name,
        id=run_id,
        config=config,
        resume="allow" if resume else None,
    )


def require_wandb() -> Any:
    """The ``wandb`` module, or one ValueError line when it is not installed (wandb is never required)."""
    try:
        import wandb
    except ImportError:
        raise ValueError(
            "output.wandb is true but wandb is not installed: `pip install wandb`, or set output.wandb=false "
            "(TensorBoard logs either way)"
        ) from None
    return wandb


class MetricsLogger:
    """Append-only JSONL metrics plus TensorBoard scalars (and wandb, when a wandb run is passed).

    On resume the run continues the same records: ``metrics.jsonl`` is cut back to the rows with
    ``step <= resume_step`` (rewritten atomically; they stay in :attr:`rows`), and TensorBoard
    writes into the same folder with ``purge_step=resume_step + 1``, so events after the
    checkpoint are discarded and no step appears twice.

    Args:
        run_dir: the run folder (writes ``metrics.jsonl`` and ``tensorboard/``).
        resume_step: the iteration of the checkpoint a resumed run continues from (None: a fresh run).
        wandb_run: a run from :func:`open_wandb` that receives every row and image too (None: TensorBoard only).
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, wandb_run: Any | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, float]] = [] if resume_step is None else self._cut(resume_step)
        # a fresh run writes a SessionLog.START too (purge_step=0 purges nothing): TensorBoard's
        # server-side reader (`tensorboard --load_fast=false`) takes a run's first START as the
        # session's start and purges only at later ones, so the first resume's purge needs it
        purge = 0 if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self.run_dir, self.wandb = run_dir, wandb_run

    def _cut(self, step: int) -> list[dict[str, float]]:
        kept = [(s, line) for s, line in metrics_lines(self.path) if s is None or s <= step]  # non-rows stay
        if self.path.exists():
            write_text_atomic(self.path, "".join(line + "\n" for _, line in kept))
        return [json.loads(line) for s, line in kept if s is not None]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row (the numeric metrics) to ``metrics.jsonl`` and write the finite ones to TensorBoard.

        Args:
            step: the iteration the metrics belong to.
            metrics: name -> value; non-numeric values are dropped.

        Raises:
            DiskFullError: no space left to append the row.
        """
        row = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.rows.append(row)
        line = json.dumps(json_row(row), allow_nan=False) + "\n"
        try:
            _append_line(self.path, line)
        except OSError as err:
            if err.errno not in DISK_FULL_ERRNOS:
                raise
            raise disk_full_error(
                f"{self.path} (step {step})", self.path.parent, len(line.encode()), self.path.parent
            ) from None
        finite = {k: v for k, v in row.items() if k != "step" and math.isfinite(v)}
        for key, value in finite.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(finite, step=step)

    def log_images(self, step: int, grid: Tensor, tag: str = "eval/samples") -> Path:
        """Log an image grid (3, H, W) in [0, 1]: TensorBoard ``add_image``, wandb, and ``samples/iter-N.png``.

        Returns:
            The PNG's path.
        """
        grid = grid.detach().float().cpu().clamp(0, 1)
        self.writer.add_image(tag, grid, step)
        self.writer.flush()
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        path = folder / f"iter-{step:06d}.png"
        save_png(grid, path)
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(str(path))}, step=step)
        return path

    def close(self) -> None:
        """Close the TensorBoard writer (and finish the wandb run)."""
        self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


GUARD_PANEL = ("eval/diversity_ratio",)  # monitors drawn beside the guards (guard/* rows, *_best excluded)


def _guard_series(rows: Sequence[dict[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """Guard and monitor curves of a run: name -> [(step, value)], from its ``guard/<name>`` rows.

    A guard is a ``guard/<name>`` that also logs ``guard/<name>_best`` (the update guards' counters do not).
    """
    names = sorted({k.removesuffix("_best") for r in rows for k in r if k.startswith("guard/") and k.endswith("_best")})
    if not names:
        return {}
    out = {}
    for name in [*names, *GUARD_PANEL]:
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None and math.isfinite(r[name])]
        if points:
            out[name] = points
    return out


def save_reward_curve(rows: Sequence[dict[str, float]], path: Path, title: str = "reward") -> None:
    """Plot training reward mean and eval reward (held-out seeds) against iteration.

    A run with guards gets a second panel beside it: each guard's held-out value (and the diversity
    ratio to the base model) against iteration, so hacking shows as the two panels diverging.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    guards = _guard_series(rows)
    if guards:
        fig, (ax, gx) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
        for name, points in guards.items():
            gx.plot(*zip(*points), "o-", label=name, markersize=3)
        gx.set_xlabel("iteration")
        gx.set_ylabel("held-out value")
        gx.set_title("guards (never trained on)")
        gx.grid(alpha=0.3)
        gx.legend(loc="best", fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    train = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    evals = [(r["step"], r["eval/reward_mean"]) for r in rows if r.get("eval/reward_mean") is not None]
    if train:
        ax.plot(*zip(*train), label="train reward (SDE rollouts)", alpha=0.7)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval reward (ODE, held-out seeds)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def middle_frame(images: Tensor) -> Tensor:
    """Videos (N, F, 3, H, W) -> their middle frames (N, 3, H, W); images pass through unchanged."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


def image_grid(images: Tensor, rows: int, scale: int = 1, pad: int = 1) -> Tensor:
    """Tile images (N, 3, H, W) in [0, 1] row-major into one (3, H', W') image (nearest upscaling).

    Videos (N, F, 3, H, W) are shown by their middle frame.
    """
    images = middle_frame(images)
    n, c, h, w = images.shape
    cols = math.ceil(n / rows)
    if scale > 1:
        images = images.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
        h, w = h * scale, w * scale
    canvas = torch.full((c, rows * (h + pad) + pad, cols * (w + pad) + pad), 0.35)
    for i in range(n):
        r, k = divmod(i, cols)
        canvas[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + k * (w + pad) : pad + k * (w + pad) + w] = (
            images[i]
        )
    return canvas


def thumbnails(images: Tensor, max_side: int = 256) -> Tensor:
    """Images (N, 3, H, W) (videos: their middle frame) area-downsampled so no side exceeds ``max_side``.

    A logged grid of 20 prompts x 4 seeds at 1024 px would be 20k x 4k pixels; at 256 it stays small.
    """
    images = middle_frame(images).detach().float().cpu()
    h, w = images.shape[-2:]
    factor = max(h, w) / max_side
    if factor <= 1:
        return images
    size = (max(1, round(h / factor)), max(1, round(w / factor)))
    return torch.nn.functional.interpolate(images, size=size, mode="area")


def save_png(image: Tensor, path: Path) -> None:
    """Save a (3, H, W) image in [0, 1] as PNG (atomic)."""
    from PIL import Image

    array = (image.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    tmp = path.with_name(path.name + ".tmp.png")
    try:
        Image.fromarray(array).save(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed save (full disk, path a folder) leaves nothing behind
        raise


def save_before_after(before: Tensor, after: Tensor, rows: int, path: Path, scale: int = 1) -> None:
    """Side-by-side grid: left block = before training, right block = after (same prompts and seeds).

    Args:
        before: (N, 3, H, W) images, N = rows * columns, one prompt per row (videos
            (N, F, 3, H, W) show their middle frame).
        after: (N, 3, H, W) images (or videos) for the same prompts/seeds.
        rows: number of prompts.
        path: PNG path.
        scale: nearest-neighbour upscaling for tiny images.
    """
    left, right = image_grid(before, rows, scale), image_grid(after, rows, scale)
    gap = torch.ones(3, left.shape[1], max(4, scale * 2))
    save_png(torch.cat([left, gap, right], dim=2), path)
