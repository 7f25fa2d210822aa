"""The training loop on a tiny real SD3 pipeline: one iteration, exact state restore, bad rewards."""

import pytest
import torch

from flowrl.config import load_config
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import RewardError, build_multi_reward
from flowrl.rollouts.collect import iteration_levels
from flowrl.trainer import Trainer

FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=3",
    "sampler.num_steps=3",
    "sampler.chunk_size=3",
    "train.eval_seeds=1",
    "objective.kl_beta=0.01",
    "optim.lr=0.01",
    "objective.updates_per_iteration=2",
]


def _trainer(model, *extra):
    cfg = load_config(None, FAST + list(extra))
    prompts = load_prompts("digits-styles")
    return Trainer(
        cfg, build_policy(cfg, model=model, trainable=True), build_multi_reward(cfg.rewards), prompts, prompts[:2]
    )


def test_one_iteration_updates_only_the_lora(tiny_sd3):
    trainer = _trainer(tiny_sd3)
    frozen = {n: p.clone() for n, p in tiny_sd3.transformer.named_parameters() if "lora_" not in n}
    lora_b = {n: p.clone() for n, p in tiny_sd3.transformer.named_parameters() if "lora_B" in n}
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0
    assert metrics["iteration"] == 1.0 and trainer.samples_seen == 6
    # NFE: rollout 6 samples x 3 steps + policy and KL-reference passes on 2 SDE steps x 6 samples
    assert metrics["nfe"] == 6 * 3 + 2 * (6 * 2)
    for key in (
        "reward_mean",
        "reward/ink_band",
        "reward/digit_correctness",
        "train/loss",
        "train/grad_norm",
        "train/kl",
    ):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    for n, p in tiny_sd3.transformer.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, lora_b[n]) for n, p in tiny_sd3.transformer.named_parameters() if n in lora_b)
    ev = trainer.evaluate()
    assert set(ev) == {"eval/reward_mean", "eval/reward_ci95", "eval/ink_band", "eval/digit_correctness", "eval/drift"}


def test_state_dict_restores_exactly(tiny_sd3):
    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter

    trainer = _trainer(tiny_sd3)
    trainer.train_step()
    state = trainer.state_dict()
    expected = trainer.train_step()
    twin = _trainer(SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)))
    twin.load_state_dict(state)
    got = twin.train_step()
    for key in ("reward_mean", "train/loss", "train/grad_norm"):
        assert got[key] == expected[key], key
    for (n, a), (_, b) in zip(trainer.model.transformer.named_parameters(), twin.model.transformer.named_parameters()):
        assert torch.equal(a, b), n


def test_check_state_dict_refuses_moments_that_do_not_fit(tiny_sd3):
    trainer = _trainer(tiny_sd3)
    trainer.train_step()
    state = trainer.state_dict()
    trainer.check_state_dict(state)  # its own state fits
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = moments["exp_avg"][:1]
    with pytest.raises(ValueError, match="the optimizer state of parameter 0 does not fit this run's LoRA"):
        trainer.check_state_dict(state)


def test_nan_reward_is_named(tiny_sd3):
    from flowrl.rewards.combine import MultiReward

    def broken(images, prompts, **_):
        return torch.full((images.shape[0],), float("nan"))

    cfg = load_config(None, FAST)
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=tiny_sd3, trainable=True),
        MultiReward({"broken_reward": (broken, 1.0)}),
        prompts,
        prompts[:2],
    )
    with pytest.raises(RewardError, match="broken_reward"):
        trainer.train_step()


@pytest.mark.parametrize("mode", ["fixed", "random", "progressive"])
def test_sde_window_trains_only_window_steps(tiny_sd3, mode):
    trainer = _trainer(
        tiny_sd3,
        "sampler.num_steps=4",
        f"sampler.window={mode}",
        "sampler.window_size=2",
        "sampler.window_start=1",
        "sampler.window_range=[0, 4]",
        "sampler.window_shift_every=1",
    )
    levels = iteration_levels(trainer.rollout_context())
    assert int((levels > 0).sum()) == 2
    if mode == "fixed":
        assert levels.tolist() == [0.0, 0.7, 0.7, 0.0]
    if mode == "progressive":
        assert levels.tolist() == [0.7, 0.7, 0.0, 0.0]
        trainer.iteration = 1  # slides by one step every window_shift_every=1 iterations
        assert iteration_levels(trainer.rollout_context()).tolist() == [0.0, 0.7, 0.7, 0.0]
    batch, _ = trainer.collect()
    stored = batch.trajectory.noise_levels
    assert int((stored > 0).sum()) == 2
    steps = {mb.step for group in trainer.objective.plan(batch, torch.Generator().manual_seed(0)) for mb in group}
    assert steps == {j for j in range(4) if stored[j] > 0}  # only window steps are trained
    assert (batch.trajectory.log_probs[:, stored == 0] == 0).all()  # ODE steps carry no density


