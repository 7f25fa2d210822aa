"""Deterministic pretraining of flowrl-digits (the CLI command ``flowrl pretrain-digits``).

Two stages on scikit-learn's bundled 8x8 digits, on CPU:

1. the ``AutoencoderKL`` is trained as a near-identity autoencoder (MSE + a tiny KL), and its
   ``scaling_factor`` / ``shift_factor`` are set from the latent statistics;
2. the ``SD3Transformer2DModel`` and all three text encoders are trained jointly with the
   rectified-flow loss on the (normalised) latents, with prompt dropout for CFG, and the EMA
   weights are saved with ``save_pretrained`` (safetensors) plus a ``flowrl.json`` model card.

References:
    Liu et al., "Flow Straight and Fast: Learning to Generate and Transfer Data with Rectified Flow", 2022.
    Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis" (logit-normal t), 2024.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .model import (
    DIGITS_DIR,
    MAX_SEQUENCE_LENGTH,
    RESOLUTION,
    build_digits_pipeline,
    digits_prompt,
    encode_prompts,
    load_digit_images,
)
from .pretrain_output import MODEL_COMPONENTS, check_batch_size, check_options, check_out, save_model

VAE_STEPS = 400
FLOW_STEPS = 1500
WARMUP_STEPS = 30
LEARNING_RATE = 1e-3
KL_WEIGHT = 1e-3
LOGIT_NORMAL_MEAN = 0.0
PROMPT_DROPOUT = 0.1
STYLE_PROB = 0.5
NUM_INFERENCE_STEPS = 10
LOG_EVERY = 100


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Endless index batches over shuffled epochs (the order depends only on the generator)."""
    pending = torch.empty(0, dtype=torch.int64)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(n, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def _schedule(total: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to zero over ``total`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _optimizer(params: list[nn.Parameter], steps: int) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps, min(WARMUP_STEPS, max(1, steps // 4))))
    return opt, sched


def train_vae(
    vae: nn.Module,
    images: Tensor,
    *,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    log: Callable[[str], None],
) -> dict[str, float]:
    """Train the VAE as an autoencoder of ``images`` (N, 3, 8, 8) in [-1, 1]; set its latent scaling.

    Loss: MSE(decode(z), x) + KL_WEIGHT * KL(q(z|x) || N(0, I)) per latent element, z ~ q(z|x).
    Afterwards ``shift_factor`` = mean and ``scaling_factor`` = 1 / std of the posterior means.

    Returns:
        ``{"final_loss", "recon_mse", "scaling_factor", "shift_factor", "seconds"}``.
    """
    start = time.perf_counter()
    vae.train()
    opt, sched = _optimizer(list(vae.parameters()), steps)
    batches = _batches(len(images), batch_size, generator)
    smooth = float("nan")
    for step in range(steps):
        x = images[next(batches)]
        posterior = vae.encode(x).latent_dist
        z = posterior.sample(generator=generator)
        recon = vae.decode(z).sample
        kl = posterior.kl().mean() / z[0].numel()
        loss = torch.nn.functional.mse_loss(recon, x) + KL_WEIGHT * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        smooth = loss.item() if step == 0 else 0.95 * smooth + 0.05 * loss.item()
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            log(f"vae step {step + 1}/{steps} loss {smooth:.5f} ({time.perf_counter() - start:.0f}s)")
    vae.eval()
    with torch.no_grad():
        mean = vae.encode(images).latent_dist.mean
        recon_mse = torch.nn.functional.mse_loss(vae.decode(mean).sample.clamp(-1, 1), images).item()
        shift, scale = mean.mean().item(), 1.0 / mean.std().item()
    vae.register_to_config(scaling_factor=scale, shift_factor=shift)
    return {
        "final_loss": smooth,
        "recon_mse": recon_mse,
        "scaling_factor": scale,
        "shift_factor": shift,
        "seconds": time.perf_counter() - start,
    }


def _training_prompts(labels: Tensor, styles: Sequence[str | None], generator: torch.Generator) -> list[str]:
    """Prompt per image: its style word with probability STYLE_PROB (if it has one), "" with PROMPT_DROPOUT."""
    use_style = torch.rand(len(labels), generator=generator) < STYLE_PROB
    drop = torch.rand(len(labels), generator=generator) < PROMPT_DROPOUT
    prompts = []
    for label, style, keep_style, dropped in zip(labels.tolist(), styles, use_style.tolist(), drop.tolist()):
        prompts.append("" if dropped else digits_prompt(label, style if keep_style else None))
    return prompts


def train_flow(
    pipe: Any,
    latents: Tensor,
    labels: Tensor,
    styles: Sequence[str | None],
    *,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    log: Callable[[str], None],
    logit_normal_mean: float = LOGIT_NORMAL_MEAN,
) -> dict[str, float]:
    """Rectified-flow training of the transformer and text encoders; leaves the EMA weights loaded.

    ``x_s = (1 - s) z + s eps`` with logit-normal s (``sigmoid(N(logit_normal_mean, 1))``), target
    ``eps - z``, ``timestep = 1000 s``. A positive mean puts more training on high noise, where a
    sample's class is decided: measured SVC accuracy (no CFG, 500 samples) at 1,500 steps was
    97.2% with mean 0 and 98.0% with mean 1.5, at the cost of some diversity (within-class L2
    32.7 -> 30.2; real data 36.1).

    Args:
        pipe: the flowrl-digits pipeline (its VAE is not touched).
        latents: (N, 4, 8, 8) normalised latents ``(mean - shift) * scale``.
        labels: (N,) digits.
        styles: N style words or None.
        steps: optimizer steps.
        batch_size: images per step (drawn from shuffled epochs).
        generator: CPU RNG for batches, prompt styles/dropout, s and the noise.
        log: called with a progress line every ``LOG_EVERY`` steps and at the last step.
        logit_normal_mean: mean of the normal inside the sigmoid that draws s.

    Returns:
        ``{"final_loss", "seconds", "seconds_per_step"}``.
    """
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train()
        m.requires_grad_(True)
    ema = [p.detach().clone() for p in params]
    opt, sched = _optimizer(params, steps)
    batches = _batches(len(latents), batch_size, generator)
    smooth = float("nan")
    start = time.perf_counter()
    for step in range(steps):
        idx = next(batches)
        z = latents[idx]
        prompts = _training_prompts(labels[idx], [styles[i] for i in idx.tolist()], generator)
        s = torch.sigmoid(torch.randn(len(idx), generator=generator) + logit_normal_mean)
        eps = torch.randn(z.shape, generator=generator)
        sv = s.view(-1, 1, 1, 1)
        x_s = (1 - sv) * z + sv * eps
        embeds, pooled = encode_prompts(pipe, prompts)
        pred = pipe.transformer(
            hidden_states=x_s,
            timestep=s * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = torch.nn.functional.mse_loss(pred, eps - z)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        smooth = loss.item() if step == 0 else 0.98 * smooth + 0.02 * loss.item()
        if (step + 1) % LOG_EVERY == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            log(f"flow step {step + 1}/{steps} loss {smooth:.4f} ({elapsed:.0f}s, {elapsed / (step + 1):.3f}s/step)")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    for m in modules:
        m.eval()
        m.requires_grad_(False)
    return {"final_loss": smooth, "seconds": seconds, "seconds_per_step": seconds / max(1, steps)}


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def pretrain_digits(
    out_dir: Path,
    *,
    seed: int = 0,
    vae_steps: int = VAE_STEPS,
    flow_steps: int = FLOW_STEPS,
    batch_size: int = 128,
    threads: int = 1,
    eval_per_class: int = 50,
    logit_normal_mean: float = LOGIT_NORMAL_MEAN,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train flowrl-digits from scratch and save it as a diffusers folder.

    Deterministic for a given seed, thread count and machine: weights, data order, noise and
    prompt choices all come from ``seed``. Every option and ``out_dir`` are checked before any training;
    the model is written into a hidden sibling folder and renamed to ``out_dir`` at the end, so an
    error or a kill leaves an existing ``out_dir`` as it was.

    Args:
        out_dir: destination folder (created; a non-empty one only with ``overwrite``).
        seed: seed for initial weights, data order and noise.
        vae_steps: autoencoder steps.
        flow_steps: flow-matching steps.
        batch_size: images per step.
        threads: torch intra-op threads.
        eval_per_class: samples per digit for the SVC evaluation (0 skips it).
        logit_normal_mean: flow-time sampling bias towards high noise (see :func:`train_flow`).
        overwrite: replace the model in a non-empty ``out_dir`` (its other files are kept).
        log: progress sink.

    Returns:
        Report dict: ``{"vae", "flow", "eval", "params", "size_bytes", "seconds"}``.

    Raises:
        TypeError: an option of the wrong type.
        ValueError: an option out of range or not finite, an unusable ``out_dir``, or trained weights
            that are not finite (nothing is saved then).
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is false.
    """
    check_options(
        seed=seed,
        vae_steps=vae_steps,
        flow_steps=flow_steps,
        batch_size=batch_size,
        threads=threads,
        eval_per_class=eval_per_class,
        logit_normal_mean=logit_normal_mean,
    )
    out_dir = check_out(out_dir, overwrite=overwrite)
    images, labels, styles = load_digit_images()
    check_batch_size(batch_size, len(images))
    start = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    pipe = build_digits_pipeline(seed)
    pixels = images * 2 - 1
    generator = torch.Generator().manual_seed(seed)

    vae_report = train_vae(pipe.vae, pixels, steps=vae_steps, batch_size=batch_size, generator=generator, log=log)
    log(
        f"vae recon MSE {vae_report['recon_mse']:.5f}, scaling {vae_report['scaling_factor']:.4f}, "
        f"shift {vae_report['shift_factor']:.4f}"
    )
    pipe.vae.requires_grad_(False)
    with torch.no_grad():
        latents = pipe.vae.encode(pixels).latent_dist.mean
    latents = (latents - vae_report["shift_factor"]) * vae_report["scaling_factor"]

    flow_report = train_flow(
        pipe,
        latents,
        labels,
        styles,
        steps=flow_steps,
        batch_size=batch_size,
        generator=generator,
        log=log,
        logit_normal_mean=logit_normal_mean,
    )

    eval_report: dict[str, Any] = {}
    if eval_per_class > 0:
        from .evaluation import evaluate_base_model

        eval_report = evaluate_base_model(pipe, per_class=eval_per_class, steps=NUM_INFERENCE_STEPS)
        log(
            f"eval: accuracy {eval_report['accuracy']:.4f} (bold {eval_report['accuracy_bold']:.4f}, "
            f"thin {eval_report['accuracy_thin']:.4f}); ink bold {eval_report['ink_bold']:.3f} "
            f"plain {eval_report['ink_plain']:.3f} thin {eval_report['ink_thin']:.3f}"
        )

    card = {
        "adapter": "sd3",
        "resolution": RESOLUTION,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "num_inference_steps": NUM_INFERENCE_STEPS,
        "guidance_scale": 1.0,
        "seed": seed,
        "vae_steps": vae_steps,
        "flow_steps": flow_steps,
        "batch_size": batch_size,
        "logit_normal_mean": logit_normal_mean,
        "eval": eval_report,
    }
    save_model(pipe, card, out_dir, overwrite=overwrite, log=log)
    params = {name: sum(p.numel() for p in getattr(pipe, name).parameters()) for name in MODEL_COMPONENTS}
    return {
        "vae": vae_report,
        "flow": flow_report,
        "eval": eval_report,
        "params": params,
        "size_bytes": _folder_bytes(out_dir),
        "seconds": time.perf_counter() - start,
    }


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``flowrl pretrain-digits`` (every option but ``--out`` is a keyword of :func:`pretrain_digits`)."""
    parser = argparse.ArgumentParser(prog="flowrl pretrain-digits", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DIGITS_DIR,
        help="output folder (default: the shipped model, which needs --overwrite to be replaced)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model in a non-empty --out (its other files are kept; the swap happens at the end)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    parser.add_argument("--flow-steps", type=int, default=FLOW_STEPS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--logit-normal-mean",
        type=float,
        default=LOGIT_NORMAL_MEAN,
        help="bias of the flow-time sampler towards high noise (1.5: 98.0%% vs 97.2%% accuracy)",
    )
    parser.add_argument("--eval-per-class", type=int, default=50, help="SVC eval samples per digit (0: skip)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``flowrl pretrain-digits``: train the embedded model and print the report as JSON.

    Args:
        argv: the arguments after ``pretrain-digits``; None reads ``sys.argv``.

    Returns:
        The exit code, 0 (a bad option or ``--out`` raises before any training).
    """
    options = vars(build_parser().parse_args(argv))  # every option is a keyword of pretrain_digits
    report = pretrain_digits(options.pop("out"), **options)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
