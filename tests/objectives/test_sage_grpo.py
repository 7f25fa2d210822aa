"""SAGE-GRPO: equaliser, dual trust region, adaptive beta (float64 math), ratio 1, anchor schedule, resume."""

import json
from pathlib import Path

import pytest
import torch

from flowrl.checkpoint import load_checkpoint, save_checkpoint
from flowrl.models.adapter import select_cond
from flowrl.objectives import OBJECTIVES, Microbatch, RolloutBatch, SageGRPO, clipped_policy_loss
from flowrl.objectives.sage_grpo import adapt_kl_weight, equaliser_scales, step_sensitivity, transition_kl
from flowrl.policy import build_policy
from flowrl.policy.lora import adapter_parameters, add_lora, use_adapter
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import get_sde_step, linear_sigmas, sage_sde_variance, sde_noise_levels, shift_sigmas

REPO = Path(__file__).resolve().parents[2]


# -- equaliser ---------------------------------------------------------------------------------


def test_sensitivity_matches_the_closed_forms():
    sigmas = shift_sigmas(linear_sigmas(10).double(), 3.0)
    levels = torch.full((10,), 0.5, dtype=torch.float64)
    sigma, nxt = sigmas[:-1], sigmas[1:]
    # SAGE: mean = x + dt v - s^2/(2 sigma) (x + (1 - sigma) v)  ->  |d mean/d v| = |dt| + s^2 (1 - sigma) / (2 sigma)
    var = sage_sde_variance(sigma, nxt, 0.5)
    expected = ((sigma - nxt) + var * (1 - sigma) / (2 * sigma)) / var.sqrt()
    torch.testing.assert_close(step_sensitivity("sage", sigmas, levels), expected, rtol=1e-12, atol=0)
    # Dance-SDE: std = eta sqrt(dt), mean slope dt (1 + eta^2 (1 - sigma) / (2 sigma))
    expected = (sigma - nxt) * (1 + 0.25 * (1 - sigma) / (2 * sigma)) / (0.5 * (sigma - nxt).sqrt())
    torch.testing.assert_close(step_sensitivity("dance", sigmas, levels), expected, rtol=1e-12, atol=0)
    # a deterministic step has no sensitivity
    assert torch.isnan(step_sensitivity("sage", sigmas, torch.zeros(10, dtype=torch.float64))).all()


