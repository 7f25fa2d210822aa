"""The independent digit reader beside the reward classifier and the SVC, on real and generated digits.

Usage: ``python -m bench.reader [--model DIR] [--seeds 20] [--no-samples] [--grid PNG]``.

Part 1 reads the held-out ``test`` part of the real digits (:mod:`flowrl.rewards.digit_data`),
plain and transformed (:data:`flowrl.models.digits.reader_checks.VARIANTS`, plus the embedded model's own
style data drawn by :func:`flowrl.rewards.stroke.draw_strokes` at a thin and a bold pen), with three
judges: the reader, the ``digit_correctness`` reward classifier (its prediction is the digit whose
prompt it scores highest) and the reference SVC (fed the 8x8 area-pooled gray image). It also
prints each judge's mean top probability on images that show no digit.

Part 2 samples a flowrl-digits pipeline (diffusers' ``StableDiffusion3Pipeline.from_pretrained``;
default: the shipped ``flowrl/assets/flowrl-digits``) with plain, bold and thin prompts, ``--seeds``
seeds per digit, 10 Euler steps, no CFG, and prints each judge's accuracy per style.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

PROMPTS = {"plain": "a handwritten {d}", "bold": "a bold handwritten {d}", "thin": "a thin handwritten {d}"}


def _rgb(images: Tensor) -> Tensor:
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


class Judges:
    """The three readers: predictions (B,) and top probabilities (B,) for images (B, 1 or 3, H, W)."""

    def __init__(self) -> None:
        from flowrl.rewards.digits import digit_correctness

        self.reward = digit_correctness()

    def reader(self, images: Tensor) -> tuple[Tensor, Tensor]:
        from flowrl.models.digits.reader import reader_probabilities, readings

        probs = reader_probabilities(images)
        return readings(probs), probs.max(dim=1).values

    def reward_classifier(self, images: Tensor) -> tuple[Tensor, Tensor]:
        rgb = _rgb(images)
        probs = torch.stack([self.reward(rgb, [f"a handwritten {d}"] * len(rgb)) for d in range(10)], dim=1)
        return probs.argmax(dim=1), probs.max(dim=1).values

    def svc(self, images: Tensor) -> tuple[Tensor, Tensor]:
        from flowrl.models.digits.evaluation import classify_digits

        gray = _rgb(images).float().mean(dim=1, keepdim=True)
        small = F.adaptive_avg_pool2d(gray, 8) if gray.shape[-1] >= 8 else F.interpolate(gray, size=(8, 8))
        return classify_digits(small.expand(-1, 3, -1, -1).contiguous()), torch.full((len(images),), float("nan"))

    def all(self) -> dict:
        return {"reader": self.reader, "reward CNN": self.reward_classifier, "SVC": self.svc}


def real_variants() -> tuple[dict[str, Tensor], Tensor]:
    """The transformed test digits: {name: (N, 1, H, W)} and the labels (N,)."""
    from flowrl.models.digits.reader_checks import VARIANTS, transformed_digits
    from flowrl.rewards.digit_data import digit_part
    from flowrl.rewards.stroke import draw_strokes

    _, images, labels = digit_part("test")
    x8 = torch.as_tensor(images)[:, None]
    out = {name: transformed_digits(x8, name) for name in VARIANTS}
    for name, radius in (("style data thin (pen r 0.75) 16x16", 0.75), ("style data bold (pen r 2.75) 16x16", 2.75)):
        out[name] = draw_strokes(x8[:, 0], torch.full((len(x8),), radius), size=16)[:, None]
    return out, torch.as_tensor(labels)


def svc_overlap() -> int:
    """How many ``test``-part digits the reference SVC was fit on (its split predates the partition)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from flowrl.rewards.digit_data import digit_part

    data = load_digits()
    idx = torch.arange(len(data.target)).numpy()
    fit_idx, _ = train_test_split(idx, train_size=0.75, stratify=data.target, random_state=0)
    return len(set(fit_idx.tolist()) & set(digit_part("test")[0].tolist()))


