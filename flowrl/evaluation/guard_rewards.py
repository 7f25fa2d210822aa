"""Reward-hacking guards: rewards (and monitors) watched on held-out samples, never trained on.

A guard is a registered reward (or the ``diversity`` monitor) evaluated at each held-out
evaluation. Its best value is tracked; a guard *trips* when it has fallen from its best by more
than its tolerance while the trained reward has risen above its value at the guard's best::

    fallen  = best - value > tolerance             (relative: tolerance * |best|)
    rising  = reward_now > reward_at_best
    trip    = fallen and rising

A trip prints one warning line; a guard with ``on_trip: stop`` also stops the run. The newest
evaluation at which no guard had fallen past its tolerance is the one whose LoRA a run keeps
(``checkpoints/best-guard/``). docs/alignment.md ("Guards and trust regions") has the config.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from ..guard_spec import DEFAULT_TOLERANCE, GUARD_KEYS, MONITORS, GuardSpec, parse_guards

__all__ = ["DEFAULT_TOLERANCE", "GUARD_KEYS", "MONITORS", "GuardSpec", "GuardTracker", "Trip", "parse_guards"]


@dataclass(frozen=True)
class Trip:
    """A guard that fell past its tolerance while the trained reward rose."""

    name: str
    best: float
    best_iteration: int
    value: float
    iteration: int
    on_trip: str

    def message(self) -> str:
        """The one warning line."""
        action = "stopping the run" if self.on_trip == "stop" else "warning only (guards.<name>.on_trip: stop stops)"
        return (
            f"guard {self.name!r} fell from its best {self.best:.4g} (iteration {self.best_iteration}) to "
            f"{self.value:.4g} at iteration {self.iteration} while the trained reward rose: reward hacking? "
            f"{action}"
        )


@dataclass
class _Best:
    value: float
    iteration: int
    reward: float


class GuardTracker:
    """Best value of each guard, trips, and the newest evaluation that every guard vouches for.

    Args:
        specs: the guards (:func:`parse_guards`).
    """

    def __init__(self, specs: list[GuardSpec]):
        self.specs = {s.name: s for s in specs}
        self.best: dict[str, _Best] = {}
        self.fallen: set[str] = set()  # guards past their tolerance at the last evaluation
        self.tripped: set[str] = set()  # fallen guards that tripped since they last were within tolerance
        self.trips: list[Trip] = []  # every trip so far (a guard trips again only after it recovers)
        self.kept_iteration: int | None = None  # newest evaluation with every guard within tolerance

    def update(self, iteration: int, values: Mapping[str, float], reward: float) -> tuple[list[Trip], bool]:
        """Record one evaluation.

        Args:
            iteration: the training iteration evaluated.
            values: guard name -> its mean on the held-out samples (NaN: not measured, skipped).
            reward: the trained reward's held-out mean at this evaluation.

        Returns:
            (the guards that tripped now, whether every guard is within its tolerance of its best).
        """
        new, healthy = [], True
        for name, spec in self.specs.items():
            value = float(values.get(name, math.nan))
            if not math.isfinite(value):
                continue
            best = self.best.get(name)
            if best is None or value > best.value:
                best = self.best[name] = _Best(value, iteration, reward)
            fallen = best.value - value > spec.allowed_fall(best.value)
            healthy = healthy and not fallen
            if not fallen:  # recovered: a later fall may trip again
                self.fallen.discard(name)
                self.tripped.discard(name)
                continue
            self.fallen.add(name)
            if reward > best.reward and name not in self.tripped:  # fell while the trained reward rose
                trip = Trip(name, best.value, best.iteration, value, iteration, spec.on_trip)
                new.append(trip)
                self.trips.append(trip)
                self.tripped.add(name)
        if healthy:
            self.kept_iteration = iteration
        return new, healthy

    def metrics(self) -> dict[str, float]:
        """``guard/<name>_best`` of every guard seen and ``guard/tripped`` (guards past tolerance now)."""
        out = {f"guard/{name}_best": b.value for name, b in self.best.items()}
        out["guard/tripped"] = float(len(self.fallen))
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-ready: each guard's best (value, iteration), the trips and the kept evaluation."""
        return {
            "best": {n: {"value": b.value, "iteration": b.iteration} for n, b in self.best.items()},
            "trips": [asdict(t) for t in self.trips],
            "kept_iteration": self.kept_iteration,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to go on tracking (plain numbers and strings)."""
        return {
            "best": {n: [b.value, b.iteration, b.reward] for n, b in self.best.items()},
            "fallen": sorted(self.fallen),
            "tripped": sorted(self.tripped),
            "trips": [asdict(t) for t in self.trips],
            "kept_iteration": self.kept_iteration,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (guards it does not know start fresh)."""
        self.best = {n: _Best(float(v), int(i), float(r)) for n, (v, i, r) in state.get("best", {}).items()}
        self.tripped = set(state.get("tripped", []))
        self.fallen = set(state.get("fallen", self.tripped))  # older checkpoints: their tripped guards had fallen
        self.trips = [Trip(**t) for t in state.get("trips", [])]
        kept = state.get("kept_iteration")
        self.kept_iteration = None if kept is None else int(kept)
