"""Prompt sets: the embedded model's built-in sets, prompt files and dataset folders.

A prompt carries metadata (e.g. ``{"digit": 7, "style": "bold"}``, GenEval's ``include`` list
or OCR's ``ocr_text``) that is passed through to rewards as keyword lists. File formats and the
train/test folder layout are in :mod:`flowrl.prompts.files`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from ..models.digits.prompts import DIGITS_SETS
from .files import Prompt, read_prompt_file, split_file

__all__ = ["BUILTIN_SETS", "holdout_split", "load_prompts"]

# name -> builder; the embedded model's sets live with the model (flowrl/models/digits/prompts.py)
BUILTIN_SETS: dict[str, Callable[[], list[Prompt]]] = {**DIGITS_SETS}


def load_prompts(spec: str, split: str = "train") -> list[Prompt]:
    """Load a built-in prompt set by name, a prompt file, or one split of a dataset folder.

    Args:
        spec: a built-in name (``digits-styles``, ``digits``, ``digits-all``), a ``.txt``,
            ``.jsonl``, ``.csv`` or ``.json`` file, or a folder with ``train.*`` / ``test.*``
            files (see :mod:`flowrl.prompts.files`).
        split: which file of a folder to read: "train" or "test" (ignored for files and sets).

    Returns:
        A non-empty list of prompts.

    Raises:
        ValueError: unknown set, bad format, or a malformed line (file and line number named).
        FileNotFoundError: a folder without a file for ``split``.
    """
    if spec in BUILTIN_SETS:
        return BUILTIN_SETS[spec]()
    path = Path(spec)
    if path.is_dir():
        path = split_file(path, split)
    if not path.is_file():
        names = ", ".join(BUILTIN_SETS)
        raise ValueError(
            f"prompt set {spec!r} is neither a built-in set ({names}) nor an existing prompt file or folder"
        )
    return read_prompt_file(path)


def holdout_split(prompts: list[Prompt], test_fraction: float, part: str) -> list[Prompt]:
    """Deterministic train/test split by a hash of each prompt's text.

    A prompt is in the test part when ``sha256(text)`` mapped to [0, 1) is below
    ``test_fraction``, so the split is the same on every run and machine and never puts one
    prompt text in both parts.

    Args:
        prompts: the whole set.
        test_fraction: share held out for evaluation, in (0, 1).
        part: "train" or "test".

    Raises:
        ValueError: a part comes out empty (the message says how to fix it).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"prompts.test_fraction must be in (0, 1); got {test_fraction}")
    if part not in ("train", "test"):
        raise ValueError(f"split part must be 'train' or 'test'; got {part!r}")

    def in_test(p: Prompt) -> bool:
        return int(hashlib.sha256(p.text.encode("utf-8")).hexdigest()[:12], 16) / 16**12 < test_fraction

    chosen = [p for p in prompts if in_test(p) == (part == "test")]
    if not chosen:
        raise ValueError(
            f"prompts.test_fraction={test_fraction} leaves the {part} split of {len(prompts)} prompts empty; "
            "change the fraction or add prompts"
        )
    return chosen
