"""The embedded model's built-in prompt sets, served by :func:`flowrl.prompts.sets.load_prompts`.

Every prompt is :func:`~flowrl.models.digits.model.digits_prompt` of a digit and a style, with
metadata ``{"digit": d, "style": s}`` (the ``ink`` and ``digit_correctness`` rewards read it);
the order is style-major, digits 0..9 within each style.
"""

from __future__ import annotations

from typing import Callable

from ...prompts.files import Prompt
from .model import digits_prompt

__all__ = ["DIGITS_SETS", "digits_set"]


def digits_set(styles: tuple[str | None, ...]) -> list[Prompt]:
    """Prompts for digits 0..9 in each of ``styles``.

    Args:
        styles: styles in order; None is the plain "a handwritten d".

    Returns:
        ``10 * len(styles)`` prompts, style-major.

    Raises:
        ValueError: a style other than None, "bold" or "thin".
    """
    return [
        Prompt(digits_prompt(digit, style), {"digit": digit, "style": style}) for style in styles for digit in range(10)
    ]


DIGITS_SETS: dict[str, Callable[[], list[Prompt]]] = {
    "digits-styles": lambda: digits_set(("bold", "thin")),
    "digits": lambda: digits_set((None,)),
    "digits-all": lambda: digits_set((None, "bold", "thin")),
}
