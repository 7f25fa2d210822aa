"""Reward conformance kit: one call checks that a reward honours the contract.

``check_reward(factory)`` builds the reward and checks, on a small batch, the output shape and
dtype, batch size 1, determinism, that no gradient leaks into the images or the reward's own
parameters, NaN handling, video input where declared, and that nothing touches the network.
Every built-in runs through it in one parametrised test (optax's shared-test pattern); plugin
authors call it from their own test.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from .contract import RewardError, reward_allows_nan, score_reward


class ConformanceError(RewardError):
    """A reward broke the contract (the message names the check and the reward)."""


@contextmanager
def _offline() -> Iterator[None]:
    real = socket.socket.connect

    def refuse(sock: socket.socket, address: Any) -> None:
        raise ConformanceError(f"reward opened a network connection to {address}; rewards must work offline")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        socket.socket.connect = real  # type: ignore[method-assign]


def _slice(metadata: dict[str, Sequence[Any]], n: int) -> dict[str, Any]:
    return {k: list(v)[:n] for k, v in metadata.items()}


def _same(a: Tensor, b: Tensor) -> bool:
    return bool(
        torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.allclose(a.nan_to_num(), b.nan_to_num(), rtol=1e-5, atol=1e-6)
    )


def default_batch(size: int = 4, resolution: int = 8, seed: int = 0) -> tuple[Tensor, list[str], dict[str, list[Any]]]:
    """Random images (size, 3, r, r) in [0, 1] with digit prompts (bold/thin alternating) and metadata."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(size, 3, resolution, resolution, generator=gen)
    styles = ["bold" if i % 2 == 0 else "thin" for i in range(size)]
    prompts = [f"a {s} handwritten {i % 10}" for i, s in enumerate(styles)]
    return images, prompts, {"digit": [i % 10 for i in range(size)], "style": styles}


def check_reward(
    factory: Callable[..., Any],
    *,
    name: str | None = None,
    options: dict[str, Any] | None = None,
    images: Tensor | None = None,
    prompts: Sequence[str] | None = None,
    metadata: dict[str, Sequence[Any]] | None = None,
    video: bool = False,
) -> Tensor:
    """Run every conformance check; return the scores of the sample batch.

    Args:
        factory: the reward factory (``factory(**options) -> reward``).
        name: name used in messages (default: the factory's name).
        options: factory keyword arguments.
        images: (B, 3, H, W) batch in [0, 1] (default: :func:`default_batch`), or
            (B, F, 3, H, W) clips for a video-only reward.
        prompts: B prompts.
        metadata: per-key lists of B values.
        video: also check a (B, F, 3, H, W) batch (for rewards that declare video support).

    Returns:
        The (B,) float32 scores of the sample batch.

    Raises:
        ConformanceError: naming the reward and the failed check.
    """
    name = name or getattr(factory, "__name__", "reward")
    if images is None:
        images, prompts, metadata = default_batch()
    prompts, metadata = list(prompts or []), dict(metadata or {})
    with _offline():
        fn = factory(**(options or {}))
        first = score_reward(name, fn, images, prompts, metadata)
        if not _same(first, score_reward(name, fn, images, prompts, metadata)):
            raise ConformanceError(f"reward '{name}' is not deterministic: two calls on the same batch differ")
        single = score_reward(name, fn, images[:1], prompts[:1], _slice(metadata, 1))
        if single.shape != (1,):
            raise ConformanceError(
                f"reward '{name}' returned shape {tuple(single.shape)} for a batch of 1; expected (1,)"
            )
        _check_no_grad(name, fn, images, prompts, metadata)
        if reward_allows_nan(fn) and torch.isnan(first).all():
            raise ConformanceError(
                f"reward '{name}' returned only NaN on the sample batch; "
                "NaN must mean 'not applicable' for some samples only"
            )
        if video:
            _check_video(name, fn, images, prompts, metadata)
    return first


def _check_no_grad(name: str, fn: Any, images: Tensor, prompts: list[str], metadata: dict[str, Any]) -> None:
    leaf = images.detach().clone().requires_grad_(True)
    out = fn(leaf, prompts, **metadata)
    if isinstance(out, Tensor) and out.requires_grad:
        raise ConformanceError(
            f"reward '{name}' returns a tensor that requires grad; score under torch.no_grad() and detach"
        )
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    if any(p.grad is not None for p in params):
        raise ConformanceError(f"reward '{name}' left gradients on its own parameters; score under torch.no_grad()")


def _check_video(name: str, fn: Any, images: Tensor, prompts: list[str], metadata: dict[str, Any]) -> None:
    clip = images if images.ndim == 5 else images.unsqueeze(1).repeat(1, 3, 1, 1, 1)  # (B, F=3, 3, H, W)
    out = fn(clip, prompts, **metadata)
    if not isinstance(out, Tensor) or out.shape != (len(images),):
        raise ConformanceError(
            f"reward '{name}' declares video support but returned {getattr(out, 'shape', type(out))} "
            f"for (B, F, 3, H, W) input; expected ({len(images)},)"
        )
