"""Float64 identity tests for flowrl.samplers.cps (Coefficients-Preserving Sampling).

Reference math: shared/reference/grpo-family.md §1.2 ("CPS step").
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.samplers import cps_log_prob_reference, cps_step, euler_step

torch.set_num_threads(1)

F64 = torch.float64
SHAPES = {3: (2, 6, 5), 4: (2, 3, 4, 4), 5: (2, 3, 2, 4, 4)}


def _xv(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigmas", [(1.0, 0.9), (0.6, 0.45), (0.05, 0.0)])
def test_noise_level_zero_is_the_euler_step(rank: int, sigmas: tuple[float, float]) -> None:
    """a = 0: ``(1 - s') x0_hat + s' x1_hat = x0_hat + s' (x1_hat - x0_hat) = x - s v + s' v``.

    x0_hat and x1_hat are the u = 0 and u = 1 points of the straight line ``x + (u - sigma) v``
    through x with slope v, so re-noising to sigma' lands on that line at u = sigma': the
    Euler step. Equal up to rounding (the two forms associate differently), not bitwise.
    """
    x, v = _xv(SHAPES[rank])
    out = cps_step(x, v, sigmas[0], sigmas[1], 0.0, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(out.sample, euler_step(x, v, sigmas[0], sigmas[1]), rtol=0, atol=1e-14)
    assert torch.equal(out.sample, out.mean)
    assert torch.equal(out.std, torch.zeros(x.shape[0], *([1] * (rank - 1)), dtype=F64))
    assert torch.equal(out.log_prob, torch.zeros(x.shape[0], dtype=F64))


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,a", [(1.0, 0.9, 0.8), (0.6, 0.45, 0.5), (0.3, 0.2, 1.0)])
def test_mean_and_std_by_hand(rank: int, sigma: float, sigma_next: float, a: float) -> None:
    x, v = _xv(SHAPES[rank], seed=rank)
    out = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(0))
    s = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    expected = (1 - sigma_next) * x0_hat + math.sqrt(max(sigma_next**2 - s**2, 0.0)) * x1_hat
    torch.testing.assert_close(out.mean, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.std, torch.full_like(out.std, s), rtol=0, atol=1e-15)
    assert out.std.shape == (x.shape[0],) + (1,) * (rank - 1)


def test_full_noise_level_drops_the_predicted_noise() -> None:
    x, v = _xv(SHAPES[4])
    out = cps_step(x, v, 0.7, 0.4, 1.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, 0.6 * (x - 0.7 * v), rtol=0, atol=1e-15)
    torch.testing.assert_close(out.std, torch.full_like(out.std, 0.4), rtol=0, atol=1e-15)


def test_last_step_is_deterministic_x0_hat() -> None:
    x, v = _xv(SHAPES[4])
    out = cps_step(x, v, 0.1, 0.0, 0.8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.sample, x - 0.1 * v, rtol=0, atol=1e-15)
    assert torch.equal(out.log_prob, torch.zeros(2, dtype=F64))


def test_coefficients_are_preserved_on_a_straight_path() -> None:
    """Exact (x, v) for one data point x0 and noise x1: x' = (1 - s') x0 + (noise of std s')."""
    n, sigma, sigma_next, a = 40000, 0.7, 0.5, 0.8
    g = torch.Generator().manual_seed(3)
    x0 = torch.full((n, 1, 2, 2), 0.25, dtype=F64)
    x1 = torch.randn(n, 1, 2, 2, generator=g, dtype=F64)
    x, v = (1 - sigma) * x0 + sigma * x1, x1 - x0
    out = cps_step(x, v, sigma, sigma_next, a, generator=g)
    s = sigma_next * math.sin(a * math.pi / 2)
    torch.testing.assert_close(
        out.mean - (1 - sigma_next) * x0, math.sqrt(sigma_next**2 - s**2) * x1, rtol=0, atol=1e-14
    )
    residual = out.sample - (1 - sigma_next) * x0
    assert residual.mean().item() == pytest.approx(0.0, abs=6 * sigma_next / math.sqrt(4 * n))
    assert residual.std().item() == pytest.approx(sigma_next, abs=6 * sigma_next / math.sqrt(8 * n))


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_log_prob_is_the_true_gaussian_density(rank: int) -> None:
    x, v = _xv(SHAPES[rank], seed=7)
    sigma, sigma_next = torch.tensor([0.7, 1.0], dtype=F64), torch.tensor([0.6, 0.9], dtype=F64)
    a = torch.tensor([0.8, 0.5], dtype=F64)
    out = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(11))
    dims = tuple(range(1, rank))
    elem = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.sample)
    torch.testing.assert_close(out.log_prob, elem.mean(dim=dims), rtol=0, atol=1e-12)
    out_sum = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(11), reduce="sum")
    torch.testing.assert_close(out_sum.log_prob, elem.sum(dim=dims), rtol=0, atol=1e-10)


