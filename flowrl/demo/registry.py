"""Which run folders the demo may open: only those under the folders it was started with.

``flowrl demo runs/a runs/b`` (or ``flowrl demo`` = the default output folder ``runs/``) fixes the
roots. A path typed into the app is resolved (``..`` and symlinks followed) and accepted only when
it lies under a root; anything else, e.g. ``runs/../../etc``, is refused with one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..comparison.checkpoints import Checkpoint, base_checkpoint, find_runs, offer_run, read_run_config
from ..comparison.evaluate import guard_union, reward_union

if TYPE_CHECKING:
    from ..config import Config

DEFAULT_RUNS = Path("runs")  # the parent of the default output.dir (runs/digits-bold-thin)


class RunRegistry:
    """The checkpoints the demo offers, and the folders it may read.

    Every label is distinct (:func:`~flowrl.comparison.checkpoints.offer_run`, as ``flowrl eval`` labels):
    a second run named ``run-a`` is ``other/run-a``, a second model in a folder named ``model`` is
    ``base (m2/model)``. Each run's ``config.yaml`` is read when the run is offered (again when it is added
    again): the rewards and guards every comparison scores with come from those reads, so a run deleted or
    broken later fails only the requests that choose it (:meth:`check_run`).

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
        self.configs: dict[Path, Config] = {}
        for root in self.roots:
            for run in find_runs(root):
                self._add_run(run)
        if not any(c.kind == "base" for c in self.checkpoints.values()):
            base = base_checkpoint(base_model)
            self.checkpoints = {base.label: base}

    def _add_run(self, run: Path) -> list[str]:
        added = offer_run(run, list(self.checkpoints.values()))
        self.configs[run] = read_run_config(run)
        found = [c for c in added if c.kind != "base"]
        bases = [c for c in [*self.checkpoints.values(), *added] if c.kind == "base"]
        rest = [c for c in self.checkpoints.values() if c.kind != "base"] + found
        self.checkpoints = {c.label: c for c in [*bases, *rest]}
        return [c.label for c in found]

    def scoring_spec(self, names: Sequence[str] | None) -> dict[str, dict[str, Any]]:
        """Reward specs for ``names``: the offered runs' options where a run configures the name, else defaults.

        No names: every reward the runs configure (no run: the default job's rewards). The runs' configs are the
        ones read when they were offered, so a run broken since does not change (or fail) anyone's scores.
        """
        from ..config import Config

        if not names and not self.configs:
            return Config().rewards
        return reward_union(list(self.configs.values()), names or None)

    def guard_spec(self) -> dict[str, dict[str, Any]]:
        """The offered runs' guard rewards (``guards:`` entries as reward options; first run wins a name)."""
        return guard_union(list(self.configs.values()))

    def check_run(self, checkpoint: Checkpoint) -> None:
        """Refuse a run's checkpoint whose folder no longer holds a valid ``config.yaml`` (deleted, or broken).

        Raises:
            ValueError: one line naming the checkpoint, its run folder and what to do.
        """
        if checkpoint.kind == "base" or checkpoint.run_dir is None:
            return
        run = checkpoint.run_dir
        try:
            read_run_config(run)
        except FileNotFoundError:
            reason = f"{run} holds no config.yaml any more"
        except (OSError, ValueError) as err:
            reason = (str(err) or type(err).__name__).splitlines()[0]
        else:
            return
        raise ValueError(f"{checkpoint.label}: {reason}; untick its checkpoints, or restore the run folder")

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
