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
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

GUARD_KEYS = ("tolerance", "relative", "on_trip")
MONITORS = ("diversity",)  # guard names measured by flowrl.evaluation, not by a reward
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class GuardSpec:
    """One guard of the config's ``guards:`` section.

    Attributes:
        name: the reward's label (or a monitor name from :data:`MONITORS`).
        tolerance: how far below its best the guard may fall (>= 0).
        relative: ``tolerance`` is a share of ``|best|`` rather than an absolute amount.
        on_trip: "warn" (one line) or "stop" (one line, then the run stops).
        options: the reward's options (as a ``rewards:`` entry, without ``weight``).
    """

    name: str
    tolerance: float = DEFAULT_TOLERANCE
    relative: bool = False
    on_trip: Literal["warn", "stop"] = "warn"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_monitor(self) -> bool:
        """True for a monitor (``diversity``), which no reward scores."""
        return self.name in MONITORS

    def allowed_fall(self, best: float) -> float:
        """The largest fall from ``best`` that does not trip: ``tolerance`` or ``tolerance * |best|``."""
        return self.tolerance * abs(best) if self.relative else self.tolerance


def parse_guards(section: Mapping[str, Any], rewards: Mapping[str, Any] = ()) -> list[GuardSpec]:
    """Check the ``guards:`` section and split each entry into guard keys and reward options.

    Args:
        section: ``{name: {tolerance, relative, on_trip, **reward options}}``.
        rewards: the trained rewards' section; a guard must not be one of them.

    Returns:
        One :class:`GuardSpec` per entry, in order.

    Raises:
        ValueError: one line naming the guard key and what is allowed.
    """
    specs = []
    for name, entry in section.items():
        entry = {} if entry is None else entry
        if not isinstance(entry, Mapping):
            raise ValueError(f"'guards.{name}' must be a mapping like {{tolerance: 0.05}}; got {entry!r}")
        if name in rewards:
            raise ValueError(
                f"'guards.{name}' is also a trained reward (rewards.{name}); a guard is never trained on: "
                "remove it from one of the two sections, or give the guard another label with `reward: <name>`"
            )
        options = dict(entry)
        if "weight" in options:
            raise ValueError(f"'guards.{name}.weight' has no meaning: guards are scored, never trained on; remove it")
        tolerance = options.pop("tolerance", DEFAULT_TOLERANCE)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance):
            raise ValueError(f"'guards.{name}.tolerance' must be a finite number >= 0; got {tolerance!r}")
        if tolerance < 0:
            raise ValueError(f"'guards.{name}.tolerance' must be >= 0; got {tolerance!r}")
        relative = options.pop("relative", False)
        if not isinstance(relative, bool):
            raise ValueError(f"'guards.{name}.relative' must be true or false; got {relative!r}")
        on_trip = options.pop("on_trip", "warn")
        if on_trip not in ("warn", "stop"):
            raise ValueError(f"'guards.{name}.on_trip' must be one of 'warn', 'stop'; got {on_trip!r}")
        if name in MONITORS and options:
            raise ValueError(
                f"'guards.{name}' is a monitor and takes only {', '.join(GUARD_KEYS)}; got {', '.join(options)}"
            )
        specs.append(GuardSpec(str(name), float(tolerance), relative, on_trip, options))
    return specs


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
        self.tripped: set[str] = set()  # guards past their tolerance at the last evaluation
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
            if fallen and reward > best.reward:
                if name not in self.tripped:
                    trip = Trip(name, best.value, best.iteration, value, iteration, spec.on_trip)
                    new.append(trip)
                    self.trips.append(trip)
                self.tripped.add(name)
            else:
                self.tripped.discard(name)
        if healthy:
            self.kept_iteration = iteration
        return new, healthy

    def metrics(self) -> dict[str, float]:
        """``guard/<name>_best`` of every guard seen and ``guard/tripped`` (guards past tolerance now)."""
        out = {f"guard/{name}_best": b.value for name, b in self.best.items()}
        out["guard/tripped"] = float(len(self.tripped))
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
            "tripped": sorted(self.tripped),
            "trips": [asdict(t) for t in self.trips],
            "kept_iteration": self.kept_iteration,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (guards it does not know start fresh)."""
        self.best = {n: _Best(float(v), int(i), float(r)) for n, (v, i, r) in state.get("best", {}).items()}
        self.tripped = set(state.get("tripped", []))
        self.trips = [Trip(**t) for t in state.get("trips", [])]
        kept = state.get("kept_iteration")
        self.kept_iteration = None if kept is None else int(kept)
