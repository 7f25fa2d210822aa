"""Float64 identity tests for flowrl.samplers.sage_sde (SAGE-GRPO's manifold-aware SDE).

Reference math: shared/reference/nft-awm-solrl-sage.md §4.1.

The contract every SDE step keeps (the Euler step at level 0, prev-sample scoring, per-row
steps, ranks, dtypes) is tested for all four steps in test_sde_contract.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from sde_inputs import F64, SHAPES, gaussian_velocity, xv

from flowrl.samplers import euler_step, flow_sde_step, make_sigmas, sage_sde_step, sage_sde_variance, sde_noise_levels

torch.set_num_threads(1)


def _t(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F64)


def _simpson(lo: float, hi: float, eta: float, points: int = 100_001) -> float:
    """Composite Simpson rule for int_lo^hi eta^2 u / (1 - u) du (odd number of points)."""
    u = torch.linspace(lo, hi, points, dtype=F64)
    f = eta**2 * u / (1 - u)
    w = torch.ones(points, dtype=F64)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return float((w * f).sum() * (hi - lo) / (3 * (points - 1)))


@pytest.mark.parametrize("sigma,sigma_next", [(0.99, 0.9), (0.9, 0.8), (0.5, 0.3), (0.1, 0.0), (0.997, 0.95)])
@pytest.mark.parametrize("eta", [0.5, 1.3])
def test_variance_is_the_integral_of_flow_grpo_diffusion(sigma: float, sigma_next: float, eta: float) -> None:
    var = sage_sde_variance(_t(sigma), _t(sigma_next), eta).item()
    assert var == pytest.approx(_simpson(sigma_next, sigma, eta), rel=1e-10)


def test_variance_is_below_flow_grpo_one_step_variance_near_one() -> None:
    """``int u/(1-u)`` over the step < its value at the noisy end times the step (increasing integrand).

    Against the literal Flow-GRPO formula ``a^2 sigma / (1 - sigma) (sigma - sigma')`` with a = eta
    this holds for every sigma < 1, and the ratio goes to 0 as sigma -> 1 with a fixed step.
    """
    eta, step = 0.7, 0.05
    ratios = []
    for sigma in (0.95, 0.99, 0.995, 0.999):
        sage = sage_sde_variance(_t(sigma), _t(sigma - step), eta).item()
        literal = eta**2 * sigma / (1 - sigma) * step
        implemented = (
            flow_sde_step(
                torch.zeros(1, 1, dtype=F64), torch.zeros(1, 1, dtype=F64), sigma, sigma - step, eta
            ).std.item()
            ** 2
        )
        assert implemented == pytest.approx(literal, rel=1e-12)
        assert sage < literal
        ratios.append(sage / literal)
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < 0.1, ratios
    # Away from 1 and for a small step the two agree to first order.
    sage = sage_sde_variance(_t(0.5), _t(0.5 - 1e-4), eta).item()
    assert sage / (eta**2 * 0.5 / 0.5 * 1e-4) == pytest.approx(1.0, abs=2e-4)


def test_at_pure_noise_the_clamped_variance_exceeds_flow_grpo_substituted_variance() -> None:
    """At sigma = 1 the inequality fails against the *implemented* Flow-GRPO step.

    Flow-GRPO replaces the 1 - sigma denominator by 1 - sigma' there (std^2 = a^2 (sigma - sigma') /
    (1 - sigma')), while SAGE integrates up to the clamp sigma_max = 1 - 3e-3, which adds
    ``eta^2 log((1 - sigma') / 3e-3)``. Documented behaviour of the two literal formulas.
    """
    eta, sigma_next = 0.7, 0.95
    sage = sage_sde_variance(_t(1.0), _t(sigma_next), eta).item()
    flow = (
        flow_sde_step(torch.zeros(1, 1, dtype=F64), torch.zeros(1, 1, dtype=F64), 1.0, sigma_next, eta).std.item() ** 2
    )
    assert flow == pytest.approx(eta**2, rel=1e-12)
    assert sage == pytest.approx(eta**2 * (math.log(0.05 / 3e-3) - (1 - 3e-3 - sigma_next)), rel=1e-12)
    assert sage > 2.5 * flow


def test_clamp_and_its_validation() -> None:
    eta = 0.5
    at_one = sage_sde_variance(_t(1.0), _t(0.9), eta, sigma_max=1 - 1e-3).item()
    assert at_one == pytest.approx(_simpson(0.9, 1 - 1e-3, eta), rel=1e-9)
    assert sage_sde_variance(_t(1.0), _t(0.999), eta).item() == 0.0  # both ends above the clamp
    x, v = xv(SHAPES[4])
    out = sage_sde_step(x, v, 1.0, 0.999, eta, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sample, euler_step(x, v, 1.0, 0.999))
    for bad in (1.0, 0.0, 1.5):
        with pytest.raises(ValueError, match="sigma_max") as info:
            sage_sde_step(x, v, 0.5, 0.4, eta, sigma_max=bad)
        assert "\n" not in str(info.value)


def test_fp32_variance_of_a_tiny_step_is_never_negative() -> None:
    """The variance is >= 0 (so the std is a number) where fp32 rounding makes the integral's terms cancel below 0.

    For sigma' the fp32 neighbour of sigma, ``log1p(-sigma') - log1p(-sigma) - (sigma - sigma')`` rounds to a
    negative value at some sigmas (e.g. sigma = 2^-12); the variance there is 0 and the step is the Euler step.
    """
    sigma = torch.logspace(-6, -0.01, 20_000, dtype=torch.float32)
    sigma_next = torch.nextafter(sigma, torch.zeros_like(sigma))
    raw = torch.log1p(-sigma_next) - torch.log1p(-sigma) - (sigma - sigma_next)
    assert bool((raw < 0).any())  # the grid holds steps whose unclamped integral is negative
    var = sage_sde_variance(sigma, sigma_next, 0.7)
    assert var.dtype == torch.float32 and bool((var >= 0).all())
    x, v = xv((sigma.shape[0], 2, 3))
    out = sage_sde_step(x.float(), v.float(), sigma, sigma_next, 0.7, generator=torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(out.std).all() & torch.isfinite(out.mean).all() & torch.isfinite(out.log_prob).all())


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigma,sigma_next,eta", [(1.0, 0.9, 0.5), (0.7, 0.55, 0.5), (0.2, 0.0, 1.0)])
def test_mean_is_euler_plus_half_variance_times_score(rank: int, sigma: float, sigma_next: float, eta: float) -> None:
    x, v = xv(SHAPES[rank], seed=rank)
    out = sage_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(0))
    var = eta**2 * (math.log((1 - sigma_next) / (1 - min(sigma, 1 - 3e-3))) - (min(sigma, 1 - 3e-3) - sigma_next))
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    torch.testing.assert_close(out.mean, x + (sigma_next - sigma) * v + 0.5 * var * score, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.std, torch.full_like(out.std, math.sqrt(var)), rtol=0, atol=1e-14)
    plain = sage_sde_step(x, v, sigma, sigma_next, eta, score_correction=False, prev_sample=out.sample)
    torch.testing.assert_close(plain.mean, euler_step(x, v, sigma, sigma_next), rtol=0, atol=0)
    assert torch.equal(plain.std, out.std)


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_log_prob_matches_torch_normal(rank: int) -> None:
    x, v = xv(SHAPES[rank], seed=7)
    sigma, sigma_next = torch.tensor([0.7, 1.0], dtype=F64), torch.tensor([0.6, 0.93], dtype=F64)
    eta = torch.tensor([0.5, 0.8], dtype=F64)
    out = sage_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(11))
    dims = tuple(range(1, rank))
    elem = torch.distributions.Normal(out.mean, out.std.expand_as(out.mean)).log_prob(out.sample)
    torch.testing.assert_close(out.log_prob, elem.mean(dim=dims), rtol=0, atol=1e-12)
    out_sum = sage_sde_step(x, v, sigma, sigma_next, eta, generator=torch.Generator().manual_seed(11), reduce="sum")
    torch.testing.assert_close(out_sum.log_prob, elem.sum(dim=dims), rtol=0, atol=1e-10)


def test_marginals_preserved_for_gaussian_data() -> None:
    """x0 ~ N(m, c^2) with the exact velocity: SAGE sampling must end at N(m, c^2).

    With ``score_correction=False`` (the reference's sde_solver=False) the final std is ~0.84.
    """
    m, c, eta, num_steps, n = 0.5, 0.3, 1.0, 200, 20000

    velocity = gaussian_velocity(m, c)
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, eta)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 1, 1, generator=g, dtype=F64)
    plain = x.clone()
    for i in range(num_steps):
        noise = torch.randn(x.shape, generator=g, dtype=F64)
        x = sage_sde_step(x, velocity(x, sigmas[i]), sigmas[i], sigmas[i + 1], float(levels[i]), noise=noise).sample
        plain = sage_sde_step(
            plain,
            velocity(plain, sigmas[i]),
            sigmas[i],
            sigmas[i + 1],
            float(levels[i]),
            noise=noise,
            score_correction=False,
        ).sample
    assert x.mean().item() == pytest.approx(m, abs=0.02)
    assert x.std().item() == pytest.approx(c, abs=0.02)
    assert abs(plain.std().item() - c) > 0.2
