"""DiffusionNFT and AWM: float64 identities of their losses and schedules."""

from pathlib import Path

import pytest
import torch

from flowrl.objectives.awm import AWM, stratified_steps, weighted_log_likelihood
from flowrl.objectives.diffusion_nft import DiffusionNFT, implicit_policies, nft_policy_loss, optimality_probability

F64 = torch.float64


def _setup(seed=0, b=4):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, 2, 3, 3, generator=g, dtype=F64)
    eps = torch.randn(b, 2, 3, 3, generator=g, dtype=F64)
    sigma = torch.tensor([0.9, 0.6, 0.4, 0.2], dtype=F64)[:b]
    t = sigma.view(-1, 1, 1, 1)
    return x0, eps, sigma, (1 - t) * x0 + t * eps


def test_beta_one_policies():
    g = torch.Generator().manual_seed(1)
    v_theta, v_old = torch.randn(3, 4, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    pos, neg = implicit_policies(v_theta, v_old, 1.0)
    torch.testing.assert_close(pos, v_theta, rtol=0, atol=0)
    torch.testing.assert_close(neg, 2 * v_old - v_theta, rtol=0, atol=0)


def test_optimality_probability():
    adv = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 7.0], dtype=F64)
    torch.testing.assert_close(
        optimality_probability(adv, 5.0), torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0], dtype=F64)
    )


def test_nft_gradient_is_zero_at_v_old_with_r_half():
    x0, eps, sigma, x_t = _setup()
    v_old = torch.randn_like(x0)
    v_theta = v_old.clone().requires_grad_(True)
    r = torch.full((4,), 0.5, dtype=F64)
    nft_policy_loss(v_theta, v_old, x_t, x0, sigma, r, beta=0.7, clip=5.0).sum().backward()
    torch.testing.assert_close(v_theta.grad, torch.zeros_like(v_theta), rtol=0, atol=1e-12)


def test_nft_with_r_half_pulls_back_toward_v_old():
    x0, eps, sigma, x_t = _setup()
    v_old = torch.randn_like(x0)
    offset = 0.3 * torch.randn_like(x0)
    v_theta = (v_old + offset).requires_grad_(True)
    r = torch.full((4,), 0.5, dtype=F64)
    nft_policy_loss(v_theta, v_old, x_t, x0, sigma, r, beta=1.0, clip=5.0).sum().backward()
    # a descent step -grad points from v_theta back toward v_old
    assert float((-v_theta.grad * (v_old - v_theta.detach())).sum()) > 0


def test_nft_gradient_direction_follows_the_advantage():
    x0, eps, sigma, x_t = _setup()
    target = eps - x0
    v_old = target + 0.5 * torch.randn_like(x0)  # an imperfect sampling policy
    for r_value, sign in ((1.0, 1.0), (0.0, -1.0)):
        v_theta = v_old.clone().requires_grad_(True)
        r = torch.full((4,), r_value, dtype=F64)
        nft_policy_loss(v_theta, v_old, x_t, x0, sigma, r, beta=1.0, clip=5.0).sum().backward()
        toward_data = float((-v_theta.grad * (target - v_old)).sum())
        assert sign * toward_data > 0  # positive samples pull toward their data, negative push away


def test_awm_without_transform_and_unit_advantage_is_flow_matching():
    """p = None and A = 1: the AWM loss is the flow-matching MSE (equal sizes: a mean of means, to rounding).

    ``v`` comes from a seeded generator: drawn from the global RNG, about 1% of its states gave a
    rounding difference above an absolute 1e-15 and the test failed at random.
    """
    x0, eps, sigma, x_t = _setup()
    v = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3), dtype=F64).requires_grad_(True)
    mse = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    adv = torch.ones(4, dtype=F64)
    awm = (-adv * weighted_log_likelihood(mse, sigma, power=None)).mean()
    fm = ((v - (eps - x0)) ** 2).mean()
    torch.testing.assert_close(awm, fm, rtol=1e-14, atol=0)


def test_awm_power_transform_formula_and_gradient_signs():
    mse = torch.tensor([0.5, 2.0], dtype=F64)
    sigma = torch.tensor([0.8, 0.3], dtype=F64)
    lp = weighted_log_likelihood(mse, sigma, power=0.25)
    expected = -(sigma / 0.25) * ((mse + 1e-10) ** 0.25 - 1e-10**0.25)
    torch.testing.assert_close(lp, expected, rtol=0, atol=0)
    x0, eps, sig, x_t = _setup(b=2)
    for a, sign in ((1.0, 1.0), (-1.0, -1.0)):
        v = torch.zeros_like(x0, requires_grad=True)
        m = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
        (-a * weighted_log_likelihood(m, sig[:2], 0.25)).sum().backward()
        toward_target = float((-v.grad * (eps - x0)).sum())
        assert sign * toward_target > 0  # A > 0 learns the sample, A < 0 unlearns it


