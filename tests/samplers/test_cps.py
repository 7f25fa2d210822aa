"""Float64 identity tests for flowrl.samplers.cps (Coefficients-Preserving Sampling).

Reference math: shared/reference/grpo-family.md §1.2 ("CPS step").

The contract every SDE step keeps (the Euler step at level 0, prev-sample scoring, per-row
steps, ranks, dtypes) is tested for all four steps in test_sde_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from sde_inputs import F64, SHAPES, xv

from flowrl.samplers import cps_log_prob_reference, cps_step

torch.set_num_threads(1)


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,a", [(1.0, 0.9, 0.8), (0.6, 0.45, 0.5), (0.3, 0.2, 1.0)])
def test_mean_and_std_by_hand(rank: int, sigma: float, sigma_next: float, a: float) -> None:
    x, v = xv(SHAPES[rank], seed=rank)
    out = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(0))
    s = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    expected = (1 - sigma_next) * x0_hat + math.sqrt(max(sigma_next**2 - s**2, 0.0)) * x1_hat
    torch.testing.assert_close(out.mean, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.std, torch.full_like(out.std, s), rtol=0, atol=1e-15)
    assert out.std.shape == (x.shape[0],) + (1,) * (rank - 1)


def test_full_noise_level_drops_the_predicted_noise() -> None:
    x, v = xv(SHAPES[4])
    out = cps_step(x, v, 0.7, 0.4, 1.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, 0.6 * (x - 0.7 * v), rtol=0, atol=1e-15)
    torch.testing.assert_close(out.std, torch.full_like(out.std, 0.4), rtol=0, atol=1e-15)


def test_last_step_is_deterministic_x0_hat() -> None:
    x, v = xv(SHAPES[4])
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
    x, v = xv(SHAPES[rank], seed=7)
    sigma, sigma_next = torch.tensor([0.7, 1.0], dtype=F64), torch.tensor([0.6, 0.9], dtype=F64)
    a = torch.tensor([0.8, 0.5], dtype=F64)
    out = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(11))
    dims = tuple(range(1, rank))
    elem = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.sample)
    torch.testing.assert_close(out.log_prob, elem.mean(dim=dims), rtol=0, atol=1e-12)
    out_sum = cps_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(11), reduce="sum")
    torch.testing.assert_close(out_sum.log_prob, elem.sum(dim=dims), rtol=0, atol=1e-10)


def test_reference_log_prob_drops_constants_and_variance() -> None:
    x, v = xv(SHAPES[5], seed=4)
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
