"""Async scoring on the embedded task: rollout + scoring wall time against the rollout alone.

Usage: ``python -m bench.async_scoring [--repeats 5] [--layers 4] [--chunk-size 40] [--score-chunk-size N] [--remote]``,
or ``python -m bench.async_scoring --cpu-share`` to check whether this process can use two cores
at once at all (two threads of GIL-free 384x384 matmuls: CPU seconds per wall second), or
``--contention`` to time the rollout beside a process that scores without pause (how much two
busy cores slow each other: shared cache and memory bandwidth).

One Flow-GRPO iteration of the default job (160 samples, chunks of 40, 10 SDE steps, 1 torch
thread per Python thread) is collected several ways, alternating within one process so all see the
same host load, from the same generator state each time:

- ``rollout alone``: the chunked SDE rollout only (no decode, no rewards); with another
  ``--chunk-size`` also at the default chunks of 40, since chunk size changes sampling speed;
- ``collect, sync``: rollout, then decode + score each chunk inline (``train.rewards_async: false``);
- ``collect, async thread``: decode + score chunk k on a worker thread while chunk k + 1 samples;
- ``collect, async process``: the same in a spawned worker process (``rewards_async: process``),
  started once before timing (as a training run does).

``--score-chunk-size`` cuts every chunk into scoring pieces (``train.score_chunk_size``): when
the rollout ends the trainer scores the pieces the worker has not started, beside it.

The rewards are the default job's (ink, digit correctness) plus (unless ``--layers 0``) a model reward: a randomly
initialised transformers ``CLIPVisionModelWithProjection`` (``--layers`` encoder layers, 32x32
input) whose embedding is scored against a fixed direction, standing in for a CLIP-style scorer.
Its cost is printed beside the sampling cost; the target (<= 1.1x) applies when it is lower.
With ``--remote`` that model reward runs in its own process behind ``flowrl serve-reward``
(the deployment for heavy scorers), so the worker thread only waits on a socket.
The ``CPU s`` column is the process's CPU time (all threads; a remote server's is not counted).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any, Sequence

import torch

from bench.remote_reward import serve_reward_process


class ClipLikeReward:
    """Cosine between a random-init CLIP vision embedding of the image and a fixed direction."""

    allows_nan = False

    def __init__(self, layers: int = 4, seed: int = 0, device: str = "cpu") -> None:
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        torch.manual_seed(seed)
        cfg = CLIPVisionConfig(
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=layers,
            num_attention_heads=4,
            image_size=32,
            patch_size=4,
            projection_dim=128,
        )
        self.model = CLIPVisionModelWithProjection(cfg).eval().requires_grad_(False).to(device)
        self.direction = torch.nn.functional.normalize(
            torch.randn(128, generator=torch.Generator().manual_seed(seed)), dim=0
        ).to(device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], **metadata: Any) -> torch.Tensor:
        x = torch.nn.functional.interpolate(
            images.float().to(self.direction.device), size=(32, 32), mode="bilinear", align_corners=False
        )
        embeds = self.model(pixel_values=x * 2 - 1).image_embeds
        return (torch.nn.functional.normalize(embeds, dim=-1) @ self.direction).to(images.device)


def clip_like(layers: int = 4) -> ClipLikeReward:
    """CLIP-like model reward for benchmarks: random-init CLIP vision tower, cosine to a fixed direction."""
    return ClipLikeReward(layers)


def _serve(layers: int):
    """The ``clip_like`` reward with ``layers`` blocks, served by ``flowrl serve-reward`` in its own process."""
    return serve_reward_process("bench.async_scoring:clip_like", f"layers={layers}")


def _trainer(layers: int, chunk_size: int, url: str | None = None, pieces: int | None = None, device: str = "cpu"):
    from flowrl.config import load_config
    from flowrl.policy import build_policy
    from flowrl.prompts.sets import load_prompts
    from flowrl.rewards import MultiReward, build_reward
    from flowrl.runtime import configure_threads
    from flowrl.trainer import Trainer

    cfg = load_config(
        None,
        [
            "train.progress=false",
            f"sampler.chunk_size={chunk_size}",
            f"model.device={device}",
            f"train.score_chunk_size={'null' if pieces is None else pieces}",
        ],
    )
    configure_threads(cfg.train.threads)
    rewards = {
        "ink": (build_reward("ink", target="prompt"), 1.0),
        "digit_correctness": (build_reward("digit_correctness"), 0.5),
    }
    if layers or url:
        rewards["clip_like"] = (build_reward("remote", url=url) if url else ClipLikeReward(layers, device=device), 0.1)
    reward = MultiReward(rewards)
    prompts = load_prompts(cfg.prompts.train)
    return Trainer(
        cfg,
        build_policy(cfg, trainable=True),
        reward,
        prompts,
        prompts[:2],
    )


def _cases(trainer) -> dict[str, Any]:
    from flowrl.policy.lora import use_adapter
    from flowrl.rollouts.collect import sample_sde
    from flowrl.rollouts.scoring import RolloutScorer

    state = trainer.generator.get_state()
    prompts, cond = trainer.draw_prompts()
    rows = len(prompts.texts)

    def rollout() -> torch.Tensor:
        with use_adapter(trainer.model.transformer, trainer.objective.sampling_adapter):
            return sample_sde(trainer.rollout_context(), cond, rows, lambda part, latents: None).samples

    samples = rollout()

    def rollout_alone(chunk_size: int | None = None):
        def run():
            configured = trainer.cfg.sampler.chunk_size
            trainer.cfg.sampler.chunk_size = chunk_size or configured
            trainer.generator.set_state(state)
            try:
                rollout()
            finally:
                trainer.cfg.sampler.chunk_size = configured

        return run

    def scoring_alone():
        with RolloutScorer(
            trainer.reward,
            trainer.model.decode,
            prompts.texts,
            prompts.metadata,
            score_chunk_size=trainer.cfg.train.score_chunk_size,
        ) as scorer:
            for start in range(0, samples.shape[0], trainer.cfg.sampler.chunk_size):
                rows = slice(start, start + trainer.cfg.sampler.chunk_size)
                scorer.submit(rows, samples[rows])
            scorer.result(samples)

    def collect(mode: bool | str):
        def run():
            trainer.cfg.train.rewards_async = mode
            trainer.generator.set_state(state)
            trainer.collect()

        return run

    default_chunk = 40
    reference = (
        {}
        if trainer.cfg.sampler.chunk_size == default_chunk
        else {f"rollout alone, default chunks of {default_chunk}": rollout_alone(default_chunk)}
    )
    return {
        "rollout alone": rollout_alone(),
        **reference,
        "decode + score alone (chunked)": scoring_alone,
        "collect, sync scoring": collect(False),
        "collect, async thread": collect("thread"),
        "collect, async process": collect("process"),
    }


def cpu_share(repeats: int) -> None:
    """Print CPU seconds per wall second of 1 and 2 threads running GIL-free matmuls."""
    import threading

    torch.set_num_threads(1)
    a = torch.rand(384, 384)

    def work() -> None:
        for _ in range(200):
            a @ a

    print(f"# load average {os.getloadavg()[0]:.1f}")
    print("| threads | wall s | CPU s | CPU s per wall s |")
    print("|---|---|---|---|")
    for _ in range(repeats):
        for count in (1, 2):
            threads = [threading.Thread(target=work) for _ in range(count)]
            t0, c0 = time.perf_counter(), time.process_time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"| {count} | {wall:.2f} | {cpu:.2f} | {cpu / wall:.2f} |")


def _score_forever(layers: int, chunk_size: int) -> None:
    """Child of ``--contention``: decode + score the same batch in a loop until killed."""
    trainer = _trainer(layers, chunk_size)
    score = _cases(trainer)["decode + score alone (chunked)"]
    print("ready", flush=True)
    while True:
        score()


def contention(layers: int, chunk_size: int, repeats: int) -> None:
    """Print the rollout's time alone and beside a process that scores without pause (the cost of sharing the CPU)."""
    import subprocess
    import sys

    trainer = _trainer(layers, chunk_size)
    rollout = _cases(trainer)["rollout alone"]

    def median_time() -> float:
        rollout()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            rollout()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    alone = median_time()
    code = f"from bench.async_scoring import _score_forever; _score_forever({layers}, {chunk_size})"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the scoring child did not start")
        beside = median_time()
    finally:
        child.kill()
        child.wait()
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs, {repeats} repeats, chunks of {chunk_size}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| rollout | median s | ratio |")
    print("|---|---|---|")
    print(f"| alone | {alone:.3f} | 1.00 |")
    print(f"| beside a process scoring without pause | {beside:.3f} | {beside / alone:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--layers", type=int, default=4, help="encoder layers of the CLIP-like model reward (0: no model reward)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=40, help="sampler.chunk_size (the last chunk's scoring is never hidden)"
    )
    parser.add_argument(
        "--score-chunk-size",
        type=int,
        default=None,
        help="train.score_chunk_size: rows per scoring call (the trainer shares the last chunk's pieces)",
    )
    parser.add_argument("--device", default="cpu", help="model.device (and the CLIP-like reward's device), e.g. cuda")
    parser.add_argument(
        "--remote", action="store_true", help="serve the model reward from a flowrl serve-reward subprocess"
    )
    parser.add_argument(
        "--cpu-share", action="store_true", help="only measure how much CPU two threads of this process get"
    )
    parser.add_argument(
        "--contention",
        action="store_true",
        help="only measure how much a scoring process running beside it slows the rollout",
    )
    args = parser.parse_args(argv)
    if args.contention:
        contention(args.layers, args.chunk_size, args.repeats)
        return
    if args.cpu_share:
        cpu_share(args.repeats)
        return
    server, url = _serve(args.layers) if args.remote else (None, None)
    try:
        trainer = _trainer(args.layers, args.chunk_size, url, args.score_chunk_size, args.device)
        cases = _cases(trainer)
        times: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in cases.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                if trainer.device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    finally:
        if "trainer" in locals():
            trainer.close()
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
    base = statistics.median(times["rollout alone"])
    gpu = f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs{gpu}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s), "
        f"{args.repeats} repeats, 160 samples x 10 steps, chunks of {args.chunk_size}, scored in pieces of "
        f"{args.score_chunk_size or args.chunk_size}, model reward {'remote' if url else 'in-process'}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| case | median s | min s | max s | CPU s (median) | median / rollout alone |")
    print("|---|---|---|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"| {name} | {med:.3f} | {min(values):.3f} | {max(values):.3f} | "
            f"{statistics.median(cpu[name]):.3f} | {med / base:.2f} |"
        )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
