"""Float64 identity tests for flowrl.samplers.dance_sde (DanceGRPO's constant-diffusion SDE).

Reference math: shared/reference/grpo-family.md §2.2.

The contract every SDE step keeps (the Euler step at level 0, prev-sample scoring, per-row
steps, ranks, dtypes) is tested for all four steps in test_sde_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from sde_inputs import F64, SHAPES, gaussian_velocity, xv

from flowrl.samplers import dance_sde_step, make_sigmas, sde_noise_levels

torch.set_num_threads(1)


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,eta", [(1.0, 0.9, 0.3), (0.7, 0.55, 0.5), (0.2, 0.0, 0.3)])
def test_mean_and_std_match_the_reference_score_form(rank: int, sigma: float, sigma_next: float, eta: float) -> None:
    x, v = xv(SHAPES[rank], seed=rank)
    out = dance_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(0))
    dt = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    torch.testing.assert_close(out.mean, x + dt * v + dt * (-0.5 * eta**2 * score), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        out.std, torch.full_like(out.std, eta * math.sqrt(sigma - sigma_next)), rtol=0, atol=1e-15
    )
    assert out.std.shape == (x.shape[0],) + (1,) * (rank - 1)


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_log_prob_matches_torch_normal(rank: int) -> None:
    x, v = xv(SHAPES[rank], seed=7)
    sigma, sigma_next = torch.tensor([0.7, 1.0], dtype=F64), torch.tensor([0.6, 0.93], dtype=F64)
    eta = torch.tensor([0.3, 0.8], dtype=F64)
    out = dance_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(11))
    dims = tuple(range(1, rank))
    elem = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.sample)
    torch.testing.assert_close(out.log_prob, elem.mean(dim=dims), rtol=0, atol=1e-12)
    out_sum = dance_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(11), reduce="sum")
    assert torch.equal(out_sum.sample, out.sample)
    torch.testing.assert_close(out_sum.log_prob, elem.sum(dim=dims), rtol=0, atol=1e-10)
    assert out.log_prob.shape == (2,) and out.log_prob.dtype == F64


def test_marginals_preserved_for_gaussian_data() -> None:
    """x0 ~ N(m, c^2) with the exact velocity: Dance-SDE sampling must end at N(m, c^2).

    The same loop without the score term (x + Delta v + eta sqrt(-Delta) z) ends with std ~0.56,
    so the tolerance discriminates.
    """
    m, c, eta, num_steps, n = 0.5, 0.3, 0.7, 200, 20000
    velocity = gaussian_velocity(m, c)
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, eta)
    g = torch.Generator().manual_seed(0)
    x_init = torch.randn(n, 1, 1, 1, generator=g, dtype=F64)
    x, naive = x_init.clone(), x_init.clone()
    for i in range(num_steps):
        noise = torch.randn(x.shape, generator=g, dtype=F64)
        x = dance_sde_step(x, velocity(x, sigmas[i]), sigmas[i], sigmas[i + 1], float(levels[i]), noise=noise).sample
        dt = float(sigmas[i + 1] - sigmas[i])
        naive = naive + dt * velocity(naive, sigmas[i]) + float(levels[i]) * math.sqrt(-dt) * noise
    assert x.mean().item() == pytest.approx(m, abs=0.02)
    assert x.std().item() == pytest.approx(c, abs=0.02)
    assert abs(naive.std().item() - c) > 0.2
