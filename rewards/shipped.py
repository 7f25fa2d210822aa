"""Weights the project trains itself and ships in ``flowrl/assets``: one file format, one set of errors.

The digit classifier behind ``digit_correctness`` (:mod:`flowrl.rewards.digit_classifier`) and the
independent digit reader (:mod:`flowrl.models.digits.reader`) are small ``nn.Module`` state dicts
saved with safetensors. The header holds a ``format`` tag (``"flowrl.<name>/<version>"``) that says
which module the tensors belong to, and the training ``report`` as JSON. Loading refuses a missing,
corrupt, foreign or mismatched file in one line that names the file and the command that
regenerates it; no pickle is ever read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from torch import Tensor, nn

from .weights import safetensors_damage

M = TypeVar("M", bound=nn.Module)


def asset_path(filename: str) -> Path:
    """Path of ``filename`` in the installed package's ``flowrl/assets`` folder."""
    import flowrl

    return Path(flowrl.__file__).resolve().parent / "assets" / filename


def save_shipped(state: dict[str, Tensor], path: str | Path, fmt: str, report: dict[str, Any] | None = None) -> Path:
    """Save a state dict with safetensors, its ``format`` tag and training report in the header.

    Args:
        state: tensors by name (contiguous, CPU).
        path: output ``.safetensors`` file; its folder is created.
        fmt: the format tag :func:`load_shipped` checks, e.g. ``"flowrl.digit_reader/1"``.
        report: JSON-serialisable training report, stored as a string under ``report``.

    Returns:
        The path written.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": fmt}
    if report is not None:
        metadata["report"] = json.dumps(report, sort_keys=True)
    save_file(state, str(path), metadata=metadata)
    return path


def shipped_report(path: str | Path) -> dict[str, Any]:
    """The training report stored in a shipped file's header (``{}`` when it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("report", "{}"))


def load_shipped(model: M, path: str | Path, *, fmt: str, what: str, regenerate: str) -> M:
    """Load a shipped state dict into ``model``, frozen and in eval mode.

    Args:
        model: a freshly built module of the class the file was saved from.
        path: the ``.safetensors`` file.
        fmt: the format tag the file must carry (see :func:`save_shipped`).
        what: the file's name in messages, e.g. ``"digit reader weights"``.
        regenerate: the command that writes the file again, quoted in every error.

    Returns:
        ``model`` with the file's tensors, ``requires_grad`` off, in eval mode.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is not safetensors (corrupt, truncated), carries another format tag, or its
            tensors do not match ``model`` (missing, unexpected or misshapen).
    """
    from safetensors import safe_open

    path = Path(path)
    fix = f"regenerate them with `{regenerate}`"
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found at {path}; {fix}")
    if (reason := safetensors_damage(path)) is not None:
        raise ValueError(f"{what} at {path} are corrupt ({reason}); {fix}")
    with safe_open(str(path), framework="pt") as f:  # one open for the tag and the tensors
        if (found := (f.metadata() or {}).get("format")) != fmt:  # refused before any tensor is read
            raise ValueError(f"{path} does not hold {what} (format {fmt!r}; got {found!r}); {fix}")
        state = {name: f.get_tensor(name) for name in f.keys()}
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"{what} at {path} do not match {type(model).__name__} (missing, unexpected or misshapen tensors); {fix}"
        ) from err
    model.requires_grad_(False)
    return model.eval()
