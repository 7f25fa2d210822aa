"""The Sol-RL two-stage pipeline in the training loop, on the embedded digits model."""

from __future__ import annotations

import math

import pytest
import torch
from solrl_setup import small_config, small_trainer

import flowrl.rollouts.collect as collect_module
import flowrl.solrl.pipeline as pipeline
from flowrl.policy.precision import build_explore
from flowrl.prompts.batch import sample_groups
from flowrl.runtime import seeded_noise
from flowrl.solrl.seeds import candidate_seeds
from flowrl.solrl.selection import select_seeds


def _record(monkeypatch, module, name):
    """Wrap ``module.name`` so every call's positional arguments and result are recorded."""
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_candidate_seeds_are_a_function_of_seed_iteration_and_position():
    a = candidate_seeds(7, 3, 2, 6)
    assert a.shape == (2, 6) and a.dtype == torch.int64
    assert torch.equal(a, candidate_seeds(7, 3, 2, 6))
    assert torch.equal(candidate_seeds(7, 3, 5, 6)[:2], a)  # more prompts: the first rows are unchanged
    assert not torch.equal(candidate_seeds(7, 4, 2, 6), a) and not torch.equal(candidate_seeds(8, 3, 2, 6), a)
    assert len(set(a.reshape(-1).tolist())) == 12


def test_stage_two_regenerates_the_selected_seeds_from_the_stage_one_noise(monkeypatch):
    trainer = small_trainer(small_config("solrl.selection=max_variance"))
    explored = _record(monkeypatch, pipeline, "chunked_solve")
    regenerated = _record(monkeypatch, collect_module, "chunked_solve")
    stage1 = _record(monkeypatch, trainer.solrl, "explore_stage")
    chosen = _record(monkeypatch, trainer.solrl, "select")
    metrics = trainer.train_step()

    (args1, kwargs1, _), (args2, _, _) = explored[0], regenerated[0]
    noise1, noise2 = args1[2], args2[2]  # chunked_solve(model, cond, x_init, sigmas, ...)
    assert len(args1[3]) == 2 + 1 and len(args2[3]) == 3 + 1  # explore steps, then the full step count
    assert kwargs1["solver"] == "dpmpp_2m"
    rows = chosen[0][2]  # (P, K) candidate indices
    p, k, n = rows.shape[0], rows.shape[1], 6
    assert (p, k) == (2, 4) and noise1.shape[0] == p * n and noise2.shape[0] == p * k
    flat = (torch.arange(p)[:, None] * n + rows).reshape(-1)
    assert torch.equal(noise2, noise1[flat])  # bit for bit: the same initial noise
    seeds = stage1[0][2].seeds
    kept = torch.gather(seeds, 1, rows).reshape(-1).tolist()
    assert torch.equal(noise2.cpu(), seeded_noise(trainer.latent_shape, kept))
    # the selection rule was applied to each prompt's stage-1 rewards
    rewards = stage1[0][2].rewards
    for prompt in range(p):
        assert torch.equal(rows[prompt], select_seeds(rewards[prompt], k, "max_variance"))
    assert {"solrl/kendall_tau", "solrl/extreme_overlap", "solrl/explore_candidates_per_s"} <= set(metrics)
    assert metrics["solrl/explore_candidates_per_s"] > 0 and metrics["train/skipped_updates"] == 0.0


def test_stage_two_batch_rows_are_the_selected_candidates_in_prompt_order(monkeypatch):
    """Row r of the trained batch is prompt r // K's candidate ``chosen[r // K, r % K]``.

    With a fresh LoRA (B = 0) the fp32 merged explore copy computes what the policy computes, so with the
    same solver and step count each regenerated seed's reward equals its explored reward: a wrong row
    mapping would pair different seeds and different images.
    """
    trainer = small_trainer(small_config("solrl.precision=fp32", "solrl.explore_steps=3"))
    chosen = _record(monkeypatch, trainer.solrl, "select")
    stage1 = _record(monkeypatch, trainer.solrl, "explore_stage")
    state = trainer.generator.get_state()
    batch, info = trainer.collect()
    prompts = sample_groups(trainer.train_prompts, 2, 4, torch.Generator().set_state(state))
    assert batch.prompts == prompts.texts and torch.equal(batch.group_ids, prompts.group_ids)
    rows = chosen[0][2]
    explored = torch.gather(stage1[0][2].rewards, 1, rows).reshape(-1)
    assert torch.allclose(batch.rewards.double(), explored, atol=1e-4)
    assert len(set(explored.tolist())) > 4  # distinct seeds, distinct rewards: the match is not trivial
    assert float(info["solrl/extreme_overlap"]) == 1.0


