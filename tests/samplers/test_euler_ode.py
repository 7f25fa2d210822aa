"""Float64 identity tests for flowrl.samplers.euler."""

from __future__ import annotations

import pytest
import torch

from flowrl.samplers import euler_step, linear_sigmas, make_sigmas, shift_sigmas

torch.set_num_threads(1)


def _data(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def test_step_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=torch.float64)
    v = torch.tensor([[0.5, -4.0], [2.0, 1.0]], dtype=torch.float64)
    out = euler_step(x, v, 0.75, 0.5)
    expected = torch.tensor([[0.875, 3.0], [-1.5, 0.25]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out.dtype == torch.float64


def test_step_general() -> None:
    x, v = _data((3, 2, 4, 4))
    torch.testing.assert_close(euler_step(x, v, 0.9, 0.65), x + (0.65 - 0.9) * v, rtol=0, atol=1e-15)


def test_step_returns_the_latents_dtype_whatever_the_velocitys() -> None:
    """The result is in x's dtype: a wider v (fp32 or fp64 velocity for a bf16 / fp32 latent) is cast to it first."""
    x, v = _data((3, 2, 4, 4), seed=1)
    for x_dtype, v_dtype in (
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
        (torch.float16, torch.float64),
    ):
        xl, vw = x.to(x_dtype), v.to(v_dtype)
        out = euler_step(xl, vw, 0.75, 0.5)  # dt = -0.25, exact in every dtype
        assert out.dtype == x_dtype
        assert torch.equal(out, xl - 0.25 * vw.to(x_dtype))


GRIDS = {
    "linear7": linear_sigmas(7),
    "shift3": make_sigmas("shift", 11, shift=3.0),
    "dynamic": make_sigmas("dynamic_shift", 5, image_seq_len=4096),
    "one_step": linear_sigmas(1),
    "uneven": torch.tensor([1.0, 0.97, 0.6, 0.59, 0.1, 0.0], dtype=torch.float64),
}


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("shape", [(2, 5, 3), (2, 3, 4, 4), (2, 3, 2, 4, 4)])
def test_straight_line_field_lands_on_data(grid: str, shape: tuple[int, ...]) -> None:
    """For one data point the path is straight, v = eps - x0 = (x - x0)/sigma: Euler is exact on any grid."""
    sig = GRIDS[grid]
    x0, eps = _data(shape, seed=1)
    x_const, x_field = eps.clone(), eps.clone()
    for i in range(sig.shape[0] - 1):
        x_const = euler_step(x_const, eps - x0, sig[i], sig[i + 1])
        x_field = euler_step(x_field, (x_field - x0) / sig[i], sig[i], sig[i + 1])
        # Intermediate states stay on the straight path.
        s = sig[i + 1]
        torch.testing.assert_close(x_field, (1 - s) * x0 + s * eps, rtol=0, atol=1e-12)
    torch.testing.assert_close(x_const, x0, rtol=0, atol=1e-12)
    torch.testing.assert_close(x_field, x0, rtol=0, atol=1e-12)


def test_per_sample_sigmas() -> None:
    """Each sample walks its own grid, given as (B,) sigmas."""
    x0, eps = _data((3, 2, 4, 4), seed=2)
    grids = torch.stack([linear_sigmas(6), shift_sigmas(linear_sigmas(6), 3.0), shift_sigmas(linear_sigmas(6), 0.4)])
    x = eps.clone()
    for i in range(6):
        s, s_next = grids[:, i], grids[:, i + 1]
        step = euler_step(x, (x - x0) / s.reshape(-1, 1, 1, 1), s, s_next)
        for b in range(3):
            torch.testing.assert_close(
                step[b : b + 1],
                euler_step(x[b : b + 1], ((x - x0) / s.reshape(-1, 1, 1, 1))[b : b + 1], s[b], s_next[b]),
                rtol=0,
                atol=0,
            )
        x = step
    torch.testing.assert_close(x, x0, rtol=0, atol=1e-12)


def test_mismatched_per_sample_sigma_raises() -> None:
    x, v = _data((3, 2, 4, 4))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        euler_step(x, v, torch.tensor([0.9, 0.8], dtype=torch.float64), 0.5)
