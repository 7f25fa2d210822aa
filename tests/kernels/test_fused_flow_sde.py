"""The fused Flow-SDE step + log-prob kernel against the project's flow_sde_step (Flow-GRPO eq. 8-9).

Within fp32 tolerance: the kernel sums each sample's log-prob in another order than torch does.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from flowrl.kernels import fused_flow_sde_step
from flowrl.samplers import flow_sde_step

# odd sizes; (2, 4, 33, 17) has 2244 elements per sample, so three 1024-element chunks per row
SHAPES = [(1, 7), (3, 5, 9), (2, 4, 33, 17), (2, 3, 2, 5, 3)]
STEPS = {
    "per_sample": (torch.tensor([0.8, 0.35, 0.6]), torch.tensor([0.7, 0.2, 0.45]), torch.tensor([0.7, 1.0, 0.4])),
    "pure_noise": (1.0, 0.9, 0.7),
    "ode": (0.5, 0.4, 0.0),
    "to_zero": (0.1, 0.0, 0.5),
}


def inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, v, z = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(3))
    return x, v, z


def per_sample(value, batch):
    return value[:batch] if isinstance(value, torch.Tensor) else value


def assert_steps_close(got, ref, log_prob_rtol=1e-5):
    for name in ("sample", "mean", "std"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(got.log_prob, ref.log_prob, rtol=log_prob_rtol, atol=1e-5)
    assert got.sample.dtype == got.mean.dtype == got.log_prob.dtype == torch.float32
    assert got.std.shape == ref.std.shape and got.log_prob.shape == ref.log_prob.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_sampling_matches_flow_sde_step(device, shape, step, reduce):
    x, v, z = inputs(shape, torch.float32, device)
    sigma, sigma_next, level = (per_sample(t, shape[0]) for t in STEPS[step])
    ref = flow_sde_step(x, v, sigma, sigma_next, level, noise=z, reduce=reduce)
    got = fused_flow_sde_step(x, v, sigma, sigma_next, level, noise=z, reduce=reduce, backend="triton")
    assert_steps_close(got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("step", ["per_sample", "pure_noise"])
def test_scoring_a_stored_step_matches(device, shape, step):
    x, v, z = inputs(shape, torch.float32, device)
    sigma, sigma_next, level = (per_sample(t, shape[0]) for t in STEPS[step])
    stored = flow_sde_step(x, v, sigma, sigma_next, level, noise=z).sample + 0.01  # off the mean a little
    ref = flow_sde_step(x, v, sigma, sigma_next, level, prev_sample=stored, reduce="sum")
    got = fused_flow_sde_step(x, v, sigma, sigma_next, level, prev_sample=stored, reduce="sum", backend="triton")
    assert_steps_close(got, ref)
    assert torch.equal(got.sample, stored)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_fp32(device, dtype):
    x, v, z = inputs((2, 4, 33, 17), dtype, device)
    ref = flow_sde_step(x, v, 0.6, 0.45, 0.8, noise=z)
    got = fused_flow_sde_step(x, v, 0.6, 0.45, 0.8, noise=z, backend="triton")
    assert_steps_close(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_generator_draws_the_reference_noise(device):
    x, v, _ = inputs((3, 5, 9), torch.float32, device)
    ref = flow_sde_step(x, v, 0.7, 0.6, 0.7, generator=torch.Generator().manual_seed(3))
    got = fused_flow_sde_step(x, v, 0.7, 0.6, 0.7, generator=torch.Generator().manual_seed(3), backend="triton")
    assert_steps_close(got, ref)


def test_torch_backend_is_the_reference_itself():
    x, v, z = inputs((2, 3, 4), torch.float64, "cpu")
    ref = flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z)
    for backend in ("torch", "auto"):  # fp64 always runs the reference under "auto"
        got = fused_flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)) and got.mean.dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
def test_bad_calls_are_errors(device):
    x, v, z = inputs((2, 8), torch.float32, device)
    with pytest.raises(ValueError, match="fp64"):
        fused_flow_sde_step(x.double(), v.double(), 0.6, 0.5, 0.7, noise=z, backend="triton")
    with pytest.raises(ValueError, match="noise must have x's shape"):
        fused_flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z[:, :4], backend="triton")
    with pytest.raises(ValueError, match="reduce must be"):
        fused_flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z, reduce="max", backend="triton")
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        fused_flow_sde_step(x, v, torch.tensor([0.6, 0.5, 0.4]), 0.3, 0.7, noise=z, backend="triton")
