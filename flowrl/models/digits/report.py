"""Style and accuracy report for runs on the embedded model (held-out seeds, ODE sampling).

The accuracy comes from the independent SVC of :mod:`flowrl.models.digits.evaluation`, not from the
reward classifier, so a run cannot "win" the report by fooling its own reward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ...prompts.files import Prompt
from ...rewards.digits import ink_amount
from .evaluation import digit_accuracy
from .prompts import DIGITS_SETS

REPORT_SEED_BASE = 3_000_000
SampleFn = Callable[[Sequence[Prompt], Sequence[int]], Tensor]


def style_report(sample_fn: SampleFn, seeds_per_prompt: int = 10) -> dict[str, float]:
    """Accuracy and ink of bold and thin prompts.

    Args:
        sample_fn: ``(prompts, seeds) -> images (B, 3, 8, 8)`` (e.g. ``Trainer.sample``).
        seeds_per_prompt: samples per prompt (20 prompts: 10 digits x bold/thin).

    Returns:
        ``accuracy`` (SVC, all samples), ``accuracy_bold``, ``accuracy_thin``, ``ink_bold``,
        ``ink_thin`` and ``ink_gap`` (bold minus thin).
    """
    prompts = [p for p in DIGITS_SETS["digits-styles"]() for _ in range(seeds_per_prompt)]
    seeds = [REPORT_SEED_BASE + i % seeds_per_prompt for i in range(len(prompts))]
    images = sample_fn(prompts, seeds)
    labels = torch.tensor([p.metadata["digit"] for p in prompts])
    bold = torch.tensor([p.metadata["style"] == "bold" for p in prompts])
    ink = ink_amount(images)
    out = {
        "accuracy": digit_accuracy(images, labels),
        "accuracy_bold": digit_accuracy(images[bold], labels[bold]),
        "accuracy_thin": digit_accuracy(images[~bold], labels[~bold]),
        "ink_bold": float(ink[bold].mean()),
        "ink_thin": float(ink[~bold].mean()),
    }
    out["ink_gap"] = out["ink_bold"] - out["ink_thin"]
    return out
