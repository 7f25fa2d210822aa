"""The ``guards:`` config section: one :class:`GuardSpec` per reward-hacking guard, checked.

Parsed by :func:`flowrl.config.load_config` (errors as one ``ConfigError`` line) and by the held-out
evaluation (:mod:`flowrl.evaluation.guard_rewards` tracks them). It imports nothing of flowrl, so
the config can check the section without importing the evaluation package.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
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


def _scorer(label: Any, options: Any) -> tuple[str, str]:
    """What a ``rewards:`` / ``guards:`` entry scores: its factory name and its options (weight, deadline aside)."""
    opts = dict(options) if isinstance(options, Mapping) else {}
    factory = str(opts.pop("reward", label))
    for key in ("weight", "timeout_s"):
        opts.pop(key, None)
    return factory, json.dumps(opts, sort_keys=True, default=str)


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
    trained = {_scorer(label, opts): label for label, opts in rewards.items()} if isinstance(rewards, Mapping) else {}
    for name, entry in section.items():
        entry = {} if entry is None else entry
        if not isinstance(entry, Mapping):
            raise ValueError(f"'guards.{name}' must be a mapping like {{tolerance: 0.05}}; got {entry!r}")
        if name in rewards:
            raise ValueError(
                f"'guards.{name}' is also a trained reward (rewards.{name}); a guard is never trained on: "
                "remove it from one of the two sections"
            )
        same = trained.get(_scorer(name, {k: v for k, v in entry.items() if k not in GUARD_KEYS}))
        if same is not None and name not in MONITORS:
            raise ValueError(
                f"'guards.{name}' scores what the trained reward rewards.{same} scores (same reward and options); "
                "a guard is never trained on: remove it from one of the two sections"
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
