"""Chunked rollouts and solver sampling through a model adapter."""

import pytest
import torch

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
