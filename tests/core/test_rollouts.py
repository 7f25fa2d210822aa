"""Chunked rollouts and solver sampling through a model adapter."""

import pytest
import torch

from flowrl.models.sd3 import SD3Adapter
from flowrl.rollouts.chunked import chunked_rollout, chunked_solve, sigma_window_levels
from flowrl.samplers import linear_sigmas, sde_noise_levels


def test_sigma_window_levels():
    sigmas = linear_sigmas(10)  # starts 1.0, 0.9, ..., 0.1
    levels = sigma_window_levels(sigmas, 0.4, 0.3, 0.9)
    assert levels.dtype == torch.float64 and levels.shape == (10,)
    assert levels.tolist() == [0.4 if 0.3 <= s <= 0.9 else 0.0 for s in sigmas[:-1].tolist()]
    assert levels[0] == 0.0 and levels[1] == 0.4 and levels[5] == 0.4 and levels[-1] == 0.0
    with pytest.raises(ValueError, match="sde_window"):
        sigma_window_levels(sigmas, 0.4, 0.9, 0.3)


def test_chunking_does_not_change_samples(tiny_sd3):
    cond = tiny_sd3.encode_prompt(["a bold handwritten 1"] * 5)
    x = torch.randn(5, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigmas = linear_sigmas(4)
    a = chunked_solve(tiny_sd3, cond, x, sigmas, solver="dpmpp_2m", chunk_size=2)
    b = chunked_solve(tiny_sd3, cond, x, sigmas, solver="dpmpp_2m", chunk_size=5)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    euler = chunked_solve(tiny_sd3, cond, x, sigmas, solver="euler", chunk_size=5)
    ode = chunked_rollout(tiny_sd3, cond, x, sigmas, torch.zeros(4, dtype=torch.float64), chunk_size=5)
    torch.testing.assert_close(euler, ode.latents[:, -1], rtol=0, atol=1e-6)


def test_sde_window_solver_uses_noise_only_in_the_window(tiny_sd3):
    cond = tiny_sd3.encode_prompt(["a thin handwritten 2"] * 2)
    x = torch.randn(2, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigmas = linear_sigmas(4)
    quiet = torch.zeros(4, dtype=torch.float64)
    out0 = chunked_solve(tiny_sd3, cond, x, sigmas, solver="sde_window", chunk_size=2, noise_levels=quiet)
    out1 = chunked_solve(
        tiny_sd3,
        cond,
        x,
        sigmas,
        solver="sde_window",
        chunk_size=2,
        noise_levels=sde_noise_levels(4, 0.5, [1]),
        generator=torch.Generator().manual_seed(1),
    )
    euler = chunked_solve(tiny_sd3, cond, x, sigmas, solver="euler", chunk_size=2)
    torch.testing.assert_close(out0, euler, rtol=0, atol=1e-6)
    assert not torch.allclose(out1, euler)


def test_sigma_window_bounds_are_inclusive() -> None:
    """A step starting exactly at lo or hi is inside the window (exact binary sigmas, no rounding)."""
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    assert sigma_window_levels(sigmas, 0.7, 0.25, 0.75).tolist() == [0.0, 0.7, 0.7, 0.7]
    assert sigma_window_levels(sigmas, 0.7, 0.5, 0.5).tolist() == [0.0, 0.0, 0.7, 0.0]


def test_sde_window_solver_draws_from_the_given_generator_only(tiny_sd3: SD3Adapter) -> None:
    """sde_window noise comes from the run's generator: same seed, same samples; torch's global RNG untouched."""
    cond = tiny_sd3.encode_prompt(["a thin handwritten 2"] * 2)
    x = torch.randn(2, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigmas, levels = linear_sigmas(4), sde_noise_levels(4, 0.5, [1, 2])

    def solve(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return chunked_solve(
            tiny_sd3, cond, x, sigmas, solver="sde_window", chunk_size=1, noise_levels=levels, generator=g
        )

    state = torch.get_rng_state()
    first = solve(3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(solve(3), first) and not torch.equal(solve(4), first)


def test_held_megabytes_counts_a_view_of_the_trajectory_once() -> None:
    """The samples are a view of the trajectory's last latents: their storage is counted once, not twice."""
    from flowrl.objectives.base import RolloutBatch
    from flowrl.rollouts.collect import held_megabytes
    from flowrl.samplers.types import Trajectory

    latents, log_probs = torch.zeros(4, 3, 2, 8, 8), torch.zeros(4, 2, dtype=torch.float64)  # 6144 B, 64 B
    traj = Trajectory(latents, log_probs, linear_sigmas(2), torch.zeros(2, dtype=torch.float64))
    cond, images = {"c": torch.zeros(4, 16)}, torch.zeros(4, 3, 4, 4)  # 256 B, 768 B
    keep = torch.ones(4, dtype=torch.bool)
    batch = RolloutBatch(["a"] * 4, torch.zeros(4), cond, latents[:, -1], traj, traj.sigmas, images, torch.zeros(4),
                         torch.zeros(4), keep, 2)  # fmt: skip
    assert held_megabytes(batch) == (6144 + 64 + 256 + 768) / 2**20


def test_sample_images_needs_one_seed_per_prompt(tiny_sd3: SD3Adapter) -> None:
    """Fewer seeds than prompts is refused before sampling, not answered with fewer images."""
    from flowrl.rollouts.chunked import sample_images

    with pytest.raises(ValueError, match="need one seed per prompt; got 2 prompts and 1 seeds"):
        sample_images(tiny_sd3, ["a bold 1", "a thin 2"], [0], linear_sigmas(2), resolution=(8, 8))
