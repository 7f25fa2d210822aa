"""Trust regions against hacking: one KL meaning for every SDE, and GRPO-Guard's RatioNorm (float64)."""

import math

import pytest
import torch

from flowrl.objectives import FlowGRPO, Microbatch, RolloutBatch
from flowrl.objectives.flow_grpo import guard_log_ratio, transition_kl
from flowrl.policy.lora import adapters_disabled, add_lora
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import SDE_STEPS, flow_sde_diffusion, linear_sigmas, sde_noise_levels
from flowrl.samplers.gaussian import gaussian_log_prob

SIGMA, SIGMA_NEXT = 0.6, 0.5
D = torch.float64


def _step(sde: str, x, v, level: float, prev=None):
    s = torch.full((len(x),), SIGMA, dtype=D)
    n = torch.full((len(x),), SIGMA_NEXT, dtype=D)
    return SDE_STEPS[sde](x, v, s, n, level, prev_sample=prev, generator=torch.Generator().manual_seed(0))


def _level_for_std(sde: str, x, v, target: float) -> float:
    """The noise level at which ``sde``'s step std is ``target`` (bisection; the std grows with the level)."""
    lo, hi = 1e-6, 0.999 if sde == "cps" else 20.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(_step(sde, x, v, mid).std.reshape(-1)[0]) < target else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("sde", sorted(SDE_STEPS))
def test_same_mean_gap_and_step_variance_give_the_same_kl_for_every_sde(sde):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 3, 3, generator=gen, dtype=D)
    v = torch.randn(2, 4, 3, 3, generator=gen, dtype=D)
    gap = torch.randn(2, 4, 3, 3, generator=gen, dtype=D) * 0.01
    level = _level_for_std(sde, x, v, target=0.05)
    step = _step(sde, x, v, level)
    # the mean is affine in v: pick the reference velocity whose mean lies exactly `gap` below theta's
    slope = _step(sde, x, v + 1, level).mean - step.mean
    ref = _step(sde, x, v - gap / slope, level, prev=step.sample)
    torch.testing.assert_close(step.mean - ref.mean, gap, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(step.std.reshape(-1), torch.full((2,), 0.05, dtype=D), rtol=1e-12, atol=0)
    kl = transition_kl(step.mean, ref.mean, step.std)
    expected = (gap**2).mean(dim=(1, 2, 3)) / (2 * 0.05**2)  # one number for every SDE
    torch.testing.assert_close(kl, expected, rtol=1e-9, atol=0)
    # it is the KL between the two per-step Gaussian kernels
    kernels = torch.distributions.kl_divergence(
        torch.distributions.Normal(step.mean, step.std), torch.distributions.Normal(ref.mean, ref.std)
    )
    torch.testing.assert_close(kl, kernels.mean(dim=(1, 2, 3)), rtol=1e-9, atol=0)


def test_flow_sde_kl_differs_from_the_reference_sd3_trainer_by_dt():
    """Flow-GRPO's SD3 trainer divides by s^2: its beta is flowrl's kl_beta / |dt|."""
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 4, 3, 3, generator=gen, dtype=D), torch.randn(2, 4, 3, 3, generator=gen, dtype=D)
    step = _step("flow", x, v, 0.7)
    ref = _step("flow", x, v + 0.1, 0.7, prev=step.sample)
    s = flow_sde_diffusion(torch.tensor(SIGMA, dtype=D), torch.tensor(SIGMA_NEXT, dtype=D), 0.7)
    reference = ((step.mean - ref.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * s**2)
    torch.testing.assert_close(reference, transition_kl(step.mean, ref.mean, step.std) * (SIGMA - SIGMA_NEXT))


def test_guard_log_ratio_matches_grpo_guard_equation():
    gen = torch.Generator().manual_seed(1)
    mean_old = torch.randn(3, 4, 2, 2, generator=gen, dtype=D)
    mean = mean_old + 0.03 * torch.randn(3, 4, 2, 2, generator=gen, dtype=D)
    c = torch.tensor([0.2, 0.05, 0.01], dtype=D).view(3, 1, 1, 1)
    z = torch.randn(3, 4, 2, 2, generator=gen, dtype=D)
    x_next = mean_old + c * z
    logp, logp_old = gaussian_log_prob(x_next, mean, c, "mean"), gaussian_log_prob(x_next, mean_old, c, "mean")
    out = guard_log_ratio(logp, logp_old, mean, mean_old, c)
    c_flat = c.reshape(-1)
    equation = c_flat * ((logp - logp_old) + ((mean - mean_old) ** 2).mean(dim=(1, 2, 3)) / (2 * c_flat**2))
    torch.testing.assert_close(out, equation, rtol=1e-12, atol=0)
    # = mean((mu - mu_old) z): no mean-shift bias, and no 1 / c blow-up at low-noise steps
    torch.testing.assert_close(out, ((mean - mean_old) * z).mean(dim=(1, 2, 3)), rtol=1e-9, atol=1e-15)
    plain = logp - logp_old
    assert plain.abs().max() > 10 * out.abs().max()  # the plain log-ratio scales like 1 / c


def test_guard_log_ratio_is_zero_with_a_finite_gradient_on_a_deterministic_step():
    """CPS's step to sigma 0 has std 0 (log-prob 0, KL 0): RatioNorm's ratio is 1 there, not 0 / 0."""
    mean_old = torch.randn(2, 4, 2, 2, dtype=D)
    mean = (mean_old + 0.1).requires_grad_()
    c = torch.tensor([0.0, 0.1], dtype=D).view(2, 1, 1, 1)
    zero = torch.zeros(2, dtype=D)
    out = guard_log_ratio(zero, zero, mean, mean_old, c)
    assert out[0] == 0 and out[1] > 0
    out.sum().backward()
    assert torch.isfinite(mean.grad).all() and (mean.grad[0] == 0).all()


def _batch(model, sde: str, steps: int = 4):
    prompts = [f"a handwritten {d}" for d in (1, 1, 2, 2)]
    cond = model.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, *model.latent_shape(8, 8), generator=gen)
    traj = chunked_rollout(
        model, cond, x, linear_sigmas(steps), sde_noise_levels(steps, 0.7), chunk_size=4, generator=gen, sde=sde
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    keep = torch.ones(4, dtype=torch.bool)
    ids = torch.tensor([0, 0, 1, 1])
    return RolloutBatch(
        prompts, ids, cond, traj.latents[:, -1], traj, traj.sigmas, traj.latents[:, -1], adv, adv, keep, 4
    )


def _perturbed_lora(model):
    add_lora(model.transformer, rank=4, alpha=4, targets=model.lora_target_modules)
    torch.manual_seed(0)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)


