"""One rank of several holds only its own rows of a flat rollout, and they are the one-process rows.

In one process: the one-process iteration is the reference, and each rank's rollout is collected
from the same generator state with that rank's owners. The all-gather of the rewards is answered
from the reference after checking the rank's own part against it bit for bit (the chunks are whole
on one rank, so every model call sees the same rows as on one process). The real multi-process runs
are ``tests/scale/test_launch.py`` and ``tests/scale/test_sharding.py``.
"""

from dataclasses import replace

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.config import load_config
from flowrl.distributed import derive_geometry
from flowrl.models.sd3 import SD3Adapter
from flowrl.objectives.planning import owned_microbatch
from flowrl.policy import build_policy
from flowrl.prompts.batch import sample_groups
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import MultiReward, ink
from flowrl.rollouts.collect import collect_rollouts
from flowrl.rollouts.owned import owned_prompts
from flowrl.trainer import Trainer

PROMPTS, GROUP, CHUNK = 4, 4, 2  # B = 16; chunks of 2 are whole on one rank in both placements


def one_process_trainer(objective):
    overrides = [
        f"objective.name={objective}",
        f"prompts.per_iteration={PROMPTS}",
        f"prompts.group_size={GROUP}",
        f"sampler.chunk_size={CHUNK}",
        "sampler.num_steps=3",
        "train.eval_seeds=1",
    ]
    cfg = load_config(None, overrides)
    reward = MultiReward({"ink": (ink("prompt"), 1.0), "ink_bold": (ink("bold"), 0.5)})
    prompts = load_prompts("digits-styles")
    model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    return Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])


def gather_from(reference, owned):
    """An all-gather answered by the reference, in the order the rewards are gathered (each component,
    then the total): the rank's part must be the reference's rows exactly."""
    queue = list(reference)

    def gather_rows(local):
        full = queue.pop(0)
        assert torch.equal(full[owned].to(local.dtype), local), "a rank's rewards are not the one-process rewards"
        return full.to(local.dtype)

    return gather_rows


@pytest.mark.parametrize("placement", ["contiguous", "spread"])
@pytest.mark.parametrize("objective", ["flow_grpo", "diffusion_nft"])
def test_a_rank_holds_its_rows_only_and_they_are_the_one_process_rows(objective, placement):
    one = one_process_trainer(objective)
    ref, info = one.collect()
    after = one.generator.get_state()
    rewards = [*(v for k, v in info.items() if k.startswith("reward/")), ref.rewards]
    plan = [mb for group in one.objective.plan(ref, one.generator) for mb in group]
    half = PROMPTS * GROUP // 2
    for rank in (0, 1):
        t = one_process_trainer(objective)  # a fresh run: advantage trackers keep state between iterations
        owners = derive_geometry(PROMPTS, GROUP, CHUNK, 2, rank, placement).owners()
        owned = owners == rank
        prompts = sample_groups(t.train_prompts, PROMPTS, GROUP, t.generator)
        ctx = replace(t.rollout_context(), owners=owners, rank=rank, gather_rows=gather_from(rewards, owned))
        cond = t.prompt_cache.encode(owned_prompts(prompts, ctx.held).texts)
        batch, logged = collect_rollouts(ctx, t.rollout_kind, prompts, cond)
        assert torch.equal(t.generator.get_state(), after)  # the run's draws advanced exactly as on one process

        # the rank holds b = B / 2 rows: the one-process rows, in global order
        assert batch.size == 2 * half and len(batch.prompts) == half
        assert batch.prompts == [p for p, mine in zip(ref.prompts, owned) if mine]
        assert all(v.shape[0] == half for v in batch.cond.values())
        assert batch.samples.shape[0] == batch.images.shape[0] == half
        assert float(logged["rollout/held_mb"]) == pytest.approx(float(info["rollout/held_mb"]) / 2, rel=1e-6)
        assert torch.equal(batch.samples, ref.samples[owned]) and torch.equal(batch.images, ref.images[owned])
        assert torch.equal(batch.group_ids, ref.group_ids[owned])
        if ref.trajectory is not None:
            assert torch.equal(batch.trajectory.latents, ref.trajectory.latents[owned])
            assert torch.equal(batch.trajectory.log_probs, ref.trajectory.log_probs[owned])
        for mine, full, everyone in [
            (batch.rewards, ref.rewards, batch.global_rewards),
            (batch.advantages, ref.advantages, batch.global_advantages),
            (batch.keep, ref.keep, batch.global_keep),
        ]:
            assert torch.equal(everyone, full) and torch.equal(mine, full[owned])

        # the same plan on every rank; a micro-batch's part on the rank's rows has the one-process loss
        assert [mb.index.tolist() for group in t.objective.plan(batch, t.generator) for mb in group] == [
            mb.index.tolist() for mb in plan
        ]
        for mb in plan[:4]:
            part = owned_microbatch(mb, batch, owned)
            if not bool(owned[mb.index].all()):
                assert part is None  # chunks are whole on one rank
                continue
            assert part.index.max() < half and torch.equal(owned.nonzero().squeeze(1)[part.index], mb.index)
            with torch.no_grad():
                torch.testing.assert_close(
                    t.objective.loss(t.model, batch, part)[0], t.objective.loss(t.model, ref, mb)[0], rtol=0, atol=0
                )


