"""Bounds of a demo request: prompt length, seed count and range, steps, guidance, sampler.

Every check raises one ``ValueError`` line naming the field, the bound and the value; the app
shows it as a visible error message (``gr.Error``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_PROMPT_CHARS = 300
MAX_SEEDS = 8
MAX_SEED = 2**31 - 1
MAX_STEPS = 100
MAX_GUIDANCE = 30.0
MAX_NOISE_LEVEL = 2.0
_SEED_ITEM = re.compile(r"^(\d{1,12})(?:\s*-\s*(\d{1,12}))?$")  # 12 digits: past MAX_SEED, below int()'s limit


@dataclass(frozen=True)
class Request:
    """One validated comparison request.

    Attributes:
        prompt: the prompt, stripped.
        seeds: the seeds, each used for every checkpoint.
        sampler: "ode" or an SDE step name of :data:`flowrl.samplers.SDE_STEPS`.
        steps: sampling steps.
        guidance: true-CFG weight (1 = off).
        noise_level: the SDE noise level ``a`` (unused by the ODE).
        checkpoints: labels of the checkpoints to compare.
    """

    prompt: str
    seeds: tuple[int, ...]
    sampler: str
    steps: int
    guidance: float
    noise_level: float
    checkpoints: tuple[str, ...]


def samplers() -> list[str]:
    """The sampler choices: the ODE, then every SDE step by name."""
    from ..samplers import SDE_STEPS

    return ["ode", *SDE_STEPS]


def parse_seeds(text: str) -> tuple[int, ...]:
    """Seeds from "0, 1, 2" or ranges "0-3" (inclusive); at most :data:`MAX_SEEDS`, each in [0, MAX_SEED].

    Raises:
        ValueError: an item that is not a non-negative integer or range, too many seeds, or a seed out of range.
    """
    seeds: list[int] = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        m = _SEED_ITEM.match(item)
        if m is None:
            raise ValueError(f"seeds: {item!r} is not a seed; write non-negative integers or ranges, e.g. 0, 1, 5-7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if max(lo, hi) > MAX_SEED:
            raise ValueError(f"seeds: {max(lo, hi)} is out of range; seeds must be between 0 and {MAX_SEED}")
        if hi < lo:
            raise ValueError(f"seeds: range {item!r} runs backwards; write it as {hi}-{lo}")
        if hi - lo + 1 + len(seeds) > MAX_SEEDS:
            raise ValueError(f"seeds: at most {MAX_SEEDS} seeds per comparison; got more in {text!r}")
        seeds.extend(range(lo, hi + 1))
    if not seeds:
        raise ValueError("seeds: give at least one seed, e.g. 0, 1, 2, 3")
    return tuple(dict.fromkeys(seeds))


def _number(value: object, name: str) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number; got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return x


def validate_request(
    prompt: object,
    seeds: object,
    sampler: object,
    steps: object,
    guidance: object,
    noise_level: object,
    checkpoints: object,
    known: list[str],
) -> Request:
    """Check the raw inputs of the compare form.

    Args:
        prompt: the prompt text (1..MAX_PROMPT_CHARS characters after stripping).
        seeds: the seeds text (see :func:`parse_seeds`).
        sampler: "ode" or an SDE name.
        steps: 1..MAX_STEPS (an integer).
        guidance: 0..MAX_GUIDANCE.
        noise_level: 0..MAX_NOISE_LEVEL (at most 1 for the CPS step).
        checkpoints: the selected labels (one or more, each in ``known``).
        known: the labels the demo offers.

    Returns:
        The :class:`Request`.

    Raises:
        ValueError: the first bad field, in one line.
    """
    text = str(prompt or "").strip()
    if not text:
        raise ValueError("prompt: enter a prompt, e.g. 'a bold handwritten 3'")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt: at most {MAX_PROMPT_CHARS} characters; got {len(text)}")
    if "\x00" in text:
        raise ValueError("prompt: holds a NUL character; remove it")
    if not all(c.isprintable() or c.isspace() for c in text):  # control characters, lone surrogates (JSON API)
        raise ValueError("prompt: holds characters that are not text (a control character or lone surrogate)")
    parsed_seeds = parse_seeds(str(seeds or ""))
    if sampler not in samplers():
        raise ValueError(f"sampler must be one of {', '.join(samplers())}; got {sampler!r}")
    n_steps = _number(steps, "steps")
    if n_steps != int(n_steps) or not 1 <= n_steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer between 1 and {MAX_STEPS}; got {steps!r}")
    scale = _number(guidance, "guidance")
    if not 0 <= scale <= MAX_GUIDANCE:
        raise ValueError(f"guidance must be between 0 and {MAX_GUIDANCE:g} (1 = no CFG); got {guidance!r}")
    level = _number(noise_level, "noise level")
    top = 1.0 if sampler == "cps" else MAX_NOISE_LEVEL
    if not 0 <= level <= top:
        raise ValueError(f"noise level must be between 0 and {top:g} for sampler {sampler}; got {noise_level!r}")
    chosen = [checkpoints] if isinstance(checkpoints, str) else list(checkpoints or [])
    if not chosen:
        raise ValueError("checkpoints: select at least one checkpoint to sample")
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ValueError(f"checkpoints: {unknown[0]!r} is not offered; pick from {', '.join(known)}")
    return Request(text, parsed_seeds, str(sampler), int(n_steps), scale, level, tuple(chosen))
