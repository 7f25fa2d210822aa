"""Which run folders the demo may open: only those under the folders it was started with.

``flowrl demo runs/a runs/b`` (or ``flowrl demo`` = the default output folder ``runs/``) fixes the
roots. A path typed into the app is resolved (``..`` and symlinks followed) and accepted only when
it lies under a root; anything else, e.g. ``runs/../../etc``, is refused with one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..comparison.checkpoints import Checkpoint, base_checkpoint, find_runs, run_checkpoints

DEFAULT_RUNS = Path("runs")  # the parent of the default output.dir (runs/digits-bold-thin)


class RunRegistry:
    """The checkpoints the demo offers, and the folders it may read.

    Args:
        roots: run folders or folders of runs; none = :data:`DEFAULT_RUNS` (which may not exist yet).
        base_model: the model offered as "base" when no run is found (default: the embedded model).
    """

    def __init__(self, roots: Sequence[str | Path] = (), base_model: str = "flowrl-digits"):
        given = [Path(r) for r in roots] or [DEFAULT_RUNS]
        for root in given:
            if roots and not root.is_dir():
                raise FileNotFoundError(f"{root} is not a folder; pass run folders (or folders of runs) to flowrl demo")
        self.roots = [Path(os.path.realpath(r)) for r in given]
        self.checkpoints: dict[str, Checkpoint] = {}
        for root in self.roots:
            for run in find_runs(root):
                self._add_run(run)
        if not any(c.kind == "base" for c in self.checkpoints.values()):
            self._add(base_checkpoint(base_model))

    def _add(self, checkpoint: Checkpoint) -> None:
        self.checkpoints.setdefault(checkpoint.label, checkpoint)

    def _add_run(self, run: Path) -> list[str]:
        found = run_checkpoints(run, label=self._label(run))
        for c in found:
            self._add(base_checkpoint(c.model_path, c.run_dir))
        bases = [c for c in self.checkpoints.values() if c.kind == "base"]
        rest = [c for c in self.checkpoints.values() if c.kind != "base"] + [c for c in found]
        self.checkpoints = {c.label: c for c in [*bases, *rest]}
        return [c.label for c in found]

    def _label(self, run: Path) -> str:
        """The run's label: its folder name, unique among the offered runs.

        When another run holds the name: its start folder's name and its path under it (``b/run-a``; two
        start folders may each hold a ``run-a``), else its full path.
        """
        taken = {c.label for c in self.checkpoints.values() if c.run_dir is not None and c.run_dir != run}
        under = [str(Path(root.name) / run.relative_to(root)) for root in self.roots if run.is_relative_to(root)]
        for label in [run.name, *under]:
            if label not in taken:
                return label
        return str(run)

    @property
    def labels(self) -> list[str]:
        """Labels of every offered checkpoint, base models first."""
        return list(self.checkpoints)

    @property
    def run_dirs(self) -> list[Path]:
        """The run folders with offered checkpoints."""
        return list(dict.fromkeys(c.run_dir for c in self.checkpoints.values() if c.kind != "base"))

    def resolve(self, path: str) -> Path:
        """A user-typed run path, resolved and checked to lie under a root.

        Raises:
            ValueError: empty, outside every root (path traversal), or not a run folder.
        """
        text = str(path or "").strip()
        if not text or "\x00" in text:
            raise ValueError("run folder: enter a path under the folders the demo was started with")
        candidate = Path(text)
        if not candidate.is_absolute():
            base = self.roots[0] if len(self.roots) == 1 and self.roots[0].is_dir() else Path.cwd()
            candidate = base / candidate
        real = Path(os.path.realpath(candidate))
        if not any(real == root or real.is_relative_to(root) for root in self.roots):
            allowed = ", ".join(str(r) for r in self.roots)
            raise ValueError(
                f"run folder {text!r} is outside the folders this demo was started with ({allowed}); refused"
            )
        try:
            runs = find_runs(real)
        except OSError as err:  # e.g. a name longer than the filesystem allows
            raise ValueError(f"run folder {text[:80]!r}: not a readable path ({err.strerror or err})") from None
        if not runs:
            raise ValueError(f"run folder {text!r} holds no finished run (config.yaml and lora/)")
        return real

    def add(self, path: str) -> list[str]:
        """Offer the checkpoints of the run(s) at a checked path; returns the labels added."""
        added = []
        for run in find_runs(self.resolve(path)):
            added += self._add_run(run)
        return added
