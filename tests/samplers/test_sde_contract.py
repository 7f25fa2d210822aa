"""The contract every SDE step keeps (Flow-SDE, Dance-SDE, CPS, SAGE), in float64.

Each step is ``step(x, v, sigma, sigma_next, level, *, noise, generator, prev_sample, reduce) ->
SDEStep(sample, mean, std, log_prob)`` (``flowrl.samplers.types.SDEStepFn``). Whatever its
moments, it must: be the Euler step at level 0; score a stored sample to the log-prob it was
drawn with; draw ``mean + std * noise`` from given noise; treat each batch row on its own (per-row
sigma, sigma_next and level); see a latent only through its elements (any rank gives the numbers
of its flattened view); and compute in the inputs' float dtype. Each algorithm's own moments are
pinned in its file (test_flow_sde.py, test_dance_sde.py, test_cps.py, test_sage_sde.py).
"""

from __future__ import annotations

import pytest
import torch
from sde_inputs import F64, SHAPES, xv

from flowrl.samplers import euler_step, get_sde_step

torch.set_num_threads(1)

# sampler.sde -> (the registry's step, as rollouts and objectives call it; a typical noise level:
# Flow-GRPO's a, DanceGRPO's eta, CPS's a, SAGE's eta)
LEVELS = {"flow": 0.7, "dance": 0.3, "cps": 0.8, "sage": 0.5}
STEPS = {name: (get_sde_step(name), level) for name, level in LEVELS.items()}
# CPS reaches the Euler point as (1 - s') x0_hat + s' x1_hat: x0_hat and x1_hat are the u = 0 and
# u = 1 points of the line x + (u - s) v, so re-noising to s' lands on it at u = s' (the Euler
# step), equal up to rounding since the two forms associate differently; the others are bitwise
EULER_ATOL = {"flow": 0.0, "dance": 0.0, "cps": 1e-14, "sage": 0.0}


@pytest.mark.parametrize("sde", STEPS)
@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("sigmas", [(1.0, 0.9), (0.6, 0.45), (0.05, 0.0)])
def test_level_zero_is_the_euler_step(sde: str, rank: int, sigmas: tuple[float, float]) -> None:
    step, _ = STEPS[sde]
    x, v = xv(SHAPES[rank])
    out = step(x, v, sigmas[0], sigmas[1], 0.0, generator=torch.Generator().manual_seed(1))
    euler = euler_step(x, v, sigmas[0], sigmas[1])
    torch.testing.assert_close(out.sample, euler, rtol=0, atol=EULER_ATOL[sde])
    assert torch.equal(out.mean, out.sample)
    assert torch.equal(out.std, torch.zeros(x.shape[0], *([1] * (rank - 1)), dtype=F64))
    assert torch.equal(out.log_prob, torch.zeros(x.shape[0], dtype=F64)) and out.sample.dtype == F64


@pytest.mark.parametrize("sde", STEPS)
@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_prev_sample_scoring_reproduces_log_prob(sde: str, rank: int, reduce: str) -> None:
    step, level = STEPS[sde]
    x, v = xv(SHAPES[rank], seed=3)
    for sigma, sigma_next in [(1.0, 0.92), (0.5, 0.41)]:
        drawn = step(x, v, sigma, sigma_next, level, generator=torch.Generator().manual_seed(2), reduce=reduce)
        again = step(x, v, sigma, sigma_next, level, prev_sample=drawn.sample, reduce=reduce)
        assert torch.equal(again.log_prob, drawn.log_prob)
        assert torch.equal(again.mean, drawn.mean) and torch.equal(again.sample, drawn.sample)
        # a different stored sample scores differently (the check can fail): the mean is the mode
        other = step(x, v, sigma, sigma_next, level, prev_sample=drawn.mean, reduce=reduce)
        assert bool((other.log_prob > drawn.log_prob).all())


@pytest.mark.parametrize("sde", STEPS)
@pytest.mark.parametrize("rank", [3, 4, 5])
def test_given_noise_and_per_sample_rows(sde: str, rank: int) -> None:
    """Per-row sigma, sigma_next and level, one row at level 0: each row is that row's own step."""
    step, level = STEPS[sde]
    shape = (3,) + SHAPES[rank][1:]
    x, v = xv(shape, seed=5)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    sig, sig_next = torch.tensor([1.0, 0.6, 0.2], dtype=F64), torch.tensor([0.95, 0.5, 0.0], dtype=F64)
    levels = torch.tensor([level, 0.0, 1.0], dtype=F64)
    out = step(x, v, sig, sig_next, levels, noise=noise)
    torch.testing.assert_close(out.sample, out.mean + out.std * noise, rtol=0, atol=0)
    for b in range(3):
        rows = slice(b, b + 1)
        row = step(x[rows], v[rows], float(sig[b]), float(sig_next[b]), float(levels[b]), noise=noise[rows])
        for name in ("sample", "mean", "std", "log_prob"):
            torch.testing.assert_close(getattr(out, name)[rows], getattr(row, name), rtol=0, atol=0)
    assert out.log_prob[1].item() == 0.0  # the level-0 row is a deterministic Euler step
    euler = euler_step(x[1:2], v[1:2], 0.6, 0.5)[0]
    torch.testing.assert_close(out.sample[1], euler, rtol=0, atol=EULER_ATOL[sde])


