"""An optimizer step's update does not depend on ``sampler.chunk_size``: micro-batches weigh by their kept rows.

The loop divides each micro-batch's loss by the step's micro-batch count; a chunk of the batch's tail
(chunk size not dividing the batch) or one holding a dropped row must not weigh as much as a full one.
"""

import pytest
import torch

from flowrl.objectives import AWM, DiffusionNFT, FlowGRPO, Microbatch, RolloutBatch, SageGRPO
from flowrl.objectives.base import chunk_indices
from flowrl.objectives.planning import weigh_by_kept
from flowrl.policy.lora import add_lora
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels

B = 6
KEEP = torch.tensor([False, True, True, True, True, True])  # row 0: no applicable reward


@pytest.fixture
def setup(tiny_sd3):
    add_lora(tiny_sd3.transformer, rank=4, alpha=4, targets=tiny_sd3.lora_target_modules)
    for name, p in tiny_sd3.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    prompts = [f"a handwritten {d}" for d in range(2) for _ in range(3)]
    cond = tiny_sd3.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, *tiny_sd3.latent_shape(8, 8), generator=gen)
    traj = chunked_rollout(tiny_sd3, cond, x, linear_sigmas(3), sde_noise_levels(3, 0.7), chunk_size=B, generator=gen)
    adv = torch.where(KEEP, torch.randn(B, generator=gen), 0.0)
    ids = torch.arange(2).repeat_interleave(3)
    final = traj.latents[:, -1]
    batch = RolloutBatch(prompts, ids, cond, final, traj, traj.sigmas, final, adv, adv, KEEP, B)
    return tiny_sd3, batch


def _gradient(model, objective, batch, group):
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    objective.prepare(model, batch, group)
    for mb in group:
        loss, _ = objective.loss(model, batch, mb)
        (loss / len(group)).backward()  # flowrl/trainer.py: Trainer._accumulate
    return torch.cat([p.grad.flatten() for p in params])


def _rechunk(group, chunk):
    """The whole-batch micro-batches cut into ``chunk`` rows with the same noise, as a plan with that chunk size."""
    parts = []
    for mb in group:
        for idx in chunk_indices(len(mb.index), chunk):
            if KEEP[mb.index[idx]].any():
                parts.append(Microbatch(mb.index[idx], mb.step, None if mb.noise is None else mb.noise[idx]))
    return weigh_by_kept([parts], KEEP)[0]


@pytest.mark.parametrize("make", [lambda: FlowGRPO(clip_range=10.0, kl_beta=0.1), lambda: SageGRPO(clip_range=10.0)])
def test_sde_objectives_update_alike_for_every_chunk_size(setup, make):
    model, batch = setup
    objective = make()
    objective.setup(model)
    whole = _gradient(model, objective, batch, objective.plan(batch, torch.Generator().manual_seed(1))[0])
    for chunk in (1, 2, 4):  # 4: the tail chunk holds 2 rows; 2: the first chunk holds the dropped row
        small = batch._replace(chunk_size=chunk)
        (group,) = objective.plan(small, torch.Generator().manual_seed(1))
        torch.testing.assert_close(_gradient(model, objective, small, group), whole, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DiffusionNFT(kl_beta=0.0),
        lambda: AWM(kl_beta=0.0, ema_beta=0.0),
        lambda: DiffusionNFT(kl_beta=0.5),  # the velocity penalties average over kept rows too
        lambda: AWM(kl_beta=0.3, ema_beta=1.0),
    ],
)
def test_forward_objectives_update_alike_for_every_chunk_size(setup, make):
    model, batch = setup
    objective = make()
    objective.setup(model)
    (group,) = objective.plan(batch, torch.Generator().manual_seed(1))
    whole = _gradient(model, objective, batch, group)
    for chunk in (1, 2, 4):
        parts = _rechunk(group, chunk)
        torch.testing.assert_close(_gradient(model, objective, batch, parts), whole, rtol=1e-4, atol=1e-7)


def test_weights_make_the_step_a_mean_over_kept_rows():
    group = [Microbatch(torch.tensor([0, 1, 2, 3]), 0), Microbatch(torch.tensor([4, 5]), 0)]
    (weighed,) = weigh_by_kept([group], KEEP)
    assert [mb.weight for mb in weighed] == [2 * 3 / 5, 2 * 2 / 5]  # n_mb * kept_mb / kept_step


def test_the_velocity_penalty_is_the_mean_over_kept_rows(tiny_sd3):
    from flowrl.objectives.base import velocity_penalty

    gen = torch.Generator().manual_seed(0)
    v_theta, v_other = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    args = (tiny_sd3, None, None, None, v_theta, None)
    squared = (v_theta.double() - v_other.double()) ** 2
    kept = velocity_penalty(*args, v_other=v_other, keep=torch.tensor([True, False, True]))
    torch.testing.assert_close(kept, squared[[0, 2]].mean(), rtol=1e-15, atol=0)
    every = velocity_penalty(*args, v_other=v_other, keep=torch.ones(3, dtype=torch.bool))
    assert torch.equal(every, squared.mean()) and torch.equal(velocity_penalty(*args, v_other=v_other), every)
    none = velocity_penalty(*args, v_other=v_other, keep=torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0.0  # no kept row: no penalty (not 0 / 0)


def test_split_even_gives_consecutive_near_equal_groups_and_no_empty_one():
    """The optimizer steps of an iteration: consecutive groups whose sizes differ by at most one, the larger ones
    where ``round`` puts them, and never an empty group when there are fewer items than parts."""
    from flowrl.objectives.base import split_even

    assert split_even(list(range(7)), 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert split_even(list(range(6)), 4) == [[0, 1], [2], [3], [4, 5]]
    assert split_even([1, 2], 5) == [[1], [2]] and split_even([1, 2, 3], 0) == [[1, 2, 3]]
    for n in range(1, 12):
        for parts in range(1, 14):
            groups = split_even(list(range(n)), parts)
            sizes = [len(g) for g in groups]
            assert sum(groups, []) == list(range(n)) and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
