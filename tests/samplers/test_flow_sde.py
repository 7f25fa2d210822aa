"""Float64 identity tests for flowrl.samplers.flow_sde and flowrl.samplers.gaussian.

Reference math: Flow-GRPO (Liu et al., 2025) eq. (8)-(9), as written up in
shared/reference/grpo-family.md §1.2.

The contract every SDE step keeps (the Euler step at level 0, prev-sample scoring, per-row
steps, ranks, dtypes) is tested for all four steps in test_sde_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from sde_inputs import F64, SHAPES, gaussian_velocity, xv

from flowrl.samplers import flow_sde_step, gaussian_log_prob, make_sigmas, sde_noise_levels

torch.set_num_threads(1)


def _col(value: torch.Tensor | float, ndim: int) -> torch.Tensor:
    """(B,) or scalar -> (B, 1, ..., 1) float64 for hand formulas."""
    t = torch.as_tensor(value, dtype=F64)
    return t if t.ndim == 0 else t.reshape(-1, *([1] * (ndim - 1)))


def _reference_s(sigma: float, a: float) -> float:
    return a * math.sqrt(sigma / (1 - sigma))


# --------------------------------------------------------------------------- mean / std


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,a", [(0.8, 0.7, 0.7), (0.35, 0.2, 1.0), (0.1, 0.0, 0.5)])
def test_mean_matches_both_reference_forms(rank: int, sigma: float, sigma_next: float, a: float) -> None:
    x, v = xv(SHAPES[rank], seed=rank)
    out = flow_sde_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(0))
    s, dt = _reference_s(sigma, a), sigma_next - sigma
    product_form = x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    score = -(x + (1 - sigma) * v) / sigma
    score_form = x + (v - s**2 / 2 * score) * dt
    torch.testing.assert_close(out.mean, product_form, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.mean, score_form, rtol=0, atol=1e-12)


def test_mean_at_pure_noise_uses_the_step_diffusion() -> None:
    """At sigma = 1 the mean formula still holds with the (substituted) diffusion of this step."""
    x, v = xv(SHAPES[4])
    sigma, sigma_next, a = 1.0, 0.9, 0.7
    out = flow_sde_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(0))
    s = out.std.reshape(-1)[0].item() / math.sqrt(sigma - sigma_next)
    dt = sigma_next - sigma
    expected = x * (1 + s**2 * dt / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(out.mean, expected, rtol=0, atol=1e-12)
    assert bool(torch.isfinite(out.sample).all()) and bool(torch.isfinite(out.log_prob).all())
    assert bool((out.std > 0).all())


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_std_formula(rank: int) -> None:
    x, v = xv(SHAPES[rank])
    sigma, sigma_next, a = 0.6, 0.45, 0.8
    out = flow_sde_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(0))
    expected = _reference_s(sigma, a) * math.sqrt(sigma - sigma_next)
    assert out.std.shape == (x.shape[0],) + (1,) * (rank - 1)
    torch.testing.assert_close(out.std, torch.full_like(out.std, expected), rtol=0, atol=1e-14)


def test_std_at_pure_noise_matches_reference() -> None:
    x, v = xv(SHAPES[4])
    sigma_next, a = 0.9, 0.7
    out = flow_sde_step(x, v, 1.0, sigma_next, a, generator=torch.Generator().manual_seed(0))
    expected = a * math.sqrt(1.0 / (1.0 - sigma_next)) * math.sqrt(1.0 - sigma_next)
    torch.testing.assert_close(out.std, torch.full_like(out.std, expected), rtol=0, atol=1e-14)


# --------------------------------------------------------------------------- log-prob


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_log_prob_matches_torch_normal(rank: int) -> None:
    x, v = xv(SHAPES[rank], seed=7)
    sigma = torch.tensor([0.7, 0.4], dtype=F64)
    sigma_next = torch.tensor([0.6, 0.3], dtype=F64)
    a = torch.tensor([0.7, 1.2], dtype=F64)
    gen_seed = 11
    out = flow_sde_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(gen_seed))
    dims = tuple(range(1, rank))
    elem = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.sample)
    torch.testing.assert_close(out.log_prob, elem.mean(dim=dims), rtol=0, atol=1e-12)
    out_sum = flow_sde_step(x, v, sigma, sigma_next, a, generator=torch.Generator().manual_seed(gen_seed), reduce="sum")
    assert torch.equal(out_sum.sample, out.sample)
    torch.testing.assert_close(out_sum.log_prob, elem.sum(dim=dims), rtol=0, atol=1e-10)
    assert out.log_prob.shape == (2,) and out.log_prob.dtype == F64


def test_generator_is_deterministic() -> None:
    x, v = xv(SHAPES[5])
    a = flow_sde_step(x, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(9))
    b = flow_sde_step(x, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(9))
    c = flow_sde_step(x, v, 0.5, 0.4, 0.7, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a.sample, b.sample) and torch.equal(a.log_prob, b.log_prob)
    assert not torch.equal(a.sample, c.sample)


def test_empirical_moments_match_mean_and_std() -> None:
    n = 40000
    base_x, base_v = xv((1, 2, 2, 2), seed=4)
    x, v = base_x.expand(n, -1, -1, -1).contiguous(), base_v.expand(n, -1, -1, -1).contiguous()
    out = flow_sde_step(x, v, 0.7, 0.55, 0.9, generator=torch.Generator().manual_seed(123))
    std = out.std.reshape(-1)[0].item()
    emp_mean = out.sample.mean(dim=0)
    emp_std = out.sample.std(dim=0)
    # Standard errors: std/sqrt(n) ~ 0.0017 and std/sqrt(2n) ~ 0.0012 for std ~ 0.34.
    torch.testing.assert_close(emp_mean, out.mean[0], rtol=0, atol=6 * std / math.sqrt(n))
    torch.testing.assert_close(emp_std, torch.full_like(emp_std, std), rtol=0, atol=6 * std / math.sqrt(2 * n))


def test_marginals_preserved_for_gaussian_data() -> None:
    """x0 ~ N(m, c^2): the exact velocity E[eps - x0 | x_s] is affine in x; SDE sampling must end at N(m, c^2).

    Without the score correction (plain Euler-Maruyama on v) the final std is ~0.70 instead of 0.30;
    with half the correction it is ~0.41, so the tolerance below discriminates.
    """
    m, c, a, num_steps, n = 0.5, 0.3, 0.7, 200, 20000

    velocity = gaussian_velocity(m, c)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 1, 1, generator=g, dtype=F64)
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, a)
    for i in range(num_steps):
        x = flow_sde_step(x, velocity(x, sigmas[i]), sigmas[i], sigmas[i + 1], float(levels[i]), generator=g).sample
    assert x.mean().item() == pytest.approx(m, abs=0.02)
    assert x.std().item() == pytest.approx(c, abs=0.02)


# --------------------------------------------------------------------------- gaussian_log_prob


def test_gaussian_zero_std_gives_zero() -> None:
    g = torch.Generator().manual_seed(0)
    sample, mean = torch.randn(3, 2, 3, generator=g, dtype=F64), torch.randn(3, 2, 3, generator=g, dtype=F64)
    std = torch.tensor([0.5, 0.0, 2.0], dtype=F64).reshape(3, 1, 1)
    for reduce in ("mean", "sum"):
        out = gaussian_log_prob(sample, mean, std, reduce)
        assert out[1].item() == 0.0
        elem = torch.distributions.Normal(mean[[0, 2]], std[[0, 2]].expand(2, 2, 3)).log_prob(sample[[0, 2]])
        expected = elem.mean(dim=(1, 2)) if reduce == "mean" else elem.sum(dim=(1, 2))
        torch.testing.assert_close(out[[0, 2]], expected, rtol=0, atol=1e-12)
    # Element-wise zero std inside a sample: those elements contribute 0 (and no NaN/inf).
    std_elem = torch.full((3, 2, 3), 0.7, dtype=F64)
    std_elem[0, 0, 0] = 0.0
    out = gaussian_log_prob(sample, mean, std_elem, "sum")
    elem = torch.distributions.Normal(mean, torch.full_like(mean, 0.7)).log_prob(sample)
    elem[0, 0, 0] = 0.0
    torch.testing.assert_close(out, elem.sum(dim=(1, 2)), rtol=0, atol=1e-12)


def test_gaussian_one_element_samples_keep_one_log_prob_per_sample() -> None:
    """(B,) samples: an empty tuple of non-batch dims must not reduce over the batch (the fused kernel's (B,))."""
    sample, mean, std = torch.tensor([0.0, 1.0, 3.0], dtype=F64), torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    expected = torch.distributions.Normal(mean, std).log_prob(sample)
    for reduce in ("mean", "sum"):
        torch.testing.assert_close(gaussian_log_prob(sample, mean, std, reduce), expected, rtol=0, atol=1e-12)
    step = flow_sde_step(sample, mean, 0.7, 0.5, 0.7, prev_sample=sample)
    assert step.log_prob.shape == (3,)


def test_gaussian_bad_reduce_raises() -> None:
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="reduce") as info:
        gaussian_log_prob(x, x, torch.ones(2, 1, dtype=F64), "max")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