def test_eval_steps_sets_the_evaluation_grid_only(tiny_sd3):
    trainer = _trainer(tiny_sd3, "train.eval_steps=5")
    assert len(trainer.sigmas) == 4 and len(trainer.eval_sigmas) == 6  # rollouts keep sampler.num_steps=3
    trainer.model.nfe = 0
    calls = []
    velocity = trainer.model._model.velocity
    trainer.model._model.velocity = lambda x, s, c: calls.append(len(x)) or velocity(x, s, c)
    trainer.evaluate()
    # 2 eval prompts x 1 seed x 5 steps, not counted; twice: the first evaluation also draws the base model's samples
    assert sum(calls) == 2 * 2 * 5 and trainer.model.nfe == 0


def test_evaluation_never_moves_the_global_rng(tiny_sd3):
    """A checkpoint saves torch's global RNG: sampling and evaluating must not draw from it."""
    trainer = _trainer(tiny_sd3)
    before = torch.get_rng_state().clone()
    trainer.evaluate()
    trainer.sample(trainer.eval_prompts[:2], [5, 6])
    assert torch.equal(before, torch.get_rng_state())


def test_a_random_sde_window_is_drawn_from_the_runs_generator(tiny_sd3: object) -> None:
    """sampler.window=random draws its start from the run's generator, never torch's global RNG (seeded runs repeat)."""
    trainer = _trainer(
        tiny_sd3, "sampler.num_steps=6", "sampler.window=random", "sampler.window_size=2", "sampler.window_range=[0,6]"
    )
    state, global_state = trainer.generator.get_state(), torch.get_rng_state()
    first = iteration_levels(trainer.rollout_context())
    assert not torch.equal(trainer.generator.get_state(), state)  # the draw advanced the run's stream
    assert torch.equal(torch.get_rng_state(), global_state)
    trainer.generator.set_state(state)
    assert torch.equal(iteration_levels(trainer.rollout_context()), first)


def test_initial_noise_of_another_row_count_is_refused(tiny_sd3: object) -> None:
    """A given initial_noise is used as it is, and one that does not hold the rollout's rows is a ValueError."""
    from dataclasses import replace

    ctx = _trainer(tiny_sd3).rollout_context()
    given = torch.randn(4, *ctx.latent_shape, generator=torch.Generator().manual_seed(0))
    ctx = replace(ctx, initial_noise=given)
    assert torch.equal(ctx.noise(4), given)
    with pytest.raises(ValueError, match=r"initial_noise has shape \(4, .*; the rollout needs \(6, "):
        ctx.noise(6)


def test_the_scored_images_are_the_decoded_final_samples(tiny_sd3: object) -> None:
    """Each chunk reports its clean final latents: the batch's images are those samples decoded, chunk by chunk."""
    trainer = _trainer(tiny_sd3)
    batch, _ = trainer.collect()
    assert torch.equal(batch.samples, batch.trajectory.latents[:, -1])
    with torch.no_grad():
        decoded = torch.cat([tiny_sd3.decode(batch.samples[i : i + 3]) for i in range(0, 6, 3)])  # chunk_size=3
    torch.testing.assert_close(batch.images, decoded, rtol=0, atol=1e-6)


def test_diffusion_nft_samples_with_its_old_adapter() -> None:
    """DiffusionNFT's rollouts come from its "old" adapter: moving only "default" leaves the samples unchanged."""
    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter
    from flowrl.policy.lora import adapter_parameters

    def samples(move_default: bool) -> torch.Tensor:
        model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
        trainer = _trainer(model, "objective.name=diffusion_nft")
        assert trainer.objective.sampling_adapter == "old"
        if move_default:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in adapter_parameters(trainer.model.transformer, "default").values():
                    p.add_(torch.randn(p.shape, generator=g) * 0.2)
        return trainer.collect()[0].samples

    assert torch.equal(samples(True), samples(False))