def test_median_scales():
    g = torch.tensor([1.0, 2.0, 4.0, float("nan")], dtype=torch.float64)
    torch.testing.assert_close(equaliser_scales(g), torch.tensor([2.0, 1.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.equal(equaliser_scales(torch.full((3,), float("nan"))), torch.ones(3, dtype=torch.float64))


def _step_gradient_norms(sde: str, equalise: bool) -> torch.Tensor:
    """Linear toy: v = theta (no dependence on x), one shared noise z for every step, advantage 1.

    d log p_j / d theta = b_j z / (s_j D) exactly, so step j's gradient norm is g_j |z| / D.
    """
    gen = torch.Generator().manual_seed(0)
    shape = (1, 4, 6)
    sigmas = shift_sigmas(linear_sigmas(8).double(), 3.0)
    levels = sde_noise_levels(8, 0.7 if sde == "flow" else 0.5)
    theta0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    step_fn = get_sde_step(sde)
    scales = equaliser_scales(torch.where(levels > 0, step_sensitivity(sde, sigmas, levels), torch.nan))
    norms = []
    for j in range(7):  # the stochastic steps
        s, n = sigmas[j : j + 1], sigmas[j + 1 : j + 2]
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        drawn = step_fn(x, theta0, s, n, float(levels[j]), noise=z)
        theta = theta0.clone().requires_grad_(True)
        new = step_fn(x, theta, s, n, float(levels[j]), prev_sample=drawn.sample)
        loss, ratio = clipped_policy_loss(new.log_prob, drawn.log_prob, torch.ones(1, dtype=torch.float64), 1e-4)
        assert float(ratio.detach()) == 1.0
        (loss.sum() * (scales[j] if equalise else 1.0)).backward()
        norms.append(theta.grad.norm())
    return torch.stack(norms)


@pytest.mark.parametrize("sde", ["sage", "flow", "dance", "cps"])
def test_equaliser_makes_per_step_gradient_norms_equal(sde):
    raw = _step_gradient_norms(sde, equalise=False)
    assert raw.max() / raw.min() > 1.3  # the steps really differ without it
    equal = _step_gradient_norms(sde, equalise=True)
    torch.testing.assert_close(equal, equal.median().expand(7), rtol=1e-10, atol=0)


# -- KL and adaptive beta ----------------------------------------------------------------------


def test_transition_kl_is_the_closed_form_gaussian_kl():
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    other = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.5, 1.5, 0.1], dtype=torch.float64).view(3, 1, 1)
    p = torch.distributions.Normal(mean, std.expand_as(mean))
    q = torch.distributions.Normal(other, std.expand_as(other))
    expected = torch.distributions.kl_divergence(p, q).mean(dim=(1, 2))
    torch.testing.assert_close(transition_kl(mean, other, std), expected, rtol=1e-12, atol=0)
    zero_std = torch.tensor([0.5, 0.0, 0.1], dtype=torch.float64).view(3, 1, 1)
    out = transition_kl(mean, other, zero_std)
    assert out[1] == 0.0 and torch.isfinite(out).all()


def test_adaptive_beta_direction_and_bounds():
    assert adapt_kl_weight(1.0, 2.0, 1.0, 0.2, 0.0, 10.0) == pytest.approx(1.2)  # KL above target: up, capped at +20 %
    assert adapt_kl_weight(1.0, 1.1, 1.0, 0.2, 0.0, 10.0) == pytest.approx(1.1)  # proportional inside the band
    assert adapt_kl_weight(1.0, 0.0, 1.0, 0.2, 0.0, 10.0) == pytest.approx(0.8)  # below: down
    assert adapt_kl_weight(1.0, 1.0, 1.0, 0.2, 0.0, 10.0) == 1.0
    assert adapt_kl_weight(9.5, 5.0, 1.0, 0.2, 0.0, 10.0) == 10.0  # clamped to the upper bound
    assert adapt_kl_weight(0.11, 0.0, 1.0, 0.2, 0.1, 10.0) == 0.1  # and to the lower one
    assert adapt_kl_weight(0.5, float("nan"), 1.0, 0.2, 0.0, 10.0) == 0.5  # a non-finite KL leaves beta alone
    beta = 1e-7
    for _ in range(100):  # the reference's bounds: climbs to and stays at kl_max while KL > target
        beta = adapt_kl_weight(beta, 1e-3, 1e-5, 0.2, 1e-7, 1e-5)
    assert beta == 1e-5


def test_config_validation_names_the_key():
    from flowrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="kl_min <= kl_init <= kl_max"):
        load_config(REPO / "configs/sage/digits.yaml", ["objective.kl_init=1.0"])
    with pytest.raises(ConfigError, match="objective.anchor_every"):
        load_config(REPO / "configs/sage/digits.yaml", ["objective.anchor_every=-1"])
    with pytest.raises(ConfigError, match="can never leave 0"):
        load_config(REPO / "configs/sage/digits.yaml", ["objective.kl_min=0", "objective.kl_init=0"])
    load_config(REPO / "configs/sage/digits.yaml", ["objective.kl_min=0", "objective.kl_init=0", "objective.kl_max=0"])
    assert OBJECTIVES["sage_grpo"] is SageGRPO


# -- on the tiny SD3 model ---------------------------------------------------------------------


def _lora(model, scale=0.05):
    add_lora(model.transformer, rank=4, alpha=4, targets=model.lora_target_modules)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, scale)


def _perturb(model, scale=0.02):
    """Stand-in for an optimizer step on the trainable ("default") LoRA."""
    with torch.no_grad():
        for p in adapter_parameters(model.transformer, "default").values():
            p.add_(torch.randn_like(p) * scale)


def _batch(model, sde="sage", level=0.5, chunk=3, groups=2, k=3, steps=4):
    prompts = [f"a handwritten {d}" for d in range(groups) for _ in range(k)]
    cond = model.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *model.latent_shape(8, 8), generator=gen)
    traj = chunked_rollout(
        model, cond, x, linear_sigmas(steps), sde_noise_levels(steps, level), chunk_size=chunk, generator=gen, sde=sde
    )
    adv = torch.randn(len(prompts), generator=gen)
    ids = torch.arange(groups).repeat_interleave(k)
    keep = torch.ones(len(prompts), dtype=torch.bool)
    return RolloutBatch(
        prompts, ids, cond, traj.latents[:, -1], traj, traj.sigmas, traj.latents[:, -1], adv, adv, keep, chunk
    )


