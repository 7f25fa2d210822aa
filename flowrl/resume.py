"""Resuming a run: the latest checkpoint that verifies, pruning old ones, and the config fingerprint.

``flowrl train --resume PATH`` takes a run folder (its newest checkpoint that passes
:func:`flowrl.checkpoint.load_checkpoint`, falling back with a warning over the ones that do not),
its ``checkpoints/`` folder or one checkpoint. The config stored in a checkpoint is compared with
the new one: only :data:`RESUMABLE_KEYS` may differ. docs/reliability.md has the rules.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from .checkpoint import CHECKPOINT_NAME, MANIFEST, CheckpointError, load_checkpoint
from .outputs import RUN_MARKERS, read_metrics, resume_run_dir

# config keys that may differ on resume: they change neither the training trajectory nor what a
# logged metric means (docs/reliability.md); a key ending in "." covers its whole section, "*" one name
RESUMABLE_KEYS = (
    "train.iterations",
    "train.time_budget_s",
    "train.max_skipped_updates",
    "train.eval_every",
    "train.save_every",
    "train.progress",
    "train.threads",
    "train.rewards_async",
    "train.collective_timeout_s",  # how long ranks wait for each other, not what they compute
    "train.sharding",  # the checkpoint holds one process's full tensors whatever the sharding (docs/scale-out.md)
    "prompts.cache_dir",
    "memory.gradient_checkpointing",
    "memory.offload_encoders",
    "memory.offload_vae",
    "memory.free_encoders_when_cached",
    "output.",
    "guards.*.tolerance",  # a guard's verdict, not what it measures ("*": any guard's name)
    "guards.*.relative",
    "guards.*.on_trip",
    "rewards.*.timeout_s",  # how long a reward call may take (the deadline error says to raise it)
    "rewards.*.retries",  # a remote reward's client: how it talks to the server, not what it scores
    "rewards.*.backoff_s",
    "rewards.*.url",
)


class Resume(NamedTuple):
    """The checkpoint a run resumes from: its folder, its loaded state and the warnings on the way."""

    path: Path
    state: dict[str, Any]
    warnings: list[str]


def checkpoint_folders(run_dir: str | Path) -> list[Path]:
    """The ``checkpoints/iter-N`` folders of a run, newest first (``.partial`` folders are skipped).

    Args:
        run_dir: a run folder.

    Returns:
        Paths sorted by iteration, descending; empty when there is no ``checkpoints/`` folder.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def latest_good_checkpoint(run_dir: str | Path) -> Resume:
    """The newest checkpoint of a run that verifies, falling back over the ones that do not.

    A checkpoint past the last step in the run's ``metrics.jsonl`` is skipped: a resume from an earlier
    checkpoint cut the metrics back to it and stopped before it replaced that checkpoint, so continuing
    from it would leave a gap in the metrics.

    Args:
        run_dir: a run folder (its ``checkpoints/iter-N`` folders are tried newest first).

    Returns:
        The chosen folder, its loaded state, and one warning line per newer checkpoint skipped
        (naming it and why).

    Raises:
        FileNotFoundError: the run has no checkpoint folder.
        ValueError: no checkpoint verifies (one line naming the newest and why it failed).
    """
    folders = checkpoint_folders(run_dir)
    if not folders:
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoints/iter-N folder there; start a new run")
    warnings: list[str] = []
    logged = [step for step, _ in read_metrics(Path(run_dir) / "metrics.jsonl")]
    last = max(logged) if logged else None  # every checkpoint's step is logged before the checkpoint is written
    past = 0  # checkpoints skipped for being past the last logged step
    for folder in folders:
        if last is not None and int(folder.name.removeprefix("iter-")) > last:
            past += 1
            warnings.append(
                f"checkpoint {folder}: past the run's last logged step {last} (left by a resume from an earlier "
                "checkpoint that stopped before it got there); trying the previous one"
            )
            continue
        try:
            return Resume(folder, load_checkpoint(folder), warnings)
        except CheckpointError as err:
            warnings.append(f"checkpoint {folder}: {err.reason}; trying the previous one")
    if past == len(folders):
        raise ValueError(
            f"--resume {run_dir}: its metrics.jsonl ends at step {last}, before every checkpoint (newest "
            f"{folders[0].name}): rows were lost (truncated or edited); restore metrics.jsonl, or resume from one "
            f"checkpoint folder ({folders[0]}), leaving the missing rows missing"
        )
    first = warnings[0].removesuffix("; trying the previous one")
    raise ValueError(
        f"--resume {run_dir}: none of its {len(folders)} checkpoints verifies (newest: {first}); start a new run"
    )


def check_resume_path(path: str | Path) -> Path:
    """``--resume PATH`` as a path that exists (checked before anything else: a typo is named as one).

    Raises:
        ValueError: an empty path (an unset shell variable would start a fresh run).
        FileNotFoundError: no such file or folder.
    """
    if not str(path).strip():
        raise ValueError("--resume must name a run folder or one of its checkpoints/iter-N; got an empty string")
    if not Path(path).exists():
        raise FileNotFoundError(f"--resume {path}: no such folder; pass a run folder or one of its checkpoints/iter-N")
    return Path(path)


