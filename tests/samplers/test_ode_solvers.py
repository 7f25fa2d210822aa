"""Euler, Heun and DPM-Solver++(2M): exactness on straight paths and convergence order (float64)."""

import pytest
import torch

from flowrl.samplers import linear_sigmas, shift_sigmas
from flowrl.samplers.euler import euler_step
from flowrl.samplers.ode_solve import dpmpp_2m_step, ode_solve

F64 = torch.float64
M, C = 0.7, 0.4  # data distribution N(M, C^2)


def gaussian_velocity(x, sigma):
    """Exact v = E[eps - x0 | x_sigma] for x0 ~ N(M, C^2), eps ~ N(0, 1)."""
    s = sigma.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
    mu, var = (1 - s) * M, (1 - s) ** 2 * C**2 + s**2
    z = (x - mu) / var
    return s * z - (M + (1 - s) * C**2 * z)


def exact_endpoint(x1):
    """The probability-flow map of the Gaussian case: x0 = M + C x1."""
    return M + C * x1


@pytest.mark.parametrize("method", ["euler", "heun", "dpmpp_2m"])
@pytest.mark.parametrize("grid", ["linear", "shifted"])
def test_straight_paths_are_integrated_exactly(method, grid):
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 2, 4, 4, generator=g, dtype=F64), torch.randn(3, 2, 4, 4, generator=g, dtype=F64)
    sigmas = linear_sigmas(7) if grid == "linear" else shift_sigmas(linear_sigmas(7), 3.0)
    out = ode_solve(lambda x, s: eps - x0, eps.clone(), sigmas, method)
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-12)


def test_first_order_dpm_step_is_the_euler_step():
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 5, generator=g, dtype=F64), torch.randn(2, 5, generator=g, dtype=F64)
    out, state = dpmpp_2m_step(x, x - 0.6 * v, 0.6, 0.35, None)
    torch.testing.assert_close(out, euler_step(x, v, 0.6, 0.35), rtol=0, atol=1e-14)
    assert state.lam == pytest.approx(torch.log(torch.tensor(0.4 / 0.6)).item())


def _error(method, steps):
    x1 = torch.linspace(-2.5, 2.5, 41, dtype=F64).view(-1, 1)
    out = ode_solve(gaussian_velocity, x1.clone(), linear_sigmas(steps, sigma_max=1.0), method)
    return float((out - exact_endpoint(x1)).abs().max())


def test_second_order_solvers_beat_euler_on_a_curved_field():
    e_euler, e_heun, e_dpm = _error("euler", 10), _error("heun", 10), _error("dpmpp_2m", 10)
    assert e_heun < e_euler / 4 and e_dpm < e_euler / 2, (e_euler, e_heun, e_dpm)


def test_heun_converges_at_second_order():
    ratio = _error("heun", 20) / _error("heun", 40)
    assert 3.0 < ratio < 5.5, ratio  # halving the step cuts the error about 4x
    euler_ratio = _error("euler", 20) / _error("euler", 40)
    assert 1.6 < euler_ratio < 2.5, euler_ratio


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown solver"):
        ode_solve(lambda x, s: x, torch.zeros(1, 1), linear_sigmas(2), "rk4")
