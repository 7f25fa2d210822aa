"""Float64 identity tests for flowrl.samplers.cfg."""

from __future__ import annotations

import torch

from flowrl.samplers import cfg

torch.set_num_threads(1)


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64), torch.randn(
        2, 4, 3, 3, generator=g, dtype=torch.float64
    )


def test_scale_one_returns_cond() -> None:
    v_u, v_c = _pair()
    assert torch.equal(cfg(v_u, v_c, 1.0), v_c)


def test_scale_zero_returns_uncond() -> None:
    v_u, v_c = _pair()
    assert torch.equal(cfg(v_u, v_c, 0.0), v_u)


def test_formula_by_hand() -> None:
    v_u = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    v_c = torch.tensor([[3.0, 1.0, 0.5]], dtype=torch.float64)
    # 4.5 * (v_c - v_u) = [9, 13.5, 0]
    expected = torch.tensor([[10.0, 11.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(cfg(v_u, v_c, 4.5), expected, rtol=0, atol=1e-15)
    g_u, g_c = _pair()
    torch.testing.assert_close(cfg(g_u, g_c, 7.0), 7.0 * g_c - 6.0 * g_u, rtol=0, atol=1e-13)
