"""Prompt files: plain text, JSONL, CSV and JSON lists, and dataset folders with train/test splits.

The formats the reference prompt sets use load as they are:

* plain text, one prompt per line (PickScore, HPDv2 lists, DrawBench-style files); a line with a
  double-quoted span (Flow-GRPO's OCR prompts, e.g. ``A sign that says "OPEN"``) gets the quoted
  text as ``ocr_text`` metadata;
* JSONL objects with a ``"prompt"`` field; every other field is per-prompt metadata (GenEval's
  ``{"tag": ..., "include": [...], "prompt": ...}`` lines pass ``tag`` and ``include`` on);
* CSV with a header row and a ``prompt`` column; other columns are metadata (strings);
* JSON: a list of strings, or a list of objects with a ``"prompt"`` field (HPDv2's per-style
  ``anime.json`` ... lists);
* a folder holding ``train.*`` and ``test.*`` files (or GenEval's ``train_metadata.jsonl`` /
  ``test_metadata.jsonl``), as Flow-GRPO's ``dataset/<name>/`` folders.

Every malformed line is reported as one ``ValueError`` naming the file and the line number.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

SUFFIXES = (".txt", ".jsonl", ".csv", ".json")
SPLIT_NAMES = {"train": ("train",), "test": ("test", "eval", "val", "validation")}
_QUOTED = re.compile(r"[\"\u201c\u201d]([^\"\u201c\u201d]+)[\"\u201c\u201d]")


class Prompt(NamedTuple):
    """One prompt and its per-prompt metadata."""

    text: str
    metadata: dict[str, Any]


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of a prompt (straight or curly quotes), or None."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


def _check_text(path: Path, number: int, line: str) -> None:
    if "\x00" in line:
        raise ValueError(f"{path} line {number}: contains a NUL byte; prompt files must be UTF-8 text")


def read_txt(path: Path) -> list[Prompt]:
    """One prompt per non-empty line; quoted text becomes ``ocr_text`` metadata."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        _check_text(path, number, line)
        text = line.strip()
        if text:
            target = quoted_text(text)
            prompts.append(Prompt(text, {"ocr_text": target} if target is not None else {}))
    return prompts


def _row_prompt(row: Any, where: str) -> Prompt:
    """A JSON object (or string) -> Prompt; the rest of the object is metadata."""
    if isinstance(row, str) and row.strip():
        return Prompt(row.strip(), {})
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise ValueError(f'{where}: needs a non-empty string field "prompt" (e.g. {{"prompt": "a cat"}})')
    meta = dict(row)
    return Prompt(meta.pop("prompt").strip(), meta)


def read_jsonl(path: Path) -> list[Prompt]:
    """One JSON object per line with a ``"prompt"`` field plus metadata."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        _check_text(path, number, line)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f'{path} line {number}: invalid JSON ({err.msg}); each line must be an object like {{"prompt": "..."}}'
            ) from None
        if isinstance(row, str):
            raise ValueError(f'{path} line {number}: needs a non-empty string field "prompt"; got a bare string')
        prompts.append(_row_prompt(row, f"{path} line {number}"))
    return prompts


def read_csv(path: Path) -> list[Prompt]:
    """CSV with a header row holding a ``prompt`` column; other columns become string metadata."""
    text = path.read_text(encoding="utf-8-sig")
    if "\x00" in text:
        raise ValueError(f"{path}: contains a NUL byte; prompt files must be UTF-8 text")
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header or "prompt" not in [h.strip() for h in header]:
        raise ValueError(f"{path} line 1: the header row must name a 'prompt' column; got {header!r}")
    header = [h.strip() for h in header]
    prompts = []
    for row in reader:
        number = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise ValueError(
                f"{path} line {number}: has {len(row)} fields but the header has {len(header)}; "
                "quote fields that contain commas"
            )
        record = dict(zip(header, row))
        text = record.pop("prompt").strip()
        if not text:
            raise ValueError(f"{path} line {number}: the 'prompt' field is empty")
        prompts.append(Prompt(text, {k: v for k, v in record.items() if k}))
    return prompts


def read_json(path: Path) -> list[Prompt]:
    """A JSON list of prompt strings or of objects with a ``"prompt"`` field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} line {err.lineno}: invalid JSON ({err.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("prompts"), list):
        data = data["prompts"]
    if not isinstance(data, list):
        raise ValueError(f'{path}: must hold a JSON list of prompts (strings or {{"prompt": ...}} objects)')
    return [_row_prompt(row, f"{path} item {i}") for i, row in enumerate(data)]


READERS = {".txt": read_txt, ".jsonl": read_jsonl, ".csv": read_csv, ".json": read_json}


def split_file(folder: Path, split: str) -> Path:
    """The file of a dataset folder that holds ``split`` ("train" or "test").

    Raises:
        FileNotFoundError: no such file in the folder (the names looked for are listed).
    """
    if split not in SPLIT_NAMES:
        raise ValueError(f"prompt split must be 'train' or 'test'; got {split!r}")
    candidates = [f"{name}{suffix}" for name in SPLIT_NAMES[split] for suffix in SUFFIXES]
    candidates += [f"{name}_metadata.jsonl" for name in SPLIT_NAMES[split]]
    for name in candidates:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"prompt folder {folder} has no {split} file; add one of {', '.join(candidates[:5])}, ...")


def read_prompt_file(path: Path) -> list[Prompt]:
    """Read one prompt file by its suffix.

    Raises:
        ValueError: unknown suffix, not UTF-8, no prompts, or a malformed line (file and line named).
    """
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"prompt file {path} must end in .txt, .jsonl, .csv or .json")
    try:
        prompts = reader(path)
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt file {path} is not UTF-8 text (byte {err.start}); re-save it as UTF-8") from None
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts; add at least one non-empty line")
    return prompts