def test_update_metrics_are_micro_batch_means_of_the_step_scaled_gradients(tiny_sd3: object, monkeypatch) -> None:
    """Each step backwards loss / (its micro-batches); train/loss is the mean loss over all micro-batches and
    train/grad_norm the mean of the steps' gradient norms weighted by their micro-batches."""
    trainer = _trainer(tiny_sd3, "optim.max_grad_norm=1000")
    objective = trainer.objective
    plans: list = []
    losses: list[float] = []
    grads: list[torch.Tensor] = []
    norms: list[float] = []
    plan, loss, clip = objective.plan, objective.loss, torch.nn.utils.clip_grad_norm_

    def planned(batch, generator):  # the real plan, recorded
        plans.append(plan(batch, generator))
        return plans[-1]

    def scored(model, batch, mb):  # the real loss, with its own gradient recorded
        value, stats = loss(model, batch, mb)
        g = torch.autograd.grad(value, trainer.params, retain_graph=True, allow_unused=True)
        grads.append(
            torch.cat([(torch.zeros_like(p) if x is None else x).flatten() for p, x in zip(trainer.params, g)])
        )
        losses.append(float(value.detach()))
        return value, stats

    def clipped(params, max_norm):  # the real clip, its norm recorded
        norm = clip(params, max_norm)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(objective, "plan", planned)
    monkeypatch.setattr(objective, "loss", scored)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clipped)
    metrics = trainer.train_step()
    sizes = [len(group) for group in plans[0]]
    assert len(sizes) == len(norms) and sum(sizes) == len(losses) and max(sizes) > 1, sizes
    start = 0
    for size, norm in zip(sizes, norms):
        expected = float(torch.stack(grads[start : start + size]).sum(0).div(size).norm())
        assert norm == pytest.approx(expected, rel=1e-4)
        start += size
    assert metrics["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
    assert metrics["train/grad_norm"] == pytest.approx(sum(n * s for n, s in zip(norms, sizes)) / sum(sizes), rel=1e-6)


def test_load_state_dict_restores_the_counters_and_the_population_reward_std(tiny_sd3: object, monkeypatch) -> None:
    """A twin loaded from a state has its NFE, samples, iteration, guard and reward history; reward_std is the
    population std (unbiased=False) of the global batch's rewards."""
    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter

    trainer = _trainer(tiny_sd3, "advantage.method=per_prompt")
    batches: list = []
    collect = trainer.collect

    def collected():  # the real rollout, its batch recorded
        batches.append(collect())
        return batches[-1]

    monkeypatch.setattr(trainer, "collect", collected)
    metrics = trainer.train_step()
    rewards = batches[0][0].global_rewards
    assert metrics["reward_std"] == pytest.approx(float(rewards.std(unbiased=False)), rel=1e-6)
    trainer.guard.skip("a test fault", 2)
    state = trainer.state_dict()
    twin = _trainer(
        SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)), "advantage.method=per_prompt"
    )
    twin.load_state_dict(state)
    assert twin.model.nfe == trainer.model.nfe == state["nfe"] > 0
    assert (twin.iteration, twin.samples_seen) == (1, 6)
    assert twin.guard.state_dict() == {"consecutive": 1, "total": 1, "first_fault": "a test fault at iteration 2"}
    assert twin.advantage.state_dict() == trainer.advantage.state_dict() != {}


def test_check_state_dict_refuses_an_adam_step_that_is_not_one_number(tiny_sd3: object) -> None:
    """An AdamW moment entry whose step counter is not a single number does not fit this run."""
    trainer = _trainer(tiny_sd3)
    trainer.train_step()
    state = trainer.state_dict()
    state["optimizer"]["state"][0]["step"] = torch.tensor([1.0, 1.0])
    with pytest.raises(ValueError, match="the optimizer state of parameter 0 does not fit this run's LoRA"):
        trainer.check_state_dict(state)


def test_check_state_dict_refuses_another_count_of_parameter_groups(tiny_sd3: object) -> None:
    """An optimizer state with more AdamW parameter groups than this run's is refused, naming both counts."""
    trainer = _trainer(tiny_sd3)
    state = trainer.state_dict()
    groups = state["optimizer"]["param_groups"]
    groups.append({**groups[0], "params": []})
    with pytest.raises(ValueError, match="the optimizer state has 2 parameter groups; this run has 1"):
        trainer.check_state_dict(state)


def test_a_reward_component_is_logged_as_the_mean_over_the_samples_it_applies_to(tiny_sd3: object) -> None:
    """reward/<name> is the nan-mean of the component: samples where the reward does not apply (NaN) are left out."""
    from flowrl.rewards.combine import MultiReward

    def partial(images: torch.Tensor, prompts: list[str], **_: object) -> torch.Tensor:
        return torch.where(torch.arange(images.shape[0]) % 2 == 0, float("nan"), 0.25)

    def ink(images: torch.Tensor, prompts: list[str], **_: object) -> torch.Tensor:
        return images.mean(dim=(1, 2, 3))

    partial.allows_nan = True  # type: ignore[attr-defined]
    cfg = load_config(None, FAST)
    prompts = load_prompts("digits-styles")
    reward = MultiReward({"partial": (partial, 1.0), "ink": (ink, 1.0)})
    trainer = Trainer(cfg, build_policy(cfg, model=tiny_sd3, trainable=True), reward, prompts, prompts[:2])
    metrics = trainer.train_step()
    assert metrics["reward/partial"] == 0.25
