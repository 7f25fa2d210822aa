"""The fused Flow-SDE step + log-prob kernel against the project's flow_sde_step (Flow-GRPO eq. 8-9).

Within fp32 tolerance: the kernel sums each sample's log-prob in another order than torch does.
The per-sample coefficients (dt, s, std) are computed inside the kernel from sigma, sigma_next and
the level, given as Python floats, 0-d tensors or (B,) tensors.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES
from torch.utils._python_dispatch import TorchDispatchMode

from flowrl.kernels import fused_flow_sde_step
from flowrl.samplers import flow_sde_step

# odd sizes; (2, 4, 33, 17) has 2244 elements per sample, so three 1024-element chunks per row (one
# program per row); (2, 6, 29, 31) has 5394, six chunks: more than ROW_BLOCKS, so (B, chunks) partials
SHAPES = [(1, 7), (3, 5, 9), (2, 4, 33, 17), (2, 3, 2, 5, 3), (2, 6, 29, 31)]
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


# how a step's sigma / sigma_next / level reach the kernel: Python floats, 0-d tensors, (B,) tensors, mixed
FORMS = {
    "floats": lambda b: (0.8, 0.65, 0.7),
    "0-d tensors": lambda b: (torch.tensor(0.8), torch.tensor(0.65), torch.tensor(0.7)),
    "per-sample": lambda b: (torch.full((b,), 0.8), torch.full((b,), 0.65), torch.full((b,), 0.7)),
    "mixed": lambda b: (torch.full((b,), 0.8), 0.65, torch.tensor(0.7, dtype=torch.float64)),
}


def on(device, value):
    return value.to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 5, 9), (2, 6, 29, 31)], ids=str)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("mode", ["sample", "score"])
def test_scalar_and_per_sample_coefficients_match_and_agree(device, shape, form, mode):
    x, v, z = inputs(shape, torch.float32, device)
    stored = z * 0.3 + x if mode == "score" else None
    kw = {"prev_sample": stored} if mode == "score" else {"noise": z}
    step = [on(device, t) for t in FORMS[form](shape[0])]
    ref = flow_sde_step(x, v, *step, reduce="sum", **kw)
    got = fused_flow_sde_step(x, v, *step, reduce="sum", backend="triton", **kw)
    assert_steps_close(got, ref)
    # every form carries the same fp32 values, so the kernel computes the same bits
    floats = fused_flow_sde_step(x, v, 0.8, 0.65, 0.7, reduce="sum", backend="triton", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, floats))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sample", "score"])
def test_level_zero_per_sample_is_the_euler_step_with_zero_log_prob(device, mode):
    x, v, z = inputs((3, 4, 33, 17), torch.float32, device)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 1.0], device=device), torch.tensor([0.8, 0.3, 0.9], device=device)
    level = torch.tensor([0.0, 0.6, 0.0], device=device)
    kw = {"prev_sample": z * 0.5 + x} if mode == "score" else {"noise": z}
    ref = flow_sde_step(x, v, sigma, sigma_next, level, **kw)
    got = fused_flow_sde_step(x, v, sigma, sigma_next, level, backend="triton", **kw)
    assert_steps_close(got, ref)
    assert torch.equal(got.std[[0, 2]].flatten(), torch.zeros(2, device=device))
    assert torch.equal(got.log_prob[[0, 2]], torch.zeros(2, device=device))
    if mode == "sample":
        assert torch.equal(got.sample[0], got.mean[0])
        euler = x[0] + v[0] * (sigma_next[0] - sigma[0])  # the ODE step's mean is Euler's
        torch.testing.assert_close(got.mean[0], euler, rtol=1e-6, atol=1e-6)


def strided(kind, t):
    """The same values as ``t`` in another layout."""
    if kind == "batch_slice":  # every second sample of a twice-as-large batch: read in place
        return torch.stack([t, torch.full_like(t, float("nan"))], dim=1).flatten(0, 1)[::2]
    if kind == "channels_last":  # samples not one contiguous run: copied once
        return t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)  # "transposed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["batch_slice", "channels_last", "transposed"])
@pytest.mark.parametrize("shape", [(3, 4, 9, 7), (2, 6, 29, 31)], ids=str)
def test_non_contiguous_inputs(device, kind, shape):
    x, v, z = inputs(shape, torch.float32, device)
    sx, sv, sz = (strided(kind, t) for t in (x, v, z))
    assert not (sx.is_contiguous() or sv.is_contiguous() or sz.is_contiguous())
    sigma = strided("batch_slice", torch.linspace(0.5, 1.0, shape[0], device=device)[:, None])[:, 0]
    assert not sigma.is_contiguous()
    ref = flow_sde_step(x, v, sigma, sigma - 0.1, 0.7, noise=z)
    got = fused_flow_sde_step(sx, sv, sigma, sigma - 0.1, 0.7, noise=sz, backend="triton")
    assert_steps_close(got, ref)
    stored = strided(kind, ref.sample)
    scored = fused_flow_sde_step(sx, sv, sigma, sigma - 0.1, 0.7, prev_sample=stored, backend="triton")
    assert_steps_close(scored, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_noise_with_batch_stride_zero(device):
    x, v, z = inputs((3, 5, 9), torch.float32, device)
    shared = z[:1].expand_as(x)  # one noise for the batch: stride 0, read in place
    ref = flow_sde_step(x, v, 0.6, 0.45, 0.8, noise=shared.contiguous())
    assert_steps_close(fused_flow_sde_step(x, v, 0.6, 0.45, 0.8, noise=shared, backend="triton"), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sample", "score"])
def test_bf16_inputs_with_per_sample_coefficients(device, mode):
    x, v, z = inputs((3, 4, 33, 17), torch.bfloat16, device)
    sigma = torch.tensor([1.0, 0.6, 0.3], dtype=torch.bfloat16, device=device)
    sigma_next = torch.tensor([0.875, 0.5, 0.0], dtype=torch.bfloat16, device=device)
    level = torch.tensor([0.7, 0.0, 0.9], device=device)
    kw = {"prev_sample": (z.float() * 0.2 + x.float()).to(torch.bfloat16)} if mode == "score" else {"noise": z}
    ref = flow_sde_step(x, v, sigma, sigma_next, level, **kw)
    got = fused_flow_sde_step(x, v, sigma, sigma_next, level, backend="triton", **kw)
    assert_steps_close(got, ref)
    if mode == "score":  # a bf16 stored x' comes back as fp32, written by the kernel
        assert torch.equal(got.sample, kw["prev_sample"].float())


class AtenOps(TorchDispatchMode):
    """Records the aten ops (and so the device work) a call runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class FakeKernel:
    """Stands in for the Triton kernel: records each launch's grid and constexprs."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((grid, constexprs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["floats", "per-sample"])
@pytest.mark.parametrize("layout", ["contiguous", "batch_slice"])
@pytest.mark.parametrize("shape", [(64, 4, 8, 8), (2, 6, 29, 31)], ids=str)
def test_host_path_is_one_launch_plus_allocations(device, form, layout, shape, monkeypatch):
    from flowrl.kernels import flow_sde_triton

    x, v, z = (strided(layout, t) if layout != "contiguous" else t for t in inputs(shape, torch.float32, device))
    step = [on(device, t) for t in FORMS[form](shape[0])]
    kernel = FakeKernel()
    monkeypatch.setattr(flow_sde_triton, "_flow_sde_kernel", kernel)
    with AtenOps() as seen:
        fused_flow_sde_step(x, v, *step, noise=z, backend="triton")
    long_row = x[0].numel() > flow_sde_triton.ROW_BLOCKS * flow_sde_triton.BLOCK
    assert len(kernel.launches) == 1
    assert kernel.launches[0][1]["SIGMA_VEC"] == (form == "per-sample")
    # the output allocations and views; the only device work besides the kernel is the partial sum of a long row
    assert set(seen.ops) <= {"empty", "empty_like", "view", "sum"} and seen.ops.count("sum") == long_row


@pytest.mark.parametrize("device", DEVICES)
def test_bad_coefficients_are_errors(device):
    x, v, z = inputs((2, 8), torch.float32, device)
    with pytest.raises(ValueError, match=r"sigma_next must have shape \(2,\)"):
        fused_flow_sde_step(x, v, 0.6, torch.full((2, 1), 0.5), 0.7, noise=z, backend="triton")
    with pytest.raises(TypeError, match="level must be a float or a tensor"):
        fused_flow_sde_step(x, v, 0.6, 0.5, "0.7", noise=z, backend="triton")


# --------------------------------------------------------------------------- gradients and the registry


def _grad_v(fn, x, v, sigma, sigma_next, level, prev, reduce, w_lp, w_mean):
    """grad_v of (log-prob . w_lp + 1e-3 mean . w_mean) through ``fn``."""
    v = v.detach().requires_grad_(True)
    out = fn(x, v, sigma, sigma_next, level, prev_sample=prev, reduce=reduce)
    assert out.mean.requires_grad and out.log_prob.requires_grad
    ((out.log_prob * w_lp).sum() + (out.mean * w_mean).sum() * 1e-3).backward()
    return v.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 5, 9), (2, 6, 29, 31)], ids=str)
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scoring_is_differentiable_in_v_as_the_reference(device, shape, step, reduce, v_dtype):
    """grad_v of (log-prob and mean terms) through the closed-form backward equals autograd of the reference.

    fp32: both the kernel and torch's fp32 autograd are held to the float64 gradient within
    32 eps32 max|grad|. The gradient is elementwise (no sum enters it), but ``x' - mean`` cancels
    where std is small, so its fp32 error is a few eps of the largest gradient: at most 6.7 here for
    either (interpreter, 2026-11-27); on an H100 the kernel differed from torch's fp32 by up to 10.6
    (6.4e-6 where max|grad| is 5.05). A wrong formula is off by O(max|grad|). bf16 v: within 1 bf16
    ulp of torch.
    """
    x, v0, z = inputs(shape, torch.float32, device, seed=4)
    sigma, sigma_next, level = (per_sample(t, shape[0]) for t in STEPS[step])
    prev = flow_sde_step(x, v0, sigma, sigma_next, level, noise=z).sample
    w_lp = torch.randn(shape[0], generator=torch.Generator().manual_seed(1)).to(device)
    w_mean = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(device)
    fused = lambda *a, **k: fused_flow_sde_step(*a, **k, backend="triton")  # noqa: E731
    args = (sigma, sigma_next, level, prev, reduce, w_lp, w_mean)
    v = (v0 + 0.01).to(v_dtype)
    got, ref = (_grad_v(fn, x, v, *args) for fn in (fused, flow_sde_step))
    assert got.dtype == v_dtype
    if v_dtype == torch.bfloat16:
        torch.testing.assert_close(got, ref, rtol=8e-3, atol=1e-5)  # bf16: 1 ulp
        return
    f64 = [t.double() if isinstance(t, torch.Tensor) else t for t in (x, v, *args)]
    exact = _grad_v(flow_sde_step, *f64)
    bound = 32 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    for name, grad in (("fused", got), ("torch fp32", ref)):
        err = (grad.double() - exact).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_a_sampled_log_prob_is_recomputed_bit_for_bit_when_scored(device):
    """Rollout (sampling) and training (scoring the stored x') run the same kernel: the ratio starts at exactly 1."""
    x, v, z = inputs((4, 3, 11, 7), torch.float32, device, seed=6)
    drawn = fused_flow_sde_step(x, v, 0.8, 0.7, 0.7, noise=z, backend="triton")
    scored = fused_flow_sde_step(
        x, v.clone().requires_grad_(True), 0.8, 0.7, 0.7, prev_sample=drawn.sample, backend="triton"
    )
    assert torch.equal(scored.log_prob.detach(), drawn.log_prob) and torch.equal(scored.mean.detach(), drawn.mean)


def test_sampling_or_an_x_gradient_takes_the_reference():
    x, v, z = inputs((2, 3, 4), torch.float32, "cpu", seed=8)
    v = v.requires_grad_(True)
    step = fused_flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z, backend="triton")  # sampling with a gradient
    ref = flow_sde_step(x, v, 0.6, 0.5, 0.7, noise=z)
    assert step.log_prob.grad_fn is not None and torch.equal(step.log_prob, ref.log_prob)