def test_ratio_is_exactly_one_before_the_first_update(tiny_sd3):
    _lora(tiny_sd3)
    objective = SageGRPO(anchor_every=5, kl_init=1e-3, kl_min=1e-4, kl_max=1e-2)
    objective.setup(tiny_sd3)
    batch = _batch(tiny_sd3)
    scales = equaliser_scales(
        torch.where(
            batch.trajectory.noise_levels > 0,
            step_sensitivity("sage", batch.sigmas, batch.trajectory.noise_levels),
            torch.nan,
        )
    )
    seen = 0
    for group in objective.plan(batch, torch.Generator().manual_seed(1)):
        for mb in group:
            loss, stats = objective.loss(tiny_sd3, batch, mb)
            assert stats["ratio"] == 1.0 and stats["clipfrac"] == 0.0 and stats["approx_kl"] == 0.0
            assert stats["kl_anchor"] == 0.0 and stats["kl_step"] == 0.0  # anchor and rollout policy are theta
            assert stats["eq_scale"] == pytest.approx(float(scales[mb.step]), rel=1e-6)
            seen += 1
    assert seen == 2 * 3


def test_anchor_shortcut_is_exact_and_fixed_anchor_is_the_base_model(tiny_sd3):
    _lora(tiny_sd3)
    objective = SageGRPO(anchor_every=5)
    objective.setup(tiny_sd3)
    x, sigma = torch.randn(2, 4, 4, 4), torch.tensor([0.7, 0.7])
    cond = tiny_sd3.encode_prompt(["a", "b"])
    with use_adapter(tiny_sd3.transformer, "anchor"):
        anchor_v = tiny_sd3.velocity(x, sigma, cond)
    assert torch.equal(anchor_v, tiny_sd3.velocity(x, sigma, cond))  # a fresh anchor *is* theta, bit for bit
    fixed = SageGRPO(anchor_every=0)  # the base model (LoRA off) as the anchor
    batch = _batch(tiny_sd3)
    _, stats = fixed.loss(tiny_sd3, batch, Microbatch(torch.arange(3), 0))
    assert stats["kl_anchor"] > 0.0


def test_anchor_refreshes_every_k_updates(tiny_sd3):
    _lora(tiny_sd3)
    objective = SageGRPO(anchor_every=3)
    objective.setup(tiny_sd3)
    tr = tiny_sd3.transformer

    def anchor_equals_theta():
        default, anchor = adapter_parameters(tr, "default"), adapter_parameters(tr, "anchor")
        return all(torch.equal(default[k], anchor[k]) for k in default)

    assert anchor_equals_theta()
    history = []
    for update in range(1, 10):
        _perturb(tiny_sd3)
        out = objective.after_update(tiny_sd3)
        history.append((update, anchor_equals_theta(), objective.since_refresh, out["anchor_refreshes"]))
    assert [u for u, same, _, _ in history if same] == [3, 6, 9]
    assert [s for _, _, s, _ in history] == [1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert history[-1][3] == 3.0 and objective.updates == 9


def test_step_kl_against_the_rollout_policy(tiny_sd3):
    _lora(tiny_sd3)
    objective = SageGRPO(anchor_every=0, updates_per_iteration=2)
    objective.setup(tiny_sd3)
    batch = _batch(tiny_sd3)
    mb = Microbatch(torch.arange(3), 1)
    assert objective.loss(tiny_sd3, batch, mb)[1]["kl_step"] == 0.0
    _perturb(tiny_sd3)
    objective.after_update(tiny_sd3)  # first update of the iteration: theta left the rollout policy
    _, stats = objective.loss(tiny_sd3, batch, mb)
    # the closed form against the frozen "rollout" adapter, by hand
    traj, idx = batch.trajectory, mb.index
    x, nxt, c = traj.latents[idx, 1], traj.latents[idx, 2], select_cond(batch.cond, idx)
    s, n = traj.sigmas[1].float().expand(3), traj.sigmas[2].float().expand(3)
    step_fn = get_sde_step("sage")
    with torch.no_grad():
        new = step_fn(x, tiny_sd3.velocity(x, s, c), s, n, 0.5, prev_sample=nxt)
        with use_adapter(tiny_sd3.transformer, "rollout"):
            old = step_fn(x, tiny_sd3.velocity(x, s, c), s, n, 0.5, prev_sample=nxt)
    expected = float(transition_kl(new.mean, old.mean, new.std).mean())
    assert stats["kl_step"] == pytest.approx(expected, rel=1e-6) and expected > 0
    objective.after_iteration(tiny_sd3, 1)  # the next rollout samples with theta: snapshot it
    assert objective.loss(tiny_sd3, batch, mb)[1]["kl_step"] == 0.0
    default, rollout = (
        adapter_parameters(tiny_sd3.transformer, "default"),
        adapter_parameters(tiny_sd3.transformer, "rollout"),
    )
    assert all(torch.equal(default[k], rollout[k]) for k in default)


def test_equaliser_scales_the_policy_loss(tiny_sd3):
    _lora(tiny_sd3)
    batch = _batch(tiny_sd3)
    mb = Microbatch(torch.arange(3), 0)
    on, off = SageGRPO(anchor_every=0), SageGRPO(anchor_every=0, equalise=False)
    _, s_on = on.loss(tiny_sd3, batch, mb)
    _, s_off = off.loss(tiny_sd3, batch, mb)
    assert s_off["eq_scale"] == 1.0 and s_on["eq_scale"] != 1.0
    assert s_on["policy_loss"] == pytest.approx(s_on["eq_scale"] * s_off["policy_loss"], rel=1e-5)


# -- the trainer: checkpoint/resume and an end-to-end run --------------------------------------

SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=4",
    "sampler.chunk_size=8",
    "train.eval_every=2",
    "train.eval_seeds=1",
    "output.grid_seeds=1",
    "train.progress=false",
]