@pytest.mark.parametrize("sde", ["flow", "dance"])
def test_objective_kl_is_the_kernel_kl(tiny_sd3, sde):
    _perturbed_lora(tiny_sd3)
    batch = _batch(tiny_sd3, sde)
    mb = Microbatch(torch.arange(4), 1)
    _, stats = FlowGRPO(kl_beta=1.0).loss(tiny_sd3, batch, mb)
    traj = batch.trajectory
    x, x_next = traj.latents[:, 1], traj.latents[:, 2]
    sigma, sigma_next = traj.sigmas[1].expand(4), traj.sigmas[2].expand(4)
    level = float(traj.noise_levels[1])
    with torch.no_grad():
        step = SDE_STEPS[sde](x, tiny_sd3.velocity(x, sigma, batch.cond), sigma, sigma_next, level, prev_sample=x_next)
        with adapters_disabled(tiny_sd3.transformer):
            ref = SDE_STEPS[sde](x, tiny_sd3.velocity(x, sigma, batch.cond), sigma, sigma_next, level)
    kernels = torch.distributions.kl_divergence(
        torch.distributions.Normal(step.mean.double(), step.std.double()),
        torch.distributions.Normal(ref.mean.double(), ref.std.double()),
    )
    assert stats["kl"] == pytest.approx(float(kernels.mean()), rel=1e-4)


def test_ratio_norm_rescales_the_policy_gradient_by_std_over_dt(tiny_sd3):
    """On-policy (ratio 1, nothing clipped) RatioNorm's gradient is the plain one times c / (sigma - sigma_next)."""
    _perturbed_lora(tiny_sd3)
    batch = _batch(tiny_sd3, "flow")
    mb = Microbatch(torch.arange(4), 1)
    params = [p for n, p in tiny_sd3.transformer.named_parameters() if p.requires_grad]
    grads = []
    for norm in (False, True):
        for p in params:
            p.grad = None
        loss, stats = FlowGRPO(clip_range=0.2, ratio_norm=norm).loss(tiny_sd3, batch, mb)
        loss.backward()
        assert stats["ratio"] == 1.0
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]).double())
    traj = batch.trajectory
    sigma, sigma_next = float(traj.sigmas[1]), float(traj.sigmas[2])
    s = flow_sde_diffusion(torch.tensor(sigma), torch.tensor(sigma_next), float(traj.noise_levels[1]))
    factor = float(s) * math.sqrt(sigma - sigma_next) / (sigma - sigma_next)
    torch.testing.assert_close(grads[1], grads[0] * factor, rtol=2e-4, atol=1e-9)


def test_ratio_norm_needs_one_update_per_iteration():
    with pytest.raises(ValueError, match="objective.ratio_norm needs the rollout policy's means"):
        FlowGRPO(ratio_norm=True, updates_per_iteration=2)
