"""Tests for the black-box solves: ode_solve methods and the windowed SDE solve."""

from __future__ import annotations

import pytest
import torch

from flowrl.samplers import linear_sigmas, make_sigmas, ode_solve, rollout, sde_window_solve, window_noise_levels

torch.set_num_threads(1)

F64 = torch.float64


def _field(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.reshape(-1, *([1] * (x.ndim - 1))).to(x.dtype)
    return 0.4 * x * (1 + s) - torch.sin(3 * x) * s + 0.1


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_zero_window_is_the_euler_ode_solve(rank: int) -> None:
    shape = {3: (2, 6, 5), 4: (2, 3, 4, 4), 5: (2, 3, 2, 4, 4)}[rank]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    sigmas = make_sigmas("shift", 8, shift=3.0)
    out = sde_window_solve(_field, x, sigmas, torch.zeros(8, dtype=F64), torch.Generator().manual_seed(1))
    assert out.dtype == F64 and out.shape == shape
    torch.testing.assert_close(out, ode_solve(_field, x, sigmas, "euler"), rtol=0, atol=1e-14)


def test_matches_the_last_rollout_latent() -> None:
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    sigmas, levels = linear_sigmas(6), window_noise_levels(6, 0.7, 1, 3)
    out = sde_window_solve(_field, x, sigmas, levels, torch.Generator().manual_seed(5))
    ref = rollout(_field, x, sigmas, levels, generator=torch.Generator().manual_seed(5)).latents[:, -1]
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    other = sde_window_solve(_field, x, sigmas, levels, torch.Generator().manual_seed(6))
    assert not torch.equal(out, other)


def test_only_noise_inside_the_window_matters() -> None:
    x = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    sigmas, levels = linear_sigmas(6), window_noise_levels(6, 0.7, 2, 2)
    noises = torch.randn(2, 6, 1, 3, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    base = sde_window_solve(_field, x, sigmas, levels, noises=noises)
    outside, inside = noises.clone(), noises.clone()
    outside[:, [0, 1, 4, 5]] = torch.randn(2, 4, 1, 3, 3, generator=torch.Generator().manual_seed(8), dtype=F64)
    inside[:, 3] += 1.0
    assert torch.equal(sde_window_solve(_field, x, sigmas, levels, noises=outside), base)
    assert not torch.allclose(sde_window_solve(_field, x, sigmas, levels, noises=inside), base)


def test_bad_noise_levels_shape() -> None:
    with pytest.raises(ValueError, match=r"noise_levels must have shape \(4,\)") as info:
        sde_window_solve(_field, torch.zeros(1, 2), linear_sigmas(4), torch.zeros(5, dtype=F64))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("method", ["euler", "heun", "dpmpp_2m"])
def test_ode_solve_is_deterministic_and_keeps_dtype(method: str) -> None:
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(9), dtype=F64)
    a, b = ode_solve(_field, x, linear_sigmas(5), method), ode_solve(_field, x, linear_sigmas(5), method)
    assert torch.equal(a, b) and a.dtype == F64 and a.shape == x.shape
