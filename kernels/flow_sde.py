"""Fused Flow-SDE step + log-prob: one pass for the mean, the next sample and the per-sample log-prob.

The reference is the project's own :data:`flowrl.samplers.flow_sde_step` (Flow-GRPO's SDE step,
``GaussianSDE(flow_sde_moments)``); the torch backend *is* that function. The Triton kernel
computes, per element and in fp32,

    mean = x + [v + s^2 / (2 sigma) (x + (1 - sigma) v)] (sigma_next - sigma)
    x'   = mean + std * z                      (or the stored x' when scoring)
    lp   = -(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2   (0 where std = 0)

with ``dt = sigma_next - sigma``, ``s = a sqrt(sigma / (1 - sigma~))`` (``sigma~`` = sigma_next where
sigma >= 1) and ``std = s sqrt(sigma - sigma_next)`` computed per sample inside the kernel, the equations
of :func:`flowrl.samplers.flow_sde.flow_sde_diffusion` and :func:`~flowrl.samplers.flow_sde.flow_sde_moments`
(IEEE-rounded divisions and square roots, like torch's), and sums ``lp`` per sample ("mean" scales
by 1 / the element count in the kernel).

Host path: scalar sigma / sigma_next / level go to the kernel as Python floats, per-sample ones as
(B,) fp32 tensors (a 0-d tensor on the device is read in place, no ``.item()`` sync); inputs whose
samples are contiguous runs are read in place. A call with given noise is therefore one kernel launch
plus the output allocations, and one more launch (the sum of the (B, chunks) partials) for samples
longer than :data:`~flowrl.kernels.flow_sde_triton.ROW_BLOCKS` blocks of 1024 elements.

Cost per latent element, fp32 inputs: the reference's ~23 elementwise passes move about 200 B;
the kernel reads x, v, z (12 B) and writes x' and the mean (8 B): **20 B** (scoring: 16 B), for
**14 FLOPs** (scoring: 12). Intensity 0.7 FLOP/B against an H100 ridge point of 20 FLOP/B:
memory-bound. For SD3 at 1024 px, B = 16 latents of 16 x 128 x 128 (4.19 M elements, 83.9 MB),
the H100 SXM roofline is 83.9 MB / 3.35 TB/s = **25 us** (58.7 MFLOP would take 0.9 us).

References:
    Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025, eq. (8)-(9).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

# absolute, not ``..samplers``: with the repo root on sys.path (``python -m`` from a checkout),
# transformers' probe for Hugging Face's ``kernels`` imports this folder as a top-level ``kernels``
from flowrl.samplers import SDEStep, batch_view, compute_dtype, flow_sde_step, standard_normal
from flowrl.samplers.flow_sde import flow_sde_diffusion
from flowrl.samplers.gaussian import Reduction
from flowrl.samplers.sde_steps import register_accelerated_step

from .dispatch import Backend, resolve_backend

FLOPS_PER_ELEMENT = {"sample": 14, "score": 12}


def fused_flow_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    level: Tensor | float,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduction = "mean",
    backend: Backend = "auto",
) -> SDEStep:
    """One Flow-SDE step (or the log-prob of a stored one), fused on CUDA; same contract as ``flow_sde_step``.

    Args:
        x: (B, ...) latent at sigma.
        v: (B, ...) velocity at (x, sigma).
        sigma: scalar or (B,), in (0, 1]. A Python number (or a 0-d CPU tensor for a CUDA latent) goes to
            the kernel as a float; a (B,) or 0-d tensor on x's device is read by the kernel (cast to fp32
            first if it is not).
        sigma_next: scalar or (B,), in [0, sigma).
        level: the ``a`` noise knob, scalar or (B,); 0 gives the Euler ODE step (std 0, log-prob 0).
        noise: optional (B, ...) standard normal; drawn with ``generator`` when None (as the reference).
        generator: RNG for the noise.
        prev_sample: a stored x' to score instead of sampling.
        reduce: "mean" or "sum" of the element log-probs.
        backend: "auto" (Triton on CUDA / under TRITON_INTERPRET=1), "torch" (the reference) or
            "triton". fp64 inputs always run the reference under "auto".

    Returns:
        SDEStep(sample (B, ...), mean (B, ...), std (B, 1, ..., 1), log_prob (B,)), fp32.

    Raises:
        ValueError: a bad ``reduce``, mismatched shapes, or "triton" asked for fp64 inputs.
        TypeError: sigma, sigma_next or level neither a real number nor a tensor (Triton path).
    """
    which = resolve_backend(backend, x, v)
    wide = compute_dtype(x, v) == torch.float64
    if which == "torch" or (wide and backend == "auto") or (x.numel() == 0 and not wide):
        return flow_sde_step(
            x, v, sigma, sigma_next, level, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce
        )
    _check(x, v, noise, prev_sample, reduce, wide)
    score = prev_sample is not None
    needs_grad = torch.is_grad_enabled() and (v.requires_grad or x.requires_grad)
    if needs_grad and (x.requires_grad or not score):  # the closed-form backward covers scoring, in v only
        return flow_sde_step(
            x, v, sigma, sigma_next, level, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce
        )
    from .flow_sde_triton import flow_sde_triton

    coefficients = [_coefficient(name, value, x) for name, value in zip(_NAMES, (sigma, sigma_next, level))]
    if needs_grad:
        mean, std, log_prob = _FusedScore.apply(x, v, prev_sample, coefficients, reduce == "mean")
        return SDEStep(prev_sample.to(torch.float32), mean, batch_view(std, x.ndim), log_prob)
    eps = prev_sample if score else (noise if noise is not None else standard_normal(x, generator))
    write_sample = not score or prev_sample.dtype != torch.float32
    sample, mean, std, log_prob = flow_sde_triton(
        x, v, eps, *coefficients, score=score, write_sample=write_sample, mean_reduce=reduce == "mean"
    )
    return SDEStep(sample if write_sample else prev_sample, mean, batch_view(std, x.ndim), log_prob)


_NAMES = ("sigma", "sigma_next", "level")


class _FusedScore(torch.autograd.Function):
    """The fused kernel scoring a stored step, differentiable in ``v`` through the closed-form backward.

    With ``k = (1 + s^2 / (2 sigma) (1 - sigma)) (sigma_next - sigma)`` (per sample, ``d mean / d v``)
    and ``R`` = 1 / the element count for "mean" (1 for "sum"):

        d mean / d v = k,    d lp / d mean = R (x' - mean) / std^2   (0 where std = 0),

    so ``grad_v = k (grad_mean + grad_lp R (x' - mean) / std^2)``: four elementwise passes instead of
    the reference's autograd graph. Gradients flow to ``v`` only (the callers' x and x' are data).
    """

    @staticmethod
    def forward(ctx, x, v, prev, coefficients, mean_reduce):  # noqa: D102 - see the class docstring
        from .flow_sde_triton import flow_sde_triton

        write = prev.dtype != torch.float32
        target, mean, std, log_prob = flow_sde_triton(
            x, v, prev, *coefficients, score=True, write_sample=write, mean_reduce=mean_reduce
        )
        ctx.save_for_backward(target if write else prev, mean, std)
        ctx.coefficients, ctx.mean_reduce, ctx.v_dtype = coefficients, mean_reduce, v.dtype
        ctx.mark_non_differentiable(std)
        return mean, std, log_prob

    @staticmethod
    def backward(ctx, grad_mean, grad_std, grad_lp):  # noqa: D102 - see the class docstring
        target, mean, std = ctx.saved_tensors
        rows, ndim = mean.shape[0], mean.ndim
        sigma, sigma_next, level = (
            torch.as_tensor(c, dtype=torch.float32, device=mean.device).expand(rows) for c in ctx.coefficients
        )
        s = flow_sde_diffusion(sigma, sigma_next, level)
        slope = (1 + s * s / (2 * sigma) * (1 - sigma)) * (sigma_next - sigma)
        per_element = 1.0 / (mean.numel() // rows) if ctx.mean_reduce else 1.0
        inv_var = torch.where(std > 0, 1 / torch.where(std > 0, std, 1.0) ** 2, 0.0) * per_element
        total = grad_mean + batch_view(grad_lp * inv_var, ndim) * (target - mean)
        return None, (total * batch_view(slope, ndim)).to(ctx.v_dtype), None, None, None


def _coefficient(name: str, value: Tensor | float, x: Tensor) -> Tensor | float:
    """``value`` as the kernel takes it: a Python float, or an fp32 tensor of shape () or (B,) on x's device.

    Args:
        name: the argument's name, for errors.
        value: a Python number, a 0-d tensor or a (B,) tensor.
        x: (B, ...) latent (its batch size and device).

    Returns:
        A float for numbers and for 0-d CPU tensors when x is not on the CPU (no device sync), else the
        tensor in fp32 on x's device (no copy when it already is; the kernel reads a 0-d one with stride 0).

    Raises:
        ValueError: a tensor that is neither 0-d nor (B,).
        TypeError: anything else than a real number or a tensor.
    """
    if isinstance(value, Tensor):
        if value.ndim == 0 and value.device.type == "cpu" and x.device.type != "cpu":
            return float(value)  # a CPU scalar for a GPU latent: no copy, no sync
        if value.ndim > 1 or (value.ndim == 1 and value.shape[0] != x.shape[0]):
            raise ValueError(
                f"per-sample {name} must have shape ({x.shape[0]},) to match the latent batch; got {tuple(value.shape)}"
            )
        return value.to(device=x.device, dtype=torch.float32)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{name} must be a float or a tensor; got {type(value).__name__}")


def _check(x: Tensor, v: Tensor, noise: Tensor | None, prev: Tensor | None, reduce: str, wide: bool) -> None:
    if wide:
        raise ValueError("the fused Flow-SDE kernel computes in fp32; use backend='auto' or 'torch' for fp64 inputs")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum'; got {reduce!r}")
    for name, t in (("v", v), ("noise", noise), ("prev_sample", prev)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)}; got {tuple(t.shape)}")


def flow_sde_bytes(numel: int, itemsize: int, *, score: bool = False) -> int:
    """Bytes the fused kernel moves for ``numel`` latent elements of x / v / noise with ``itemsize`` bytes.

    Reads x, v and the noise (or the stored x', read as fp32 when ``score``), writes the fp32 mean,
    and the fp32 sample unless scoring; the (B, chunks) partial sums are negligible.
    """
    return numel * (3 * itemsize + 4) if score else numel * (3 * itemsize + 8)


register_accelerated_step("flow", "cuda", fused_flow_sde_step)  # the registry's "flow" step on CUDA latents