def _trainer(overrides):
    from flowrl.config import load_config
    from flowrl.models import load_adapter
    from flowrl.prompts.sets import load_prompts
    from flowrl.recipe import build_reward
    from flowrl.trainer import Trainer

    cfg = load_config(REPO / "configs/sage/digits.yaml", SMALL + overrides)
    torch.manual_seed(cfg.train.seed)
    prompts = load_prompts(cfg.prompts.train)
    return Trainer(
        cfg, build_policy(cfg, model=load_adapter(cfg.model.path), trainable=True), build_reward(cfg), prompts, prompts
    )


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    extra = ["objective.anchor_every=2", "objective.updates_per_iteration=2", "sampler.num_steps=4"]
    straight = _trainer(extra)
    for _ in range(3):
        straight.train_step()
    first = _trainer(extra)
    for _ in range(2):
        first.train_step()
    save_checkpoint(first.state_dict(), tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "trainer.json").read_text())
    assert meta["objective"]["updates"] == 4 and meta["objective"]["refreshes"] == 2
    assert (tmp_path / "ck" / "adapter-anchor.safetensors").is_file() and (
        tmp_path / "ck" / "adapter-rollout.safetensors"
    ).is_file()
    resumed = _trainer(extra)
    resumed.load_state_dict(load_checkpoint(tmp_path / "ck"))
    assert resumed.objective.state_dict() == first.objective.state_dict()
    resumed.train_step()
    assert resumed.objective.state_dict() == straight.objective.state_dict()
    a, b = straight.state_dict(), resumed.state_dict()
    for name in ("default", "anchor", "rollout"):
        wa = a["lora"] if name == "default" else a["adapters"][name]
        wb = b["lora"] if name == "default" else b["adapters"][name]
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


@pytest.mark.slow
def test_two_iterations_through_the_recipe(tmp_path):
    from flowrl.config import load_config
    from flowrl.recipe import Run

    cfg = load_config(
        REPO / "configs/sage/digits.yaml", SMALL + ["train.iterations=2", f"output.dir={tmp_path / 'run'}"]
    )
    assert cfg.sampler.sde == "sage" and cfg.sampler.noise_level == 0.5
    summary = Run(cfg).execute()
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 2 and trained[0]["train/first_ratio"] == 1.0
    assert trained[-1]["train/updates"] == 2.0 and "train/kl_beta" in trained[-1]
    assert (tmp_path / "run" / "checkpoints" / "iter-000002" / "adapter-anchor.safetensors").is_file()
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("name", ["digits.yaml", "sd3.5m_jpeg.yaml", "wan2.1_t2v_1.3b.yaml"])
def test_shipped_configs_validate(name):
    from flowrl.config import load_config

    cfg = load_config(REPO / "configs/sage" / name)
    assert cfg.objective["name"] == "sage_grpo" and cfg.sampler.sde == "sage" and cfg.sampler.noise_level == 0.5


