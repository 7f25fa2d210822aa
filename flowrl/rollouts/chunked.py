"""Sampling with a model adapter: chunked rollouts for training, ODE sampling for evaluation."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .. import kernels  # noqa: F401 - registers the fused Flow-SDE step for CUDA latents
from ..models.adapter import Cond, ModelAdapter, model_latent_shape, select_cond
from ..runtime import seeded_noise
from ..samplers.rollout import rollout
from ..samplers.types import Trajectory

ChunkHook = Callable[[slice, Tensor], None]  # (rows of the stored batch, final latents of those rows)


@torch.no_grad()
def chunked_rollout(
    model: ModelAdapter,
    cond: Cond,
    x_init: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    *,
    chunk_size: int,
    generator: torch.Generator | None = None,
    sde: str = "flow",
    on_chunk: ChunkHook | None = None,
    store: Tensor | None = None,
) -> Trajectory:
    """Run :func:`flowrl.samplers.rollout` over consecutive chunks and concatenate.

    Training recomputes log-probs on the same chunks, so the forward pass sees the same batch
    geometry as sampling.

    Args:
        model: the policy.
        cond: conditioning for B samples.
        x_init: (B, ...) initial noise.
        sigmas: (T + 1,) grid.
        noise_levels: (T,) per-step noise level.
        chunk_size: samples per model call.
        generator: RNG for the SDE noise.
        sde: the SDE step's name in :data:`flowrl.samplers.SDE_STEPS`.
        on_chunk: called as ``on_chunk(rows, final_latents)`` after each chunk with stored rows (e.g. to
            decode and score it while the next chunk is sampled, :mod:`flowrl.rollouts.scoring`);
            ``rows`` number the stored rows.
        store: (B,) bool, the rows whose trajectories are kept (one rank's of several,
            :mod:`flowrl.rollouts.owned`); None = every row.

    Returns:
        Trajectory with latents (b, T + 1, ...) and log_probs (b, T) of the ``b`` stored rows (B without ``store``).
    """
    parts, stored = [], 0
    for start in range(0, x_init.shape[0], chunk_size):
        idx = slice(start, start + chunk_size)
        c = select_cond(cond, idx)
        part = rollout(
            lambda x, s: model.velocity(x, s, c), x_init[idx], sigmas, noise_levels, generator=generator, sde=sde
        )
        if store is not None:
            rows = store[idx].to(part.latents.device)
            part = part._replace(latents=part.latents[rows], log_probs=part.log_probs[rows])
        parts.append(part)
        stored = _report(on_chunk, stored, part.latents[:, -1])
    return Trajectory(
        torch.cat([p.latents for p in parts]),
        torch.cat([p.log_probs for p in parts]),
        sigmas,
        noise_levels,
        sde,
    )


def sigma_window_levels(sigmas: Tensor, noise_level: float, lo: float, hi: float) -> Tensor:
    """Noise level per step: ``noise_level`` where the step starts at lo <= sigma <= hi, else 0.

    Args:
        sigmas: (T + 1,) grid.
        noise_level: the Flow-SDE ``a`` inside the window.
        lo: lower sigma bound of the window (AWM's SA-solver setting uses 0.3).
        hi: upper sigma bound of the window (AWM's SA-solver setting uses 0.9).

    Returns:
        (T,) float64.
    """
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"sampler.sde_window must be [lo, hi] with 0 <= lo <= hi <= 1; got [{lo}, {hi}]")
    start = sigmas[:-1].double()
    inside = (start >= lo) & (start <= hi)
    return torch.where(inside, torch.full_like(start, noise_level), torch.zeros_like(start))


@torch.no_grad()
def chunked_solve(
    model: ModelAdapter,
    cond: Cond,
    x_init: Tensor,
    sigmas: Tensor,
    *,
    solver: str,
    chunk_size: int,
    noise_levels: Tensor | None = None,
    generator: torch.Generator | None = None,
    on_chunk: ChunkHook | None = None,
    store: Tensor | None = None,
) -> Tensor:
    """Clean samples from a black-box solver, chunk by chunk (no log-probs kept).

    Args:
        model: the sampling policy.
        cond: conditioning for B samples.
        x_init: (B, ...) initial noise.
        sigmas: (T + 1,) grid.
        solver: "euler", "heun", "dpmpp_2m" (deterministic) or "sde_window" (Flow-SDE steps
            where ``noise_levels`` > 0, Euler elsewhere).
        chunk_size: samples per model call.
        noise_levels: (T,) for "sde_window".
        generator: RNG for SDE noise.
        on_chunk: called as ``on_chunk(rows, final_latents)`` after each chunk with stored rows.
        store: (B,) bool, the rows whose samples are kept (one rank's of several); None = every row.

    Returns:
        (b, ...) final latents of the ``b`` stored rows (B without ``store``), fp32.
    """
    parts, stored = [], 0
    for start in range(0, x_init.shape[0], chunk_size):
        idx = slice(start, start + chunk_size)
        c = select_cond(cond, idx)
        fn = lambda x, s, c=c: model.velocity(x, s, c)  # noqa: E731
        if solver == "sde_window":
            from ..samplers.window_solve import sde_window_solve

            parts.append(sde_window_solve(fn, x_init[idx].float(), sigmas, noise_levels, generator=generator).float())
        else:
            from ..samplers.ode_solve import ode_solve

            parts.append(ode_solve(fn, x_init[idx].float(), sigmas, method=solver).float())
        if store is not None:
            parts[-1] = parts[-1][store[idx].to(parts[-1].device)]
        stored = _report(on_chunk, stored, parts[-1])
    return torch.cat(parts)


def _report(on_chunk: ChunkHook | None, stored: int, final: Tensor) -> int:
    """``on_chunk`` on a finished chunk's stored rows ``final`` (b, ...), numbered from ``stored``; the new count."""
    if on_chunk is not None and final.shape[0]:
        on_chunk(slice(stored, stored + final.shape[0]), final)
    return stored + final.shape[0]


@torch.no_grad()
def sample_images(
    model: ModelAdapter,
    prompts: Sequence[str],
    seeds: Sequence[int],
    sigmas: Tensor,
    *,
    resolution: tuple[int, int],
    frames: int | None = None,
    chunk_size: int = 64,
    encode: Callable[[list[str]], Cond] | None = None,
) -> Tensor:
    """Deterministic ODE samples (Euler, no noise) for fixed seeds.

    Args:
        model: the model adapter.
        prompts: B prompts.
        seeds: B seeds; sample i's initial noise depends only on seeds[i].
        sigmas: (T + 1,) grid.
        resolution: (height, width).
        frames: frames per video for video models (None = the model's default).
        chunk_size: samples per model call and per VAE decode (a large eval set is never decoded at once).
        encode: prompt encoder (e.g. a :class:`~flowrl.prompts.cache.PromptCache`'s ``encode``);
            default ``model.encode_prompt``.

    Returns:
        Images (B, 3, H, W), or videos (B, F, 3, H, W), in [0, 1].
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"need one seed per prompt; got {len(prompts)} prompts and {len(seeds)} seeds")
    x_init = seeded_noise(model_latent_shape(model, resolution, frames), list(seeds)).to(model.device)
    cond = (encode or model.encode_prompt)(list(prompts))
    levels = torch.zeros(sigmas.shape[0] - 1, dtype=torch.float64)
    # zero levels: each step's noise is multiplied by a zero std; a private generator keeps the draws off
    # torch's global RNG, so evaluating never moves the RNG state a checkpoint saves
    quiet = torch.Generator().manual_seed(0)
    traj = chunked_rollout(model, cond, x_init, sigmas, levels, chunk_size=chunk_size, generator=quiet)
    final = traj.latents[:, -1]
    return torch.cat([model.decode(final[i : i + chunk_size]) for i in range(0, final.shape[0], chunk_size)])
