"""Float64 identity tests for flowrl.samplers.dance_sde (DanceGRPO's constant-diffusion SDE).

Reference math: shared/reference/grpo-family.md §2.2.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.samplers import dance_sde_step, euler_step, make_sigmas, sde_noise_levels

torch.set_num_threads(1)

F64 = torch.float64
SHAPES = {3: (2, 6, 5), 4: (2, 3, 4, 4), 5: (2, 3, 2, 4, 4)}


def _xv(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigmas", [(1.0, 0.9), (0.6, 0.45), (0.05, 0.0)])
def test_eta_zero_is_euler(rank: int, sigmas: tuple[float, float]) -> None:
    x, v = _xv(SHAPES[rank])
    out = dance_sde_step(x, v, sigmas[0], sigmas[1], 0.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out.sample, euler_step(x, v, sigmas[0], sigmas[1]))
    assert torch.equal(out.mean, out.sample)
    assert torch.equal(out.std, torch.zeros(x.shape[0], *([1] * (rank - 1)), dtype=F64))
    assert torch.equal(out.log_prob, torch.zeros(x.shape[0], dtype=F64))


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,eta", [(1.0, 0.9, 0.3), (0.7, 0.55, 0.5), (0.2, 0.0, 0.3)])
def test_mean_and_std_match_the_reference_score_form(rank: int, sigma: float, sigma_next: float, eta: float) -> None:
    x, v = _xv(SHAPES[rank], seed=rank)
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
    x, v = _xv(SHAPES[rank], seed=7)
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


def test_given_noise_defines_the_sample() -> None:
    x, v = _xv(SHAPES[4])
    noise = torch.randn(SHAPES[4], generator=torch.Generator().manual_seed(5), dtype=F64)
    out = dance_sde_step(x, v, 0.5, 0.4, 0.3, noise=noise)
    torch.testing.assert_close(out.sample, out.mean + out.std * noise, rtol=0, atol=0)


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_prev_sample_scoring_reproduces_log_prob(rank: int) -> None:
    x, v = _xv(SHAPES[rank], seed=3)
    for sigma, sigma_next in [(1.0, 0.92), (0.5, 0.41)]:
        step = dance_sde_step(x, v, sigma, sigma_next, 0.3, generator=torch.Generator().manual_seed(2))
        again = dance_sde_step(x, v, sigma, sigma_next, 0.3, prev_sample=step.sample)
        assert torch.equal(again.log_prob, step.log_prob) and torch.equal(again.mean, step.mean)
        other = dance_sde_step(x, v, sigma, sigma_next, 0.3, prev_sample=step.mean)
        assert bool((other.log_prob > step.log_prob).all())


def test_per_sample_rows_and_flattened_ranks_agree() -> None:
    x5, v5 = _xv(SHAPES[5], seed=8)
    noise = torch.randn(SHAPES[5], generator=torch.Generator().manual_seed(1), dtype=F64)
    sig, sig_next, eta = (
        torch.tensor([0.9, 0.5], dtype=F64),
        torch.tensor([0.8, 0.3], dtype=F64),
        torch.tensor([0.3, 0.6], dtype=F64),
    )
    out5 = dance_sde_step(x5, v5, sig, sig_next, eta, noise=noise)
    out3 = dance_sde_step(x5.reshape(2, 24, 4), v5.reshape(2, 24, 4), sig, sig_next, eta, noise=noise.reshape(2, 24, 4))
    torch.testing.assert_close(out3.sample.reshape(SHAPES[5]), out5.sample, rtol=0, atol=0)
    torch.testing.assert_close(out3.log_prob, out5.log_prob, rtol=0, atol=1e-14)
    for b in range(2):
        row = dance_sde_step(
            x5[b : b + 1], v5[b : b + 1], float(sig[b]), float(sig_next[b]), float(eta[b]), noise=noise[b : b + 1]
        )
        torch.testing.assert_close(out5.sample[b : b + 1], row.sample, rtol=0, atol=0)
        torch.testing.assert_close(out5.log_prob[b : b + 1], row.log_prob, rtol=0, atol=0)


def test_float32_inputs_compute_in_float32() -> None:
    x, v = _xv(SHAPES[4])
    out = dance_sde_step(x.float(), v.float(), 0.5, 0.4, 0.3, generator=torch.Generator().manual_seed(0))
    assert out.sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32


def _gaussian_velocity(m: float, c: float):
    def velocity(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        var = (1 - s) ** 2 * c**2 + s**2
        return -m + (s - (1 - s) * c**2) * (x - (1 - s) * m) / var

    return velocity


def test_marginals_preserved_for_gaussian_data() -> None:
    """x0 ~ N(m, c^2) with the exact velocity: Dance-SDE sampling must end at N(m, c^2).

    The same loop without the score term (x + Delta v + eta sqrt(-Delta) z) ends with std ~0.56,
    so the tolerance discriminates.
    """
    m, c, eta, num_steps, n = 0.5, 0.3, 0.7, 200, 20000
    velocity = _gaussian_velocity(m, c)
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