def find_resume(path: str | Path) -> Resume:
    """The checkpoint ``flowrl train --resume PATH`` continues from.

    Args:
        path: a run folder (its latest checkpoint that verifies, see :func:`latest_good_checkpoint`),
            its ``checkpoints/`` folder, or one checkpoint folder (used as is, no fallback).

    Returns:
        The checkpoint folder, its state and the fallback warnings.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no checkpoint.
        ValueError: the checkpoint (or every checkpoint of the run) fails verification, or the run's
            ``metrics.jsonl`` holds a line that is not a row (:func:`flowrl.outputs.read_metrics`).
    """
    path = check_resume_path(path)
    if not (path / MANIFEST).exists():
        if (path / "checkpoints").is_dir() or any((path / name).exists() for name in RUN_MARKERS):
            return latest_good_checkpoint(path)
        if path.name == "checkpoints":
            return latest_good_checkpoint(path.parent)
    run = resume_run_dir(path)
    warnings = []
    if run is not None:  # the resume rewrites its metrics: a bad row fails now, before the model loads
        last = max((step for step, _ in read_metrics(run / "metrics.jsonl")), default=None)
        step = int(named.group(1)) if (named := CHECKPOINT_NAME.fullmatch(path.name)) else None
        if last is not None and step is not None and last < step:
            warnings.append(
                f"{run / 'metrics.jsonl'} ends at step {last}, before this checkpoint's {step}: the run's "
                f"metrics will have no rows from {last + 1} to {step}"
            )
    return Resume(path, load_checkpoint(path), warnings)


def prune_checkpoints(run_dir: str | Path, keep: int, upto: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints at or below iteration ``upto``.

    Checkpoints above ``upto`` (left by a run that was resumed from an earlier one) are kept: the
    run replaces them when it gets there.

    Args:
        run_dir: the run folder.
        keep: how many to keep (``output.keep_checkpoints``, >= 1).
        upto: the iteration of the checkpoint just finished.

    Returns:
        The deleted folders.
    """
    older = [p for p in checkpoint_folders(run_dir) if int(p.name.removeprefix("iter-")) <= upto][keep:]
    for folder in older:
        shutil.rmtree(folder)
    return older


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resumable(key: str) -> bool:
    return any(
        key == k or (k.endswith(".") and key.startswith(k)) or ("*" in k and fnmatch.fnmatchcase(key, k))
        for k in RESUMABLE_KEYS
    )


def _key_defaults() -> dict[str, Any]:
    """Default of every dataclass key: a key added to flowrl after a checkpoint was written compares as its default."""
    from .config import Config, to_dict

    defaults = _flatten(json.loads(json.dumps(to_dict(Config()))))
    return {k: v for k, v in defaults.items() if not k.startswith(("rewards.", "objective.")) and k != "guards"}


_ENTRY_SECTIONS = {"rewards": "reward", "guards": "guard"}
"""Sections whose entries are named by the user: an entry added or removed is refused whole, even when every
key it holds is resumable (``rewards.*.timeout_s`` alone made a new trained reward of weight 1)."""


def _check_same_entries(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume that adds or removes a reward or a guard (a section the checkpoint lacks is not compared).

    Raises:
        ValueError: one line naming the entry, whether it was added or removed, and the fix.
    """
    for section, what in _ENTRY_SECTIONS.items():
        if not isinstance(saved.get(section), dict) or not isinstance(current.get(section), dict):
            continue
        was, now = list(saved[section]), list(current[section])
        added, removed = [k for k in now if k not in was], [k for k in was if k not in now]
        for names, how in ((added, "added"), (removed, "removed")):
            if names:
                raise ValueError(
                    f"--resume: {what} {names[0]!r} ({section}.{names[0]}) was {how} since the checkpoint was "
                    f"written; it changes what the run trains or logs: resume with the checkpoint's {section} "
                    "or start a new run"
                )


def check_resume_config(saved: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """Refuse a resume whose config differs from the checkpoint's in a key outside :data:`RESUMABLE_KEYS`.

    A key the stored config lacks (added to flowrl later) compares as its default; the
    ``rewards`` and ``objective`` sections compare as they are.

    Args:
        saved: the config stored in the checkpoint (None for one written without it: no check).
        current: the new run's config, as :func:`flowrl.config.to_dict` gives it.

    Raises:
        ValueError: one line naming a reward or guard added or removed (:func:`_check_same_entries`), or
            the first changed key with its old and new value.
    """
    if saved is None:
        return
    _check_same_entries(saved, current)
    old, new = _key_defaults(), _flatten(json.loads(json.dumps(current)))
    old.update(_flatten(saved))
    absent = object()
    keys = list(new) + [k for k in old if k not in new]
    changed = [k for k in keys if old.get(k, absent) != new.get(k, absent) and not _resumable(k)]
    if not changed:
        return
    key, more = changed[0], f" ({len(changed) - 1} more keys changed)" if len(changed) > 1 else ""

    def show(values: dict[str, Any]) -> str:
        return json.dumps(values[key]) if key in values else "(absent)"

    raise ValueError(
        f"--resume: {key} changed from {show(old)} to {show(new)} since the checkpoint was written{more}; "
        "resume with the same value or start a new run"
    )