def test_reference_log_prob_drops_constants_and_variance() -> None:
    x, v = _xv(SHAPES[5], seed=4)
    out = cps_step(x, v, 0.6, 0.45, 0.8, generator=torch.Generator().manual_seed(2))
    ref = cps_log_prob_reference(out.sample, out.mean)
    torch.testing.assert_close(ref, -((out.sample - out.mean) ** 2).mean(dim=(1, 2, 3, 4)), rtol=0, atol=0)
    s = out.std.reshape(-1)
    torch.testing.assert_close(
        out.log_prob, ref / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi), rtol=0, atol=1e-12
    )
    assert ref.shape == (2,) and ref.dtype == F64
    assert cps_log_prob_reference(out.sample.float(), out.mean.float()).dtype == torch.float32


def test_reference_log_prob_of_half_precision_inputs_is_computed_in_fp32() -> None:
    """bf16 / fp16 sample and mean are upcast before the difference: an fp32 result equal to the fp64 value.

    A bf16 difference (the inputs' own dtype) rounds ``x' - mean`` to 8 bits and returns bf16.
    """
    g = torch.Generator().manual_seed(8)
    sample = torch.randn(3, 4, 8, 8, generator=g, dtype=F64)
    mean = sample + 1e-3 * torch.randn(3, 4, 8, 8, generator=g, dtype=F64)  # x' close to the mean: a small difference
    for dtype in (torch.bfloat16, torch.float16):
        s, m = sample.to(dtype), mean.to(dtype)
        expected = -((s.double() - m.double()) ** 2).mean(dim=(1, 2, 3))  # of the half-precision values, in fp64
        got = cps_log_prob_reference(s, m)
        assert got.dtype == torch.float32 and got.shape == (3,)
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    mixed = cps_log_prob_reference(sample.to(torch.bfloat16), mean)  # one fp64 input: fp64 throughout
    assert mixed.dtype == F64
    torch.testing.assert_close(mixed, -((sample.to(torch.bfloat16).double() - mean) ** 2).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_prev_sample_scoring_reproduces_log_prob(rank: int) -> None:
    x, v = _xv(SHAPES[rank], seed=3)
    for sigma, sigma_next in [(1.0, 0.92), (0.5, 0.41)]:
        step = cps_step(x, v, sigma, sigma_next, 0.8, generator=torch.Generator().manual_seed(2))
        again = cps_step(x, v, sigma, sigma_next, 0.8, prev_sample=step.sample)
        assert torch.equal(again.log_prob, step.log_prob) and torch.equal(again.mean, step.mean)
        other = cps_step(x, v, sigma, sigma_next, 0.8, prev_sample=step.mean)
        assert bool((other.log_prob > step.log_prob).all())


def test_given_noise_and_per_sample_rows() -> None:
    x, v = _xv((3, 2, 4, 4), seed=5)
    noise = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(6), dtype=F64)
    sig, sig_next = torch.tensor([1.0, 0.6, 0.2], dtype=F64), torch.tensor([0.9, 0.5, 0.0], dtype=F64)
    a = torch.tensor([0.8, 0.0, 0.5], dtype=F64)
    out = cps_step(x, v, sig, sig_next, a, noise=noise)
    torch.testing.assert_close(out.sample, out.mean + out.std * noise, rtol=0, atol=0)
    for b in range(3):
        row = cps_step(
            x[b : b + 1], v[b : b + 1], float(sig[b]), float(sig_next[b]), float(a[b]), noise=noise[b : b + 1]
        )
        torch.testing.assert_close(out.sample[b : b + 1], row.sample, rtol=0, atol=0)
        torch.testing.assert_close(out.log_prob[b : b + 1], row.log_prob, rtol=0, atol=0)
    assert out.log_prob[1].item() == 0.0 and out.log_prob[2].item() == 0.0


def test_float32_inputs_compute_in_float32() -> None:
    x, v = _xv(SHAPES[3])
    out = cps_step(x.float(), v.float(), 0.5, 0.4, 0.8, generator=torch.Generator().manual_seed(0))
    assert out.sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32
