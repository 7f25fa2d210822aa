"""Alignment of a digits run judged by the independent reader: base vs trained, held-out seeds, new phrasings.

Usage: ``python -m bench.alignment --run RUN_DIR [--seeds 20] [--grids DIR]``.

Both models load as a new user would load them: the shipped ``flowrl-digits`` folder with
diffusers' ``StableDiffusion3Pipeline`` and the run's ``lora/pytorch_lora_weights.safetensors``
through ``load_lora_weights``. Sampling is the pipeline's own Euler ODE (10 steps, no CFG) on seeds
the run never used (5,000,000 + i). Rows: the trained phrasing ("a bold handwritten 3") and new
phrasings ("the bold number 3", "a thin digit 3"), 20 prompts each. Columns: the independent
reader's accuracy (:mod:`flowrl.models.digits.reader`) overall / bold / thin, the reference SVC's,
the reader's mean top probability, the mean ink per style and its gap, the thin samples' brightest
pixel and the share of them dimmed below 0.75 (every real digit's brightest pixel is at least 0.875),
and the mean per-prompt diversity
(:func:`flowrl.evaluation.prompt_diversity`) with the share of the base model's kept.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

SEED_BASE = 5_000_000
DIM_PEAK = 0.75  # a brightest pixel below this: dimmed (no real digit in the data has one below 0.875)
PHRASINGS = {
    "trained": ("a bold handwritten {d}", "a thin handwritten {d}"),
    "new": ("the bold number {d}", "a thin digit {d}"),
}


def _pipeline(run: Path | None) -> Any:
    from diffusers import StableDiffusion3Pipeline

    from flowrl.models.digits.model import DIGITS_DIR

    pipe = StableDiffusion3Pipeline.from_pretrained(str(DIGITS_DIR), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if run is not None:
        pipe.load_lora_weights(str(run / "lora"), weight_name="pytorch_lora_weights.safetensors")
    return pipe


def measure(pipe: Any, phrasing: tuple[str, str], seeds: int) -> tuple[dict[str, float], torch.Tensor]:
    """Sample 10 digits x 2 styles x ``seeds`` and judge them: (figures, images (N, 3, H, W))."""
    from bench.convergence import reader_figures
    from flowrl.evaluation import prompt_diversity
    from flowrl.models.digits.evaluation import digit_accuracy, sample_digits_with_pipeline

    prompts, labels, styles = [], [], []
    for style, template in zip(("bold", "thin"), phrasing):
        for d in range(10):
            prompts += [template.format(d=d)] * seeds
            labels += [d] * seeds
            styles += [style] * seeds
    images = sample_digits_with_pipeline(pipe, prompts, [SEED_BASE + i % seeds for i in range(len(prompts))])
    figures = reader_figures(images, {"digit": labels, "style": styles})
    figures["svc"] = digit_accuracy(images, torch.tensor(labels))
    figures["diversity"] = float(prompt_diversity(images, torch.arange(len(prompts)) // seeds).mean())
    thin = torch.tensor([s == "thin" for s in styles])
    peak = images.float().mean(dim=1).flatten(1).amax(dim=1)  # real digits: 1.0 for >= 95 % of thin and bold ones
    figures["dim_thin"] = float((peak[thin] < DIM_PEAK).float().mean())
    figures["peak_thin"] = float(peak[thin].mean())
    return figures, images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a run folder with lora/")
    parser.add_argument("--seeds", type=int, default=20, help="held-out seeds per prompt")
    parser.add_argument("--grids", type=Path, default=None, help="write one PNG grid per model and phrasing here")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from flowrl.models.digits.evaluation import save_digit_grid

    start = time.perf_counter()
    pipes = {"base": _pipeline(None), "trained": _pipeline(args.run)}
    print(
        "| prompts | model | reader all | bold | thin | reader conf. | SVC | ink bold | ink thin | ink gap "
        "| thin peak | thin dimmed | diversity | kept |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for phrase, templates in PHRASINGS.items():
        base_div = None
        for name, pipe in pipes.items():
            f, images = measure(pipe, templates, args.seeds)
            base_div = f["diversity"] if base_div is None else base_div
            print(
                f"| {phrase} | {name} | {100 * f['reader']:.1f} % | {100 * f['reader_bold']:.1f} % | "
                f"{100 * f['reader_thin']:.1f} % | {f['confidence']:.3f} | {100 * f['svc']:.1f} % | "
                f"{f['ink_bold']:.3f} | {f['ink_thin']:.3f} | {f['ink_gap']:.3f} | {f['peak_thin']:.3f} | "
                f"{100 * f['dim_thin']:.1f} % | {f['diversity']:.4f} | "
                f"{100 * f['diversity'] / base_div:.1f} % |"
            )
            if args.grids is not None:
                args.grids.mkdir(parents=True, exist_ok=True)
                save_digit_grid(images, args.grids / f"{phrase}-{name}.png", rows=20)
    print(f"({args.seeds} seeds per prompt, 20 prompts per row; {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