def test_the_registry_flow_step_is_the_reference_off_cuda(monkeypatch):
    """Off CUDA the "flow" step is flow_sde_step bit for bit, even with the Triton interpreter on."""
    from flowrl.samplers import get_sde_step

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, v, z = inputs((3, 4, 5), torch.float32, "cpu", seed=9)
    got = get_sde_step("flow")(x, v, 0.7, 0.6, 0.7, noise=z)
    ref = flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_a_step_registered_for_a_device_is_the_registry_step_there(monkeypatch):
    from flowrl.samplers import get_sde_step
    from flowrl.samplers.sde_steps import ACCELERATED_STEPS, register_accelerated_step

    registered = ACCELERATED_STEPS[("flow", "cuda")]  # by importing flowrl.kernels (possibly twice, under two names)
    assert registered.__name__ == "fused_flow_sde_step" and registered.__module__.endswith("kernels.flow_sde")
    x, v, z = inputs((3, 4, 5), torch.float32, "cpu", seed=10)

    def interpreted(*args, **kwargs):
        return fused_flow_sde_step(*args, **kwargs, backend="triton")

    monkeypatch.setitem(ACCELERATED_STEPS, ("flow", "cpu"), interpreted)
    got = get_sde_step("flow")(x, v, 0.7, 0.6, 0.7, noise=z)
    want = fused_flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="unknown SDE 'nope'"):
        register_accelerated_step("nope", "cuda", interpreted)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_registry_flow_step_runs_the_kernel_on_cuda():
    from flowrl.samplers import get_sde_step

    x, v, z = inputs((3, 4, 5), torch.float32, "cuda", seed=9)
    got = get_sde_step("flow")(x, v, 0.7, 0.6, 0.7, noise=z)
    assert got.mean.grad_fn is None
    assert_steps_close(got, flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z))
    v.requires_grad_(True)
    scored = get_sde_step("flow")(x, v, 0.7, 0.6, 0.7, prev_sample=got.sample)
    assert type(scored.log_prob.grad_fn).__name__ == "_FusedScoreBackward"
    assert torch.equal(scored.log_prob.detach(), got.log_prob)


def test_bytes_moved_per_element_sampling_and_scoring():
    """The roofline's byte model: sampling reads x, v, z and writes x' and the mean (20 B per fp32 element);
    scoring reads x, v, x' and writes the mean only (16 B); bf16 inputs save 2 B on each read."""
    from flowrl.kernels.flow_sde import flow_sde_bytes

    assert flow_sde_bytes(1000, 4) == 20_000 and flow_sde_bytes(1000, 4, score=True) == 16_000
    assert flow_sde_bytes(1000, 2) == 14_000 and flow_sde_bytes(1000, 2, score=True) == 10_000


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4)], ids=str)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_empty_latents_give_the_reference_step(device, shape, reduce):
    """An empty batch or empty samples skip the kernel (whose per-sample scale 1 / N would divide by 0): the
    result is the reference's, shapes, dtypes and (NaN for a mean over no element) log-probs included."""
    x, v, z = inputs(shape, torch.float32, device)
    got = fused_flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z, reduce=reduce, backend="triton")
    ref = flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z, reduce=reduce)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, equal_nan=True)