@pytest.mark.parametrize("sde", STEPS)
def test_ranks_agree_with_flattened_tokens(sde: str) -> None:
    """The step is elementwise per sample: a rank-5 latent gives the numbers of its rank-3 and rank-4 views."""
    step, level = STEPS[sde]
    x5, v5 = xv(SHAPES[5], seed=8)
    noise = torch.randn(SHAPES[5], generator=torch.Generator().manual_seed(1), dtype=F64)
    sig, sig_next = torch.tensor([0.9, 0.5], dtype=F64), torch.tensor([0.8, 0.3], dtype=F64)
    levels = torch.tensor([level, 0.5 * level], dtype=F64)
    out5 = step(x5, v5, sig, sig_next, levels, noise=noise)
    for view in ((2, 24, 4), (2, 3, 8, 4)):
        out = step(x5.reshape(view), v5.reshape(view), sig, sig_next, levels, noise=noise.reshape(view))
        torch.testing.assert_close(out.sample.reshape(SHAPES[5]), out5.sample, rtol=0, atol=0)
        torch.testing.assert_close(out.log_prob, out5.log_prob, rtol=0, atol=1e-14)
        assert out.std.shape == (2,) + (1,) * (len(view) - 1)
    assert out5.std.shape == (2, 1, 1, 1, 1)


@pytest.mark.parametrize("sde", STEPS)
def test_float32_inputs_compute_in_float32_and_float64_in_float64(sde: str) -> None:
    step, level = STEPS[sde]
    x, v = xv(SHAPES[4])
    out32 = step(x.float(), v.float(), 0.5, 0.4, level, generator=torch.Generator().manual_seed(0))
    out64 = step(x, v, 0.5, 0.4, level, generator=torch.Generator().manual_seed(0))
    assert out32.sample.dtype == out32.log_prob.dtype == out32.mean.dtype == torch.float32
    assert out64.sample.dtype == out64.log_prob.dtype == out64.mean.dtype == F64
    torch.testing.assert_close(out32.sample.double(), out64.sample, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sde", STEPS)
@pytest.mark.parametrize("which", ["sigma", "sigma_next", "noise_level"])
def test_mismatched_per_sample_raises(sde: str, which: str) -> None:
    step, level = STEPS[sde]
    x, v = xv((3, 2, 4, 4))
    kwargs = {"sigma": 0.5, "sigma_next": 0.4, "noise_level": level}
    kwargs[which] = torch.tensor([kwargs[which]] * 2, dtype=F64)
    with pytest.raises(ValueError, match=r"\(3,\)") as info:
        step(x, v, kwargs["sigma"], kwargs["sigma_next"], kwargs["noise_level"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sde", STEPS)
def test_half_precision_and_mixed_inputs_compute_in_the_compute_dtype(sde: str) -> None:
    """The compute dtype is fp32 for bf16 / fp16 inputs and fp64 when x or v is fp64 (either one).

    bf16 x and v give the fp32 step of their upcast values (not a bf16 one); an fp32 x with an fp64 v
    gives the fp64 step, bit for bit; a bf16 stored x' is scored as fp32 and returned as fp32; fp64 noise
    for fp32 inputs is rounded to fp32 before it is scaled (the fused kernel's order), not the sum after.
    """
    step, level = STEPS[sde]
    x, v = xv(SHAPES[4], seed=12)
    z = torch.randn(SHAPES[4], generator=torch.Generator().manual_seed(13))
    for half in (torch.bfloat16, torch.float16):
        xh, vh = x.to(half), v.to(half)
        got = step(xh, vh, 0.7, 0.6, level, noise=z)
        want = step(xh.float(), vh.float(), 0.7, 0.6, level, noise=z)
        assert got.sample.dtype == got.mean.dtype == got.log_prob.dtype == torch.float32
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        scored = step(xh, vh, 0.7, 0.6, level, prev_sample=got.sample.to(half))
        assert scored.sample.dtype == torch.float32 and torch.equal(scored.sample, got.sample.to(half).float())
    for xm, vm in ((x.float(), v), (x, v.float())):
        got = step(xm, vm, 0.7, 0.6, level, noise=z)
        want = step(xm.double(), vm.double(), 0.7, 0.6, level, noise=z)
        assert got.mean.dtype == got.log_prob.dtype == F64
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    z64 = torch.randn(SHAPES[4], generator=torch.Generator().manual_seed(14), dtype=F64)
    wide = step(x.float(), v.float(), 0.7, 0.6, level, noise=z64)  # the noise is cast to fp32, not the sample
    narrow = step(x.float(), v.float(), 0.7, 0.6, level, noise=z64.float())
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))
