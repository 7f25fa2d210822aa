"""The embedded flowrl-digits model: pipeline, prompt sets, pretraining, evaluation and its style report.

:data:`EVAL_REPORTS` is the seam through which the recipe adds model-specific evaluation figures:
model id (``model.path``) -> ``report(sample_fn) -> {name: value}``, logged as ``eval/<name>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import EMBEDDED

if TYPE_CHECKING:
    from .report import SampleFn

__all__ = ["EVAL_REPORTS", "EvalReport", "style_report"]

EvalReport = Callable[["SampleFn"], dict[str, float]]  # sample_fn (prompts, seeds) -> images  ->  {name: value}


def style_report(sample_fn: SampleFn, seeds_per_prompt: int = 10) -> dict[str, float]:
    """:func:`flowrl.models.digits.report.style_report`, imported on first call (it needs scikit-learn).

    Args:
        sample_fn: ``(prompts, seeds) -> images (B, 3, 8, 8)`` (e.g. ``Trainer.sample``).
        seeds_per_prompt: samples per prompt (20 prompts: 10 digits x bold/thin).

    Returns:
        ``accuracy``, ``accuracy_bold``, ``accuracy_thin``, ``ink_bold``, ``ink_thin``, ``ink_gap``.
    """
    from .report import style_report as report

    return report(sample_fn, seeds_per_prompt)


EVAL_REPORTS: dict[str, EvalReport] = {EMBEDDED: style_report}
