"""Float64 identity tests for flowrl.samplers.schedules."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.samplers import dynamic_shift_mu, dynamic_shift_sigmas, linear_sigmas, make_sigmas, shift_sigmas

torch.set_num_threads(1)


def _one_line_value_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("num_steps", [1, 4, 28])
def test_linear_endpoints_monotonic_length(num_steps: int) -> None:
    sig = linear_sigmas(num_steps)
    assert sig.dtype == torch.float64 and sig.shape == (num_steps + 1,)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0
    assert bool((sig[1:] < sig[:-1]).all())
    torch.testing.assert_close(
        sig[:-1] - sig[1:], torch.full((num_steps,), 1.0 / num_steps, dtype=torch.float64), rtol=0, atol=1e-14
    )


def test_linear_sigma_max() -> None:
    sig = linear_sigmas(4, sigma_max=0.8)
    torch.testing.assert_close(sig, torch.tensor([0.8, 0.6, 0.4, 0.2, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)


def test_shift_hand_values() -> None:
    sig = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=torch.float64)
    # shift=3: 3s / (1 + 2s)
    expected = torch.tensor([1.0, 2.25 / 2.5, 1.5 / 2.0, 0.75 / 1.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(shift_sigmas(sig, 3.0), expected, rtol=0, atol=1e-15)
    assert shift_sigmas(sig, 3.0)[2].item() == pytest.approx(0.75, abs=1e-15)
    # shift=0.5 spends more steps at low noise: 0.5 * 0.5 / (1 - 0.25) = 1/3
    assert shift_sigmas(torch.tensor([0.5], dtype=torch.float64), 0.5).item() == pytest.approx(1.0 / 3.0, abs=1e-15)


@pytest.mark.parametrize("shift", [0.3, 1.0, 3.0, 7.5])
def test_shift_fixes_endpoints_and_stays_monotonic(shift: float) -> None:
    out = shift_sigmas(linear_sigmas(10), shift)
    assert out[0].item() == pytest.approx(1.0, abs=1e-15) and out[-1].item() == 0.0
    assert bool((out[1:] < out[:-1]).all())
    assert out.dtype == torch.float64


def test_shift_one_is_identity() -> None:
    sig = linear_sigmas(13)
    torch.testing.assert_close(shift_sigmas(sig, 1.0), sig, rtol=0, atol=0)


def test_shift_rejects_non_positive() -> None:
    assert "shift" in _one_line_value_error(shift_sigmas, linear_sigmas(3), 0.0)
    _one_line_value_error(shift_sigmas, linear_sigmas(3), -2.0)


def test_dynamic_shift_mu_linear_formula() -> None:
    assert dynamic_shift_mu(256) == pytest.approx(0.5, abs=1e-15)
    assert dynamic_shift_mu(4096) == pytest.approx(1.15, abs=1e-15)
    assert dynamic_shift_mu(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840, abs=1e-15)
    assert dynamic_shift_mu(100, base_seq_len=0, max_seq_len=200, base_shift=1.0, max_shift=3.0) == pytest.approx(
        2.0, abs=1e-15
    )


@pytest.mark.parametrize("mu", [-0.4, 0.0, 0.73, 1.15])
def test_dynamic_shift_equals_shift_with_exp_mu(mu: float) -> None:
    sig = linear_sigmas(9)
    out = dynamic_shift_sigmas(sig, mu)
    torch.testing.assert_close(out, shift_sigmas(sig, math.exp(mu)), rtol=0, atol=1e-15)
    # FLUX's written form e^mu / (e^mu + (1/s - 1)) on s > 0; 0 maps to 0.
    inner = sig[:-1]
    flux = math.exp(mu) / (math.exp(mu) + (1.0 / inner - 1.0))
    torch.testing.assert_close(out[:-1], flux, rtol=0, atol=1e-14)
    assert out[-1].item() == 0.0


def test_make_sigmas_dispatch() -> None:
    torch.testing.assert_close(make_sigmas("linear", 6), linear_sigmas(6), rtol=0, atol=0)
    torch.testing.assert_close(make_sigmas("shift", 6, shift=3.0), shift_sigmas(linear_sigmas(6), 3.0), rtol=0, atol=0)
    torch.testing.assert_close(make_sigmas("shift", 6), linear_sigmas(6), rtol=0, atol=0)
    torch.testing.assert_close(
        make_sigmas("dynamic_shift", 6, image_seq_len=1024),
        dynamic_shift_sigmas(linear_sigmas(6), dynamic_shift_mu(1024)),
        rtol=0,
        atol=0,
    )
    for kind in ("linear", "shift", "dynamic_shift"):
        out = make_sigmas(kind, 5, shift=2.0, image_seq_len=4096)
        assert out.shape == (6,) and out.dtype == torch.float64


def test_make_sigmas_errors_are_one_line() -> None:
    assert "cosine" in _one_line_value_error(make_sigmas, "cosine", 4)
    assert "image_seq_len" in _one_line_value_error(make_sigmas, "dynamic_shift", 4)
    assert "num_steps" in _one_line_value_error(make_sigmas, "linear", 0)
    assert "num_steps" in _one_line_value_error(make_sigmas, "shift", -3, shift=3.0)
    assert "num_steps" in _one_line_value_error(make_sigmas, "linear", 2.5)
    assert "sigma_max" in _one_line_value_error(linear_sigmas, 4, sigma_max=1.5)
    _one_line_value_error(linear_sigmas, 4, sigma_max=0.0)