def test_lora_loads_with_several_adapters_attached(tiny_sd3):
    from flowrl.policy.lora import add_frozen_copy, load_lora_state, lora_state_dict

    _lora(tiny_sd3)
    add_frozen_copy(tiny_sd3.transformer, "anchor")  # peft then reports the anchor's keys as "missing"
    state = lora_state_dict(tiny_sd3.transformer)
    _perturb(tiny_sd3)
    load_lora_state(tiny_sd3.transformer, state)
    back = lora_state_dict(tiny_sd3.transformer)
    assert all(torch.equal(back[k], state[k]) for k in state)
    partial = {k: v for i, (k, v) in enumerate(state.items()) if i > 0}
    with pytest.raises(ValueError, match="1 missing"):  # a real mismatch is still reported
        load_lora_state(tiny_sd3.transformer, partial)


@pytest.mark.slow
def test_tree_rollouts_ratio_one_and_split_step_equaliser():
    trainer = _trainer(
        [
            "objective.tree=true",
            "prompts.per_iteration=1",
            "prompts.group_size=16",
            "sampler.tree.split_steps=[0,3,6,9]",
            "sampler.tree.factors=[2]",
            "sampler.tree.split_noise_scale=4.0",
        ]
    )
    assert trainer.objective.rollout == "tree"
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    batch, _ = trainer.collect()
    tr = batch.tree.rollout
    assert tr.sde == "sage" and len(batch.samples) == 16
    g = step_sensitivity("sage", tr.sigmas, tr.noise_levels) / tr.noise_scales  # split steps: 4x std
    scales = equaliser_scales(torch.where(tr.noise_levels > 0, g, torch.nan))
    edges = 0
    for group in trainer.objective.plan(batch, torch.Generator().manual_seed(0)):
        for mb in group:
            loss, stats = trainer.objective.loss(trainer.model, batch, mb)
            assert stats["ratio"] == 1.0 and stats["approx_kl"] == 0.0 and stats["kl_anchor"] == 0.0, (mb.step, stats)
            assert stats["eq_scale"] == pytest.approx(float(scales[mb.step]), rel=1e-6)
            assert torch.isfinite(loss)
            edges += int(batch.tree.train[mb.step].reshape(-1, int(tr.factors[mb.step]))[mb.index].sum())
    assert edges == 58  # every edge of the tree once (2 + 2 + 2 + 4 + ... as in BranchGRPO)
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0 and metrics["train/updates"] == 1.0


def test_the_kl_term_weighs_the_anchor_and_step_kls(tiny_sd3):
    """loss = policy + beta * (anchor_weight * KL_anchor + step_kl_weight * KL_step) at a second update, where both
    KLs are live (the base model as anchor; theta has left the rollout policy), with the adapted beta (not
    ``kl_init``). A large beta makes the KL term dominate the fp32 loss, so each weight shows."""
    _lora(tiny_sd3)
    objective = SageGRPO(
        anchor_every=0, updates_per_iteration=2, anchor_weight=0.5, step_kl_weight=0.3, kl_init=1e6, kl_max=1e6
    )
    objective.setup(tiny_sd3)
    batch = _batch(tiny_sd3)
    _perturb(tiny_sd3, scale=0.1)
    objective.after_update(tiny_sd3)  # also steps beta (the adaptive controller)
    loss, stats = objective.loss(tiny_sd3, batch, Microbatch(torch.arange(3), 1))
    assert stats["kl_anchor"] > 0 and stats["kl_step"] > 0.02 * stats["kl_anchor"]
    assert stats["kl_beta"] == objective.beta < 1e6  # the controller moved beta off kl_init
    kl_eff = 0.5 * stats["kl_anchor"] + 0.3 * stats["kl_step"]
    assert abs(stats["policy_loss"]) < 0.1 * stats["kl_beta"] * kl_eff
    assert float(loss.detach()) == pytest.approx(stats["policy_loss"] + stats["kl_beta"] * kl_eff, rel=1e-5)
