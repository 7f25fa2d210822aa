"""Checks and the atomic save of ``flowrl pretrain-digits``: options and ``--out`` before training, weights after.

Every refusal is one line naming the command-line flag (``--seed``, ``--out``, ...) and the fix. The model is
written into a hidden sibling folder (``.NAME.partial-*``) and renamed into place at the end, so an error or a
kill while saving leaves an existing ``--out`` as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ...outputs import check_writable_place
from ...runtime import max_threads
from .model import DIGITS_DIR

MODEL_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
PIPELINE_ENTRIES = frozenset(
    {*MODEL_COMPONENTS, "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler", "model_index.json", "flowrl.json"}
)
MAX_SEED = 2**64 - 1  # torch.manual_seed's range
_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "seed": (0, MAX_SEED),
    "vae_steps": (1, None),
    "flow_steps": (1, None),
    "batch_size": (1, None),
    "threads": (1, None),  # at most runtime.max_threads() of this machine (checked in check_options)
    "eval_per_class": (0, None),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_int(name: str, value: Any, low: int, high: int | None) -> None:
    """Refuse a non-integer or out-of-range ``value`` of option ``name`` (one line naming its flag)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_flag(name)} must be an integer; got {value!r}")
    if value < low:
        raise ValueError(f"{_flag(name)} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ValueError(f"{_flag(name)} must be <= {high}; got {value}")


def check_options(**values: Any) -> None:
    """Refuse a bad numeric option of :func:`~flowrl.models.digits.pretrain.pretrain_digits` before any work.

    Args:
        **values: ``seed``, ``vae_steps``, ``flow_steps``, ``batch_size``, ``threads``, ``eval_per_class``
            and ``logit_normal_mean``.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option out of range (``threads`` above :func:`~flowrl.runtime.max_threads`), or a
            ``logit_normal_mean`` that is not finite.
    """
    for name, (low, high) in _INT_RANGES.items():
        _check_int(name, values[name], low, high)
    if values["threads"] > max_threads():  # torch would start that many threads per operation: a near hang
        raise ValueError(
            f"--threads={values['threads']} but this machine has {os.cpu_count() or 1} CPU cores; "
            f"use at most {max_threads()} (default 1)"
        )
    mean = values["logit_normal_mean"]
    if isinstance(mean, bool) or not isinstance(mean, (int, float)):
        raise TypeError(f"--logit-normal-mean must be a number; got {mean!r}")
    if not math.isfinite(mean):
        raise ValueError(f"--logit-normal-mean must be a finite number; got {mean}")


def check_batch_size(batch_size: int, images: int) -> None:
    """Refuse a ``batch_size`` larger than the ``images`` in the training set.

    Raises:
        ValueError: ``batch_size > images``.
    """
    if batch_size > images:
        raise ValueError(f"--batch-size must be <= {images} (the digits in the training set); got {batch_size}")


def _is_default(out_dir: Path) -> bool:
    return out_dir.resolve() == DIGITS_DIR.resolve()


def _refuse_filled(out_dir: Path) -> None:
    """Raise the one-line refusal for a non-empty ``out_dir`` written without ``--overwrite``."""
    if (out_dir / "model_index.json").exists():
        shipped = " (the shipped flowrl-digits model every default job uses)" if _is_default(out_dir) else ""
        raise FileExistsError(
            f"--out {out_dir} already holds a model{shipped}; pass --overwrite to replace it, or a new folder"
        )
    raise FileExistsError(
        f"--out {out_dir} is not empty; pass --overwrite to write the model into it (its other files are kept), "
        "or a new folder"
    )


def check_out(out_dir: Path | str, *, overwrite: bool) -> Path:
    """Refuse an output folder that cannot be written, or that holds files, unless ``overwrite``.

    Args:
        out_dir: the ``--out`` folder (may not exist yet; a symbolic link stands for its target).
        overwrite: whether a folder that already holds a model (or other files) may be replaced.

    Returns:
        ``out_dir`` as an absolute path with symbolic links resolved.

    Raises:
        ValueError: ``out_dir`` is a file, the current folder (or one above it) or not writable.
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is false.
    """
    out_dir = Path(out_dir).resolve()  # a symlinked folder: its target is written
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is an existing file, not a folder; pass a folder path")
    cwd = Path.cwd().resolve()
    if out_dir == cwd or out_dir in cwd.parents:
        raise ValueError(f"--out {out_dir} is the current folder or one above it; pass a folder below it")
    check_writable_place(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        _refuse_filled(out_dir)
    return out_dir


def check_weights_finite(pipe: Any, out_dir: Path) -> None:
    """Refuse to save a pipeline whose trained weights (or VAE latent scaling) are not all finite.

    Args:
        pipe: the trained flowrl-digits pipeline.
        out_dir: the ``--out`` folder (named in the error; it is not touched).

    Raises:
        ValueError: naming the first component and tensor with a NaN or an infinity.
    """
    fix = f"nothing was saved and {out_dir} is as it was; try another --seed or --logit-normal-mean"
    for name in MODEL_COMPONENTS:
        module = getattr(pipe, name)
        for tensor_name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"the trained {name} has NaN or infinite weights ({tensor_name}); {fix}")
    for key in ("scaling_factor", "shift_factor"):
        value = pipe.vae.config.get(key)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"the trained vae's {key} is {value}; {fix}")