def real_table(judges: Judges) -> list[str]:
    """Markdown rows: accuracy of each judge on each transformed test set; top probability on no-digit images."""
    from flowrl.models.digits.reader_checks import unreadable_images

    variants, labels = real_variants()
    names = list(judges.all())
    rows = [
        f"| real test digits (N={len(labels)}) | size | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for name, images in variants.items():
        accs = [float((fn(images)[0] == labels).float().mean()) for fn in judges.all().values()]
        size = f"{images.shape[-2]}x{images.shape[-1]}"
        label = name.rsplit(" ", 1)[0] if name.endswith(size) else name
        rows.append(f"| {label} | {size} | " + " | ".join(f"{100 * a:.1f} %" for a in accs) + " |")
    rows.append("")
    rows.append("| no digit (4 images each): mean top probability | " + " | ".join(names[:2]) + " |")
    rows.append("|---|---|---|")
    for name, images in unreadable_images().items():
        tops = [float(fn(images)[1].mean()) for fn in list(judges.all().values())[:2]]
        rows.append(f"| {name} | " + " | ".join(f"{t:.2f}" for t in tops) + " |")
    return rows


def swell_fade_table(judges: Judges) -> list[str]:
    """Markdown rows: accuracy and mean top probability as test digits swell into blobs or fade.

    Swelling: gray dilation with a k x k box at 32x32, area to 16x16 (the "bold" hack). Fading:
    gray erosion with a k x k box, ink x 0.3 (the "thin" hack: dimmer and broken strokes).
    """
    from flowrl.models.digits.reader_features import resample
    from flowrl.rewards.digit_data import digit_part

    _, images, labels = digit_part("test")
    big = resample(torch.as_tensor(images)[:, None])
    labels = torch.as_tensor(labels)
    rows = [
        "| test digits, 16x16 | mean ink | reader acc | reader top prob | reward CNN acc | reward CNN top prob |",
        "|---|---|---|---|---|---|",
    ]
    cases = [(f"dilated {k}x{k} at 32", F.max_pool2d(big, k, 1, k // 2)) for k in (3, 7, 9, 11, 13)]
    cases += [(f"eroded {k}x{k} at 32, ink x0.3", -F.max_pool2d(-big, k, 1, k // 2) * 0.3) for k in (3, 7, 9)]
    for name, x in cases:
        x = F.interpolate(x, size=(16, 16), mode="area")
        (pr, tr), (pc, tc) = judges.reader(x), judges.reward_classifier(x)
        reader = f"{100 * float((pr == labels).float().mean()):.1f} % | {float(tr.mean()):.2f}"
        reward = f"{100 * float((pc == labels).float().mean()):.1f} % | {float(tc.mean()):.2f}"
        rows.append(f"| {name} | {float(x.mean()):.3f} | {reader} | {reward} |")
    return rows


def sample_pipeline(model: Path, seeds: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Samples of a flowrl-digits pipeline: {style: (images (10 * seeds, 3, H, W), labels)}."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(model), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    card = json.loads((model / "flowrl.json").read_text())
    size, max_len = int(card["resolution"]), int(card["max_sequence_length"])
    labels = torch.arange(10).repeat_interleave(seeds)
    out = {}
    for style, template in PROMPTS.items():
        prompts = [template.format(d=int(d)) for d in labels]
        gens = [torch.Generator().manual_seed(1000 + i % seeds) for i in range(len(labels))]
        with torch.no_grad():
            images = pipe(
                prompt=prompts,
                height=size,
                width=size,
                num_inference_steps=10,
                guidance_scale=1.0,
                output_type="pt",
                generator=gens,
                max_sequence_length=max_len,
            ).images
        out[style] = (images.float().cpu(), labels)
    return out


def sample_table(judges: Judges, samples: dict[str, tuple[Tensor, Tensor]], model: Path) -> list[str]:
    names = list(judges.all())
    n = len(next(iter(samples.values()))[1])
    rows = [
        f"| samples of {model.name} (N={n} per style) | size | " + " | ".join(names) + " | reader top prob |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for style, (images, labels) in samples.items():
        results = [fn(images) for fn in judges.all().values()]
        accs = [float((pred == labels).float().mean()) for pred, _ in results]
        size = f"{images.shape[-2]}x{images.shape[-1]}"
        cells = " | ".join(f"{100 * a:.1f} %" for a in accs)
        rows.append(f"| {style} | {size} | {cells} | {float(results[0][1].mean()):.2f} |")
    rows += ["", "| reader, per digit | " + " | ".join(str(d) for d in range(10)) + " |", "|---|" + "---|" * 10]
    for style, (images, labels) in samples.items():
        right = judges.reader(images)[0] == labels
        rows.append(
            f"| {style} | "
            + " | ".join(f"{100 * float(right[labels == d].float().mean()):.0f} %" for d in range(10))
            + " |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the tables (markdown) and the judges' provenance."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", type=Path, default=Path(__file__).resolve().parents[1] / "flowrl/assets/flowrl-digits"
    )
    parser.add_argument("--seeds", type=int, default=20, help="samples per digit and style")
    parser.add_argument("--no-samples", action="store_true", help="only the real-digit table")
    parser.add_argument("--grid", type=Path, default=None, help="write the samples as a PNG grid (rows: styles)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from flowrl.models.digits.reader import reader_report
    from flowrl.rewards.digit_classifier import default_weights_path
    from flowrl.rewards.shipped import shipped_report

    start = time.perf_counter()
    judges = Judges()
    print("\n".join(real_table(judges)))
    print()
    print("\n".join(swell_fade_table(judges)))
    if not args.no_samples:
        samples = sample_pipeline(args.model, args.seeds)
        print()
        print("\n".join(sample_table(judges, samples, args.model)))
        if args.grid is not None:
            from flowrl.models.digits.evaluation import save_digit_grid

            grid = torch.cat([images[:: args.seeds] for images, _ in samples.values()])
            save_digit_grid(grid, args.grid, rows=len(samples), scale=8)
    reward_report = shipped_report(default_weights_path())
    reader = reader_report()
    print()
    print(f"reader: trained on the '{reader['train_part']}' part (n={reader['n_train']}), seed {reader['seed']}")
    print(f"reward CNN: n_train={reward_report.get('n_train')}, data: {reward_report.get('data', 'not recorded')}")
    print(f"SVC: fit on 75 % of all digits; {svc_overlap()} of the test part's digits were in its fit set")
    print(f"seconds: {time.perf_counter() - start:.1f}; load: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