def test_the_explore_copy_is_refreshed_from_the_trained_weights_every_iteration():
    trainer = small_trainer(small_config("solrl.precision=fp32"))
    explore = trainer.solrl.explore

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in explore.module.state_dict().items()}

    trainer.train_step()  # updates the LoRA and (DiffusionNFT) soft-updates the sampling adapter "old"
    stale = weights()
    fresh = build_explore(trainer.policy, "fp32", adapter=trainer.objective.sampling_adapter)
    assert any(not torch.equal(stale[k], v) for k, v in fresh.module.state_dict().items())
    trainer.train_step()  # the second iteration explores with the refreshed copy
    fresh_before_update = fresh.module.state_dict()
    now = weights()
    assert all(torch.equal(now[k], v) for k, v in fresh_before_update.items())
    assert not any(p.requires_grad for p in explore.module.parameters())


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_the_explore_copy_takes_the_configured_fp8_scaling(scaling):
    """solrl.fp8_scaling reaches the fp8 copy (it always got per-tensor scales, though the H100 measured per row
    faster): each quantised weight is the merged weight fake-quantised with that scaling (emulated on the CPU)."""
    from flowrl.policy.fp8 import fp8_fake_quantize

    trainer = small_trainer(small_config("solrl.precision=fp8_e4m3", f"solrl.fp8_scaling={scaling}"))
    explore = trainer.solrl.explore
    assert explore.precision == "fp8_e4m3" and explore.scaling == scaling and explore.emulate
    reference = build_explore(trainer.policy, "fp32", adapter=trainer.objective.sampling_adapter).module
    name = explore.quantised[0]
    weight = reference.get_submodule(name).weight
    assert torch.equal(explore.module.get_submodule(name).weight, fp8_fake_quantize(weight, scaling))
    other = "tensor" if scaling == "row" else "row"
    assert not torch.equal(explore.module.get_submodule(name).weight, fp8_fake_quantize(weight, other))


def test_diagnostics_of_one_kept_seed_are_nan_not_an_error():
    """One prompt with one kept seed (advantage.method=per_prompt allows it): no ranking, so NaN agreement."""
    stage1 = pipeline.Stage1(torch.arange(8).reshape(1, 8), torch.rand(1, 8, dtype=torch.float64), 1.0)
    out = pipeline.SolRL.diagnostics(None, stage1, stage1.rewards[:, :1], stage1.rewards[:, :1] + 0.01, 1.0)
    assert torch.isnan(out["solrl/pooled_kendall_tau"]) and torch.isnan(out["solrl/kendall_tau"])
    assert float(out["solrl/regenerate_candidates_per_s"]) == 1.0
    two = pipeline.SolRL.diagnostics(None, stage1, stage1.rewards[:, :2], stage1.rewards[:, :2], 1.0)
    assert float(two["solrl/pooled_kendall_tau"]) == 1.0


def test_a_candidate_with_every_reward_not_applicable_counts_as_its_prompts_worst():
    """Its weighted total reads 0 (NaN components count 0), which would rank it above negative rewards."""
    from flowrl.rewards.combine import MultiReward

    def negative(images, prompts, **_):
        out = -1.0 - torch.arange(images.shape[0], dtype=torch.float32)
        out[1] = float("nan")  # explore chunks of 8 and 4 rows: prompt 0's candidate 1, prompt 1's candidate 3
        return out

    negative.allows_nan = True
    trainer = small_trainer(small_config("solrl.precision=fp32"))
    trainer.reward = MultiReward({"neg": (negative, 1.0)})
    prompts = sample_groups(trainer.train_prompts, 2, 4, trainer.generator)
    rewards = trainer.solrl.explore_stage(prompts, 2, 4).rewards
    assert rewards[0, 1] == rewards[0].min() == -6.0 and rewards[1, 3] == rewards[1].min() == -8.0
    assert pipeline.not_applicable(
        {"a": torch.tensor([float("nan"), 1.0]), "b": torch.tensor([float("nan")] * 2)}
    ).tolist() == [True, False]


def test_diagnostics_average_per_prompt_agreement_over_prompts_that_have_one():
    """Per-prompt tau / rho / overlap (top and bottom K // 2) are averaged over the prompts whose rewards can be
    ranked; a prompt with constant stage-2 rewards (NaN tau) is left out rather than making the mean NaN."""
    stage1 = pipeline.Stage1(torch.arange(24).reshape(2, 12), torch.rand(2, 12, dtype=torch.float64), 2.0)
    explored = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    regenerated = torch.tensor([[4.0, 3.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    out = pipeline.SolRL.diagnostics(None, stage1, explored, regenerated, 0.5)
    assert float(out["solrl/kendall_tau"]) == pytest.approx(4 / 6)  # prompt 0 only: one discordant pair of six
    assert float(out["solrl/spearman_rho"]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    # overlap of the top-2 and bottom-2 sets: prompt 0 keeps both (1.0); prompt 1's ties break by index, which
    # puts its explored top-2 (positions 3, 2) at the bottom (0.0)
    assert float(out["solrl/extreme_overlap"]) == pytest.approx((1.0 + 0.0) / 2)
    assert float(out["solrl/explore_candidates_per_s"]) == 12.0  # 24 candidates in 2 s
    assert float(out["solrl/regenerate_candidates_per_s"]) == 16.0  # 8 kept in 0.5 s
    assert pipeline.nan_mean([0.5, math.nan, 1.0]) == 0.75 and math.isnan(pipeline.nan_mean([math.nan]))


def test_the_random_rule_draws_a_new_selection_every_iteration():
    """``solrl.selection=random`` (the control) must not keep the same candidate positions every iteration."""
    trainer = small_trainer(small_config("solrl.selection=random", "solrl.candidates=16"))
    stage1 = pipeline.Stage1(torch.arange(32).reshape(2, 16), torch.zeros(2, 16, dtype=torch.float64), 1.0)
    picks = []
    for iteration in range(4):
        trainer.iteration = iteration
        picks.append(trainer.solrl.select(stage1, 4))
    trainer.iteration = 0
    assert torch.equal(trainer.solrl.select(stage1, 4), picks[0])  # a function of the seed and the iteration
    assert len({tuple(p.reshape(-1).tolist()) for p in picks}) == 4