def _folder_mode(out_dir: Path) -> int:
    """The permission bits the new folder gets: those of the folder it replaces, else the umask's default."""
    if out_dir.is_dir():
        return out_dir.stat().st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask


def _carry_over(previous: Path, out_dir: Path, log: Callable[[str], None]) -> None:
    """Move the files of the replaced folder that are not the model's into the new one; drop the old model."""
    for entry in sorted(previous.iterdir()):
        if entry.name not in PIPELINE_ENTRIES:
            if not (out_dir / entry.name).exists():
                entry.rename(out_dir / entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if any(previous.iterdir()):
        log(f"kept files of the replaced folder whose names the new one also has in {previous}")
    else:
        previous.rmdir()


def _swap_in(partial: Path, out_dir: Path, *, overwrite: bool, log: Callable[[str], None]) -> None:
    """Rename the finished ``partial`` folder to ``out_dir``; a replaced folder's other files are kept."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:  # filled while training ran
            raise FileExistsError(f"--out {out_dir} was filled while training ran; the new model is in {partial}")
        previous = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.previous-", dir=out_dir.parent))
        os.replace(out_dir, previous)  # onto the empty placeholder
        try:
            os.replace(partial, out_dir)
        except OSError:
            os.replace(previous, out_dir)
            raise
        _carry_over(previous, out_dir, log)
    else:
        os.replace(partial, out_dir)  # a missing or empty folder


def save_model(
    pipe: Any, card: dict[str, Any], out_dir: Path, *, overwrite: bool, log: Callable[[str], None] = print
) -> None:
    """Save ``pipe`` and its ``flowrl.json`` card to ``out_dir`` atomically (a kill leaves the old folder).

    Args:
        pipe: the trained flowrl-digits pipeline (refused when a weight is not finite).
        card: the model card written as ``flowrl.json``.
        out_dir: the destination folder (checked by :func:`check_out`).
        overwrite: whether an existing, non-empty ``out_dir`` may be replaced.
        log: where a note about kept files goes.

    Raises:
        ValueError: a weight is NaN or infinite (``out_dir`` untouched).
        FileExistsError: ``out_dir`` was filled while training ran and ``overwrite`` is false.
    """
    check_weights_finite(pipe, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        partial.chmod(_folder_mode(out_dir))  # mkdtemp makes it private (0o700)
        pipe.save_pretrained(str(partial), safe_serialization=True)
        (partial / "flowrl.json").write_text(json.dumps(card, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _swap_in(partial, out_dir, overwrite=overwrite, log=log)
