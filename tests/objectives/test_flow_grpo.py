"""Flow-GRPO objective: PPO-clip math (float64) and the exact ratio of 1 before the first update."""

import pytest
import torch

from flowrl.objectives import FlowGRPO, Microbatch, RolloutBatch, clipped_policy_loss, gaussian_mean_kl
from flowrl.policy.lora import adapters_disabled, add_lora
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels


def test_clipped_loss_by_hand():
    logp = torch.tensor([0.0, 0.2, -0.2, 0.2], dtype=torch.float64)
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    loss, ratio = clipped_policy_loss(logp, old, adv, clip_range=0.1)
    r = torch.exp(logp)
    # A > 0: min(r, clip(r)) is taken -> -A * min(...); A < 0: -A * max(...)
    expected = torch.stack([-r[0], -torch.tensor(1.1, dtype=torch.float64), -r[2], r[3]])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ratio, r)


def test_gradient_sign_follows_advantage():
    logp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_policy_loss(
        logp, torch.zeros(2, dtype=torch.float64), torch.tensor([2.0, -3.0], dtype=torch.float64), 0.2
    )
    loss.sum().backward()
    # descending the loss raises log-prob where A > 0 and lowers it where A < 0
    assert logp.grad[0] < 0 and logp.grad[1] > 0
    torch.testing.assert_close(logp.grad, torch.tensor([-2.0, 3.0], dtype=torch.float64))


def test_kl_of_shared_variance_gaussians():
    mean = torch.ones(2, 3, dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    s = torch.tensor([1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(gaussian_mean_kl(mean, ref, s), torch.tensor([0.5, 0.125], dtype=torch.float64))
    # equals the closed-form KL of N(m1, s^2) || N(m2, s^2) averaged over elements
    p = torch.distributions.Normal(mean, s.view(-1, 1))
    q = torch.distributions.Normal(ref, s.view(-1, 1))
    torch.testing.assert_close(gaussian_mean_kl(mean, ref, s), torch.distributions.kl_divergence(p, q).mean(1))


def test_transition_kl_is_zero_on_a_deterministic_step():
    """A step with std 0 (e.g. CPS to sigma 0) has no kernel: its KL is 0, not the KL at a stand-in std of 1."""
    from flowrl.objectives.flow_grpo import transition_kl

    mean = torch.ones(2, 3, dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    std = torch.tensor([0.0, 2.0], dtype=torch.float64).view(2, 1, 1)
    torch.testing.assert_close(transition_kl(mean, ref, std), torch.tensor([0.0, 0.125], dtype=torch.float64))


def _rollout_batch(model, chunk=3, groups=2, k=3, steps=4, sde="flow"):
    prompts = [f"a handwritten {d}" for d in range(groups) for _ in range(k)]
    cond = model.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *model.latent_shape(8, 8), generator=gen)
    traj = chunked_rollout(
        model, cond, x, linear_sigmas(steps), sde_noise_levels(steps, 0.7), chunk_size=chunk, generator=gen, sde=sde
    )
    adv = torch.randn(len(prompts), generator=gen)
    keep = torch.ones(len(prompts), dtype=torch.bool)
    ids = torch.arange(groups).repeat_interleave(k)
    return RolloutBatch(
        prompts, ids, cond, traj.latents[:, -1], traj, traj.sigmas, traj.latents[:, -1], adv, adv, keep, chunk
    )


@pytest.mark.parametrize("sde", ["flow", "dance", "cps", "sage"])
def test_ratio_is_exactly_one_before_the_first_update(tiny_sd3, sde):
    add_lora(tiny_sd3.transformer, rank=4, alpha=4, targets=tiny_sd3.lora_target_modules)
    # make the LoRA non-trivial so the policy differs from the base model
    for name, p in tiny_sd3.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    batch = _rollout_batch(tiny_sd3, sde=sde)
    assert batch.trajectory.sde == sde
    objective = FlowGRPO(clip_range=1e-4, kl_beta=0.1)
    plan = objective.plan(batch, torch.Generator().manual_seed(1))
    seen = set()
    for group in plan:
        for mb in group:
            loss, stats = objective.loss(tiny_sd3, batch, mb)
            assert stats["ratio"] == 1.0, stats
            assert stats["clipfrac"] == 0.0 and stats["approx_kl"] == 0.0
            assert stats["kl"] > 0.0  # LoRA is on, the reference (adapter off) differs
            seen.add((tuple(mb.index.tolist()), mb.step))
    # every chunk x every stochastic step (all but the last of 4) exactly once
    assert len(seen) == 2 * 3


def test_kl_is_zero_when_lora_is_zero(tiny_sd3):
    add_lora(tiny_sd3.transformer, rank=4, alpha=4, targets=tiny_sd3.lora_target_modules)
    batch = _rollout_batch(tiny_sd3)
    _, stats = FlowGRPO(kl_beta=1.0).loss(tiny_sd3, batch, Microbatch(torch.arange(3), 0))
    assert stats["kl"] == 0.0


def test_adapter_switch_gives_the_base_model(tiny_sd3):
    x = torch.randn(2, 4, 4, 4)
    sigma = torch.tensor([0.5, 0.5])
    cond = tiny_sd3.encode_prompt(["a", "b"])
    base = tiny_sd3.velocity(x, sigma, cond)
    add_lora(tiny_sd3.transformer, rank=4, alpha=4, targets=tiny_sd3.lora_target_modules)
    for name, p in tiny_sd3.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    assert not torch.allclose(tiny_sd3.velocity(x, sigma, cond), base)
    with adapters_disabled(tiny_sd3.transformer):
        torch.testing.assert_close(tiny_sd3.velocity(x, sigma, cond), base)


def test_plan_splits_into_optimizer_steps(tiny_sd3):
    batch = _rollout_batch(tiny_sd3)
    plan = FlowGRPO(updates_per_iteration=2).plan(batch, torch.Generator().manual_seed(0))
    assert len(plan) == 2 and sum(len(g) for g in plan) == 6
    dropped = batch._replace(keep=torch.tensor([False] * 3 + [True] * 3))
    plan = FlowGRPO().plan(dropped, torch.Generator().manual_seed(0))
    assert all(mb.index.tolist() == [3, 4, 5] for g in plan for mb in g)


def test_a_step_without_a_density_is_not_planned(tiny_sd3):
    """CPS's step to sigma 0 has std 0 at any level: no log-prob gradient, no KL; training it is wasted work."""
    from flowrl.samplers.sde_steps import has_density

    batch = _rollout_batch(tiny_sd3, sde="cps")
    traj = batch.trajectory._replace(noise_levels=torch.full((4,), 0.7, dtype=torch.float64))
    assert has_density("cps", traj.sigmas, traj.noise_levels).tolist() == [True, True, True, False]
    assert has_density("flow", traj.sigmas, traj.noise_levels).all()
    assert not has_density("cps", traj.sigmas, torch.zeros(4, dtype=torch.float64)).any()
    plan = FlowGRPO().plan(batch._replace(trajectory=traj), torch.Generator().manual_seed(0))
    assert sorted({mb.step for g in plan for mb in g}) == [0, 1, 2]
