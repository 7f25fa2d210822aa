"""Prompt sets: built-in sets for the embedded model, and prompt files (.txt, .jsonl).

A prompt carries metadata (e.g. ``{"digit": 7, "style": "bold"}``) that is passed through to
rewards as keyword lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor


class Prompt(NamedTuple):
    """One prompt and its per-prompt metadata."""

    text: str
    metadata: dict[str, Any]


def _digits_set(styles: tuple[str | None, ...]) -> list[Prompt]:
    out = []
    for style in styles:
        for digit in range(10):
            word = f"{style} " if style else ""
            out.append(Prompt(f"a {word}handwritten {digit}", {"digit": digit, "style": style}))
    return out


BUILTIN_SETS = {
    "digits-styles": lambda: _digits_set(("bold", "thin")),
    "digits": lambda: _digits_set((None,)),
    "digits-all": lambda: _digits_set((None, "bold", "thin")),
}


def _read_txt(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if "\x00" in line:
            raise ValueError(f"{path} line {number}: contains a NUL byte; prompt files must be UTF-8 text")
        if line.strip():
            prompts.append(Prompt(line.strip(), {}))
    return prompts


def _read_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number}: invalid JSON ({err.msg}); each line must be an object like {{\"prompt\": \"...\"}}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path} line {number}: needs a non-empty string field \"prompt\"")
        text = row.pop("prompt").strip()
        prompts.append(Prompt(text, row))
    return prompts


def load_prompts(spec: str) -> list[Prompt]:
    """Load a built-in prompt set by name, or a prompt file.

    Args:
        spec: a built-in name (``digits-styles``, ``digits``, ``digits-all``) or a path to a
            ``.txt`` (one prompt per line) or ``.jsonl`` (objects with a ``"prompt"`` field plus
            metadata) file.

    Returns:
        A non-empty list of prompts.

    Raises:
        ValueError: unknown set, missing file, or a malformed line (file and line number named).
    """
    if spec in BUILTIN_SETS:
        return BUILTIN_SETS[spec]()
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(BUILTIN_SETS)
        raise ValueError(f"prompt set {spec!r} is neither a built-in set ({names}) nor an existing .txt/.jsonl file")
    try:
        if path.suffix == ".jsonl":
            prompts = _read_jsonl(path)
        elif path.suffix == ".txt":
            prompts = _read_txt(path)
        else:
            raise ValueError(f"prompt file {path} must end in .txt or .jsonl")
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {err.start}); re-save it as UTF-8") from None
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts; add at least one non-empty line")
    return prompts


class PromptBatch(NamedTuple):
    """Prompts for one iteration: each chosen prompt repeated ``group_size`` times consecutively.

    Attributes:
        texts: B prompt strings.
        metadata: key -> B values (None where a prompt lacks the key).
        group_ids: (B,) int64 group index.
    """

    texts: list[str]
    metadata: dict[str, list[Any]]
    group_ids: Tensor


def collate(prompts: list[Prompt], repeats: int = 1) -> PromptBatch:
    """Repeat each prompt ``repeats`` times and gather metadata into per-key lists."""
    texts, groups, rows = [], [], []
    for g, prompt in enumerate(prompts):
        for _ in range(repeats):
            texts.append(prompt.text)
            groups.append(g)
            rows.append(prompt.metadata)
    keys = sorted({k for row in rows for k in row})
    metadata = {k: [row.get(k) for row in rows] for k in keys}
    return PromptBatch(texts, metadata, torch.tensor(groups, dtype=torch.long))


def sample_groups(prompts: list[Prompt], per_iteration: int, group_size: int, generator: torch.Generator) -> PromptBatch:
    """Draw ``per_iteration`` prompts (without replacement while possible) and repeat each K times."""
    picks: list[int] = []
    while len(picks) < per_iteration:
        perm = torch.randperm(len(prompts), generator=generator).tolist()
        picks.extend(perm[: per_iteration - len(picks)])
    return collate([prompts[i] for i in picks], group_size)