def test_stratified_steps_cover_strata():
    gen = torch.Generator().manual_seed(0)
    steps = stratified_steps(14, 6, 0.9, gen)
    assert steps == sorted(steps) and len(steps) == 6 and min(steps) >= 1 and max(steps) <= 12
    assert stratified_steps(10, 3, 0.9, gen, skip_first=False)[0] >= 0
    # the PickScore preset's "discrete": strata over [0, 12], so step 0 (sigma 1) can be drawn
    assert any(stratified_steps(14, 6, 0.9, torch.Generator().manual_seed(s), False)[0] == 0 for s in range(20))
    assert stratified_steps(1, 6, 0.9, gen, skip_first=False) == [0]
    with pytest.raises(ValueError, match="none with sampler.num_steps=1; set sampler.num_steps >= 2"):
        stratified_steps(1, 6, 0.9, gen)  # step 1 would be sigma 0, where the loss has no gradient
    assert AWM(skip_first=False).noise_per_row(14) == 6 and AWM().noise_per_row(2) == 1


def test_awm_configs_follow_the_reference_time_type():
    from flowrl.config import load_config

    repo = Path(__file__).resolve().parents[2]
    assert load_config(repo / "configs/awm/sd3.5m_pickscore.yaml").objective["skip_first"] is False  # discrete
    assert load_config(repo / "configs/awm/digits.yaml").objective["skip_first"] is True  # discrete_wo_init


def test_decay_schedules():
    nft = DiffusionNFT()
    assert nft.old_decay(0) == 0.0 and nft.old_decay(100) == 0.1 and nft.old_decay(10_000) == 0.5
    awm = AWM()
    assert awm.ema_decay(1) == 0.001 and awm.ema_decay(1000) == 0.3


def test_nft_old_adapter_soft_update_follows_its_formula(tiny_sd3):
    from flowrl.policy.lora import adapter_parameters, add_lora

    params = add_lora(tiny_sd3.transformer, rank=4, alpha=4, targets=tiny_sd3.lora_target_modules)
    nft = DiffusionNFT()
    nft.setup(tiny_sd3)
    old = {k: v.clone() for k, v in adapter_parameters(tiny_sd3.transformer, "old").items()}
    for p in params:
        p.data.normal_(0, 0.1)
    new = {k: v.clone() for k, v in adapter_parameters(tiny_sd3.transformer, "default").items()}
    stats = nft.after_iteration(tiny_sd3, iteration=300)
    eta = 0.3  # min(0.001 * 300, 0.5)
    assert abs(stats["old_decay"] - eta) < 1e-12
    for key, value in adapter_parameters(tiny_sd3.transformer, "old").items():
        torch.testing.assert_close(value, eta * old[key] + (1 - eta) * new[key])


def _plan_batch(b=12, chunk=4, steps=10):
    from flowrl.objectives.base import RolloutBatch

    x = torch.zeros(b, 2, 3, 3)
    sigmas = torch.linspace(1, 0, steps + 1)
    keep = torch.ones(b, dtype=torch.bool)
    return RolloutBatch(
        [f"p{i}" for i in range(b)],
        torch.arange(b) // 4,
        {},
        x,
        None,
        sigmas,
        x,
        x[:, 0, 0, 0],
        x[:, 0, 0, 0],
        keep,
        chunk,
    )


def test_awm_updates_per_iteration_split_the_same_microbatches():
    batch = _plan_batch()
    one = AWM(updates_per_iteration=1).plan(batch, torch.Generator().manual_seed(0))
    three = AWM(updates_per_iteration=3).plan(batch, torch.Generator().manual_seed(0))
    assert len(one) == 1 and len(three) == 3 and all(len(g) == 6 for g in three)  # 3 chunks x 6 sigmas
    key = lambda mb: (tuple(mb.index.tolist()), mb.step)  # noqa: E731
    assert sorted(map(key, one[0])) == sorted(key(mb) for g in three for mb in g)
    with pytest.raises(ValueError, match="updates_per_iteration"):
        AWM(updates_per_iteration=0)


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 10, 40])
@pytest.mark.parametrize(
    "objective",
    [DiffusionNFT(), DiffusionNFT(train_fraction=0.3), AWM(), AWM(num_timesteps=2), AWM(timestep_fraction=0.5)],
)
def test_noise_per_row_bounds_what_the_plan_draws(objective, steps):
    """The memory estimate's count (``noise_per_row``) against the plan's fresh noise latents per sample."""
    batch = _plan_batch(steps=steps)
    if isinstance(objective, AWM) and steps == 1:  # its one step is index 0, which AWM skips: refused, not sigma 0
        with pytest.raises(ValueError, match="objective.skip_first=false"):
            objective.plan(batch, torch.Generator().manual_seed(0))
        return
    drawn = []
    for seed in range(8):
        plan = objective.plan(batch, torch.Generator().manual_seed(seed))
        drawn.append(sum(mb.noise.shape[0] for group in plan for mb in group) // batch.samples.shape[0])
    bound = objective.noise_per_row(steps)
    assert max(drawn) <= bound
    if isinstance(objective, DiffusionNFT) or steps >= 10:  # NFT's count is fixed; AWM's strata are distinct here
        assert set(drawn) == {bound}


def test_objectives_that_draw_no_noise_count_none():
    from flowrl.objectives import OBJECTIVES

    none = {name for name, cls in OBJECTIVES.items() if cls().noise_per_row(10) == 0}
    assert none == set(OBJECTIVES) - {"diffusion_nft", "awm"} and {"flow_grpo", "branch_grpo", "sage_grpo"} <= none