def test_a_micro_batch_split_between_ranks_gets_the_rank_local_rows():
    from flowrl.objectives.base import Microbatch, RankRows, RolloutBatch

    owned = torch.tensor([True, False, True, False, False, True])  # global rows 0, 2, 5 are this rank's
    x = torch.arange(3.0)[:, None, None, None].expand(3, 2, 2, 2)
    keep = torch.ones(6, dtype=torch.bool)
    rows = RankRows(owned, keep, torch.zeros(6), torch.zeros(6))
    batch = RolloutBatch(["a"] * 3, torch.zeros(3), {}, x, None, None, x, x[:, 0, 0, 0], x[:, 0, 0, 0], keep[:3], 3,
                         rows=rows)  # fmt: skip
    noise = torch.arange(3.0)[:, None, None, None].expand(3, 2, 2, 2) + 10
    mb = Microbatch(torch.tensor([0, 1, 2]), 1, noise)
    part = owned_microbatch(mb, batch, owned)
    assert part.index.tolist() == [0, 1] and part.step == 1  # global rows 0 and 2 are the rank's rows 0 and 1
    assert part.noise[:, 0, 0, 0].tolist() == [10.0, 12.0]
    assert owned_microbatch(Microbatch(torch.tensor([5]), 0, noise[:1]), batch, owned).index.tolist() == [2]
    assert owned_microbatch(Microbatch(torch.tensor([1, 3]), 0, noise[:2]), batch, owned) is None


def test_sharded_placeholders_use_a_row_the_rank_holds():
    from flowrl.objectives.base import Microbatch, RankRows, RolloutBatch
    from flowrl.sharding import rank_microbatches

    geometry = derive_geometry(4, 2, 2, 2, 1)  # B = 8: rank 1 holds global rows 4-7 as its rows 0-3
    owned = geometry.owned_mask()
    x, keep = torch.zeros(4, 2, 2, 2), torch.ones(8, dtype=torch.bool)
    batch = RolloutBatch(["a"] * 4, torch.zeros(4), {}, x, None, None, x, x[:, 0, 0, 0], x[:, 0, 0, 0], keep[:4], 2,
                         rows=RankRows(owned, keep, torch.zeros(8), torch.zeros(8)))  # fmt: skip
    noise = torch.randn(2, 2, 2, 2)
    group = [Microbatch(torch.tensor([0, 1]), 0, noise), Microbatch(torch.tensor([2, 3]), 1, noise),
             Microbatch(torch.tensor([6, 7]), 2, noise)]  # fmt: skip
    parts = rank_microbatches(group, batch, owned, geometry)  # rank 0 runs two, so rank 1 pads one
    assert [(i, mb.index.tolist(), mb.step, real) for i, mb, real in parts] == [
        (2, [2, 3], 2, True),
        (0, [0], 0, False),
    ]
