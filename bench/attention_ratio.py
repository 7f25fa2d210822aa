"""The first-update ratio when a rollout's attention kernel differs from the training pass's (performance.md cut 10).

Flow-GRPO's ratio ``exp(log p_new - log p_old)`` is exactly 1 before the first update only if the training
forward recomputes the rollout's velocity bit for bit. Since 2026-11-29 ``Trainer.collect`` runs under the
training passes' kernels (:func:`flowrl.policy.memory.trainable_attention`); before, in bf16 on Hopper, torch
picked cuDNN SDPA for the no-grad rollout forward and flash for the training one. This script measures what
such a switch costs: the default job's first iteration (the embedded model, bf16 autocast unless
``--dtype fp32``) rolled out once per kernel row and trained on the trainer's kernels, from the same seed.
Row "trainer" is what ``Trainer.collect`` does. On the CPU torch has only flash and math kernels; on CUDA the
memory-efficient and cuDNN rows run too.

Usage:
    python -m bench.attention_ratio [--device cuda] [--dtype fp32] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.policy import build_policy
from flowrl.policy.memory import trainable_attention
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward
from flowrl.rollouts.collect import collect_rollouts
from flowrl.trainer import Trainer

KERNELS: dict[str, list[SDPBackend] | None] = {
    "trainer": None,  # trainable_attention(), as Trainer.collect
    "flash": [SDPBackend.FLASH_ATTENTION],
    "math": [SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}
"""Row label -> the SDPA kernels the rollout may use (None: the trainer's own set)."""
CPU_KERNELS = ("trainer", "flash", "math")


def first_ratio(device: str, dtype: str, overrides: list[str], kernel: str) -> float:
    """The first trained micro-batch's mean ratio after one rollout on ``kernel``, training on the trainer's.

    ``Trainer.collect`` without Sol-RL (its prompt draw, then the rollout), with the rollout under
    ``KERNELS[kernel]`` instead of ``trainable_attention()``.
    """
    autocast = [] if dtype == "fp32" else [f"memory.autocast={dtype}"]
    cfg = load_config(None, [*autocast, f"model.device={device}", "train.progress=false", *overrides])
    prompts = load_prompts(cfg.prompts.train)
    model = load_adapter(cfg.model.path, device=device)
    trainer = Trainer(cfg, build_policy(cfg, model=model, trainable=True), build_reward(cfg), prompts, prompts[:1])
    try:
        groups, cond = trainer.draw_prompts()
        backends = KERNELS[kernel]
        with trainable_attention() if backends is None else sdpa_kernel(backends):
            batch, _ = collect_rollouts(trainer.rollout_context(), trainer.rollout_kind, groups, cond)
        return trainer.update(batch)["first_ratio"]
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])  # fp16 training is refused
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (default job)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.attention_ratio --device cuda needs a CUDA device; the default runs on the CPU")
    if args.device == "cpu":
        torch.set_num_threads(1)
    kernels = CPU_KERNELS if args.device == "cpu" else tuple(KERNELS)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu, 1 thread"
    print(
        f"# first-update ratio, rollout kernel vs training on trainable_attention(): {where}, {args.dtype}, "
        f"torch {torch.__version__}"
    )
    print("| rollout kernel | first ratio | abs(1 - ratio) |\n|---|---|---|")
    for kernel in kernels:
        try:
            ratio = first_ratio(args.device, args.dtype, args.set, kernel)
        except RuntimeError as err:  # a kernel that cannot run these shapes or dtype
            print(f"| {kernel} | {str(err).splitlines()[0][:80]} | - |", flush=True)
            continue
        print(f"| {kernel} | {ratio:.8f} | {abs(1 - ratio):.1e} |", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
