"""One rank of several holds only its own rows of a flat rollout, and they are the one-process rows.

In one process: the one-process iteration is the reference, and each rank's rollout is collected
from the same generator state with that rank's owners. The all-gather of the rewards is answered
from the reference after checking the rank's own part against it bit for bit (the chunks are whole
on one rank, so every model call sees the same rows as on one process). The real multi-process runs
are ``tests/scale/test_launch.py`` and ``tests/scale/test_sharding.py``.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.config import load_config
from flowrl.distributed import derive_geometry
from flowrl.models.sd3 import SD3Adapter
from flowrl.objectives.planning import owned_microbatch, plan_megabytes
from flowrl.policy import build_policy
from flowrl.prompts.batch import sample_groups
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import MultiReward, ink
from flowrl.rollouts.collect import collect_rollouts
from flowrl.rollouts.owned import owned_prompts
from flowrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, CHUNK = 4, 4, 2  # B = 16; chunks of 2 are whole on one rank in both placements


TREE = ["sampler.tree.split_steps=[0,1]"]  # factors 2, 2: trees of 4 leaves
CASES = {  # config file, overrides
    "flow_grpo": (None, ["objective.name=flow_grpo"]),
    "diffusion_nft": (None, ["objective.name=diffusion_nft"]),
    "branch_grpo": ("configs/branch/digits.yaml", TREE),  # a tree, every edge trained
    "awm_tree_leaves": ("configs/awm/digits_fast.yaml", ["sampler.solver=tree", *TREE]),
}


def one_process_trainer(case):
    path, extra = CASES[case]
    overrides = [
        *extra,
        f"prompts.per_iteration={PROMPTS}",
        f"prompts.group_size={GROUP}",
        f"sampler.chunk_size={CHUNK}",
        "sampler.num_steps=3",
        "train.eval_seeds=1",
    ]
    cfg = load_config(None if path is None else ROOT / path, overrides)
    reward = MultiReward({"ink": (ink("prompt"), 1.0), "ink_bold": (ink("bold"), 0.5)})
    prompts = load_prompts("digits-styles")
    model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    return Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])


def mine(full, owned):
    """The rank's rows of a global tensor: of the B rows, or of a tree-major (N * n, ...) tensor (whole trees)."""
    if full.shape[0] == owned.shape[0]:
        return full[owned]
    trees = owned.reshape(PROMPTS, -1)[:, 0]
    return full[trees.repeat_interleave(full.shape[0] // PROMPTS)]


def gather_from(reference, owned):
    """An all-gather answered by the reference, in the order the loop gathers (each reward component,
    the total, then a tree's edge log-probs step by step): the rank's part must be the reference's rows exactly."""
    queue = list(reference)

    def gather_rows(local):
        full = queue.pop(0)
        assert torch.equal(mine(full, owned).to(local.dtype), local), "a rank's part is not the one-process rows"
        return full.to(local.dtype)

    return gather_rows


@pytest.mark.parametrize(
    "case, placement",
    [(c, p) for c in ("flow_grpo", "diffusion_nft") for p in ("contiguous", "spread")]
    + [("branch_grpo", "contiguous"), ("awm_tree_leaves", "contiguous")],
)
def test_a_rank_holds_its_rows_only_and_they_are_the_one_process_rows(case, placement):
    one = one_process_trainer(case)
    ref, info = one.collect()
    after = one.generator.get_state()
    gathered = [*(v for k, v in info.items() if k.startswith("reward/")), ref.rewards]
    if ref.tree is not None:
        gathered += ref.tree.rollout.log_probs
    plan = [mb for group in one.objective.plan(ref, one.generator) for mb in group]
    half, plan_mb = PROMPTS * GROUP // 2, {}
    for rank in (0, 1):
        t = one_process_trainer(case)  # a fresh run: advantage trackers keep state between iterations
        owners = derive_geometry(PROMPTS, GROUP, CHUNK, 2, rank, placement).owners()
        owned = owners == rank
        prompts = sample_groups(t.train_prompts, PROMPTS, GROUP, t.generator)
        ctx = replace(t.rollout_context(), owners=owners, rank=rank, gather_rows=gather_from(gathered, owned))
        cond = t.prompt_cache.encode(owned_prompts(prompts, ctx.owned).texts)
        batch, logged = collect_rollouts(ctx, t.rollout_kind, prompts, cond)
        assert torch.equal(t.generator.get_state(), after)  # the run's draws advanced exactly as on one process

        # the rank holds b = B / 2 rows: the one-process rows, in global order
        assert batch.size == 2 * half and len(batch.prompts) == half
        assert batch.prompts == [p for p, m in zip(ref.prompts, owned) if m]
        assert all(v.shape[0] == half for v in batch.cond.values())
        assert batch.samples.shape[0] == batch.images.shape[0] == half
        assert float(logged["rollout/held_mb"]) == pytest.approx(float(info["rollout/held_mb"]) / 2, rel=1e-6)
        assert torch.equal(batch.samples, ref.samples[owned]) and torch.equal(batch.images, ref.images[owned])
        assert torch.equal(batch.group_ids, ref.group_ids[owned])
        if ref.trajectory is not None:
            assert torch.equal(batch.trajectory.latents, ref.trajectory.latents[owned])
            assert torch.equal(batch.trajectory.log_probs, ref.trajectory.log_probs[owned])
        if ref.tree is not None:  # the rank's whole trees: nodes, edges, advantages, masks; the global plan view
            tb, full = batch.tree, ref.tree
            assert tb.rollout.num_trees == PROMPTS // 2 and batch.global_tree.rollout.num_trees == PROMPTS
            for got, want in [(tb.rollout.nodes, full.rollout.nodes), (tb.rollout.log_probs, full.rollout.log_probs),
                              (tb.advantages, full.advantages), (tb.train, full.train)]:  # fmt: skip
                assert all(torch.equal(g, mine(w, owned)) for g, w in zip(got, want))
            assert all(torch.equal(g, w) for g, w in zip(batch.global_tree.train, full.train))
        for local, full, everyone in [
            (batch.rewards, ref.rewards, batch.global_rewards),
            (batch.advantages, ref.advantages, batch.global_advantages),
            (batch.keep, ref.keep, batch.global_keep),
        ]:
            assert torch.equal(everyone, full) and torch.equal(local, full[owned])

        # the same plan on every rank, with the same draws; it holds only the rank's rows' fresh noise, and a
        # micro-batch's part on the rank's rows has the one-process loss
        ours = [mb for group in t.objective.plan(batch, t.generator) for mb in group]
        assert torch.equal(t.generator.get_state(), one.generator.get_state())
        assert [mb.index.tolist() for mb in ours] == [mb.index.tolist() for mb in plan]
        plan_mb[rank] = plan_megabytes([ours])
        checked = 0
        for mb_rank, mb in zip(ours, plan):
            part = owned_microbatch(mb_rank, batch, owned)
            if part is None:
                continue
            assert torch.equal(part.index, mb.index - int(part.index.numel() and mb.index[0] - part.index[0]))
            if mb.noise is not None:
                assert torch.equal(part.noise, mb.noise[owned[mb.index]])
            with torch.no_grad():
                got, want = t.objective.loss(t.model, batch, part)[0], t.objective.loss(t.model, ref, mb)[0]
            assert torch.equal(got, want)
            checked += 1
        assert checked > 0
    assert sum(plan_mb.values()) == pytest.approx(plan_megabytes([plan]), rel=1e-12)  # the ranks split the noise
    assert (plan_megabytes([plan]) > 0) == (case in ("diffusion_nft", "awm_tree_leaves"))


def test_a_micro_batch_split_between_ranks_gets_the_rank_local_rows():
    from flowrl.objectives.base import Microbatch, RankRows, RolloutBatch

    owned = torch.tensor([True, False, True, False, False, True])  # global rows 0, 2, 5 are this rank's
    x = torch.arange(3.0)[:, None, None, None].expand(3, 2, 2, 2)
    keep = torch.ones(6, dtype=torch.bool)
    rows = RankRows(owned, keep, torch.zeros(6), torch.zeros(6))
    batch = RolloutBatch(["a"] * 3, torch.zeros(3), {}, x, None, None, x, x[:, 0, 0, 0], x[:, 0, 0, 0], keep[:3], 3,
                         rows=rows)  # fmt: skip
    noise = torch.arange(3.0)[:, None, None, None].expand(3, 2, 2, 2) + 10
    mb = Microbatch(torch.tensor([0, 1, 2]), 1, noise[[0, 2]])  # a rank's plan holds its rows' noise (chunk_noise)
    part = owned_microbatch(mb, batch, owned)
    assert part.index.tolist() == [0, 1] and part.step == 1  # global rows 0 and 2 are the rank's rows 0 and 1
    assert part.noise[:, 0, 0, 0].tolist() == [10.0, 12.0]
    global_shaped = batch._replace(rows=None)  # a batch of every row keeps global indices and cuts the noise
    part = owned_microbatch(mb._replace(noise=noise), global_shaped, owned)
    assert part.index.tolist() == [0, 2] and part.noise[:, 0, 0, 0].tolist() == [10.0, 12.0]
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
    noise, none = torch.randn(2, 2, 2, 2), torch.zeros(0, 2, 2, 2)  # the plan holds rank 1's rows' noise only
    group = [Microbatch(torch.tensor([0, 1]), 0, none), Microbatch(torch.tensor([2, 3]), 1, none),
             Microbatch(torch.tensor([6, 7]), 2, noise)]  # fmt: skip
    parts = rank_microbatches(group, batch, owned, geometry)  # rank 0 runs two, so rank 1 pads one
    assert [(i, mb.index.tolist(), mb.step, real) for i, mb, real in parts] == [
        (2, [2, 3], 2, True),
        (0, [0], 0, False),
    ]
    assert parts[0][1].noise is noise
    assert torch.equal(parts[1][1].noise, torch.zeros(1, 2, 2, 2))  # one row, though the rank holds none of group[0]'s


def test_owned_rows_count_each_ranks_calls_once_and_pad_without_counting_nfe() -> None:
    """A call counts once per rank with rows in it; finish() pads to the busiest rank, outside the NFE."""
    from flowrl.policy.counting import CountingAdapter
    from flowrl.rollouts.owned import OwnedRows, row_cond

    model = CountingAdapter(SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)))
    owners = torch.tensor([0, 0, 0, 1])  # rank 1 owns the last row and holds its conditioning only
    cond = model.encode_prompt(["a bold handwritten 1"])
    view = OwnedRows(model, cond, rank=1, world_size=2)
    view.lockstep = True  # as under a sharded denoiser (FSDP2, ZeRO-3), which one process cannot build
    index = row_cond(owners, 1, torch.device("cpu"))
    x = torch.randn(4, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((4,), 0.5)
    v0 = view.velocity(x[:2], sigma[:2], {k: t[:2] for k, t in index.items()})  # rank 0's rows only
    v1 = view.velocity(x[2:], sigma[2:], {k: t[2:] for k, t in index.items()})
    assert view.calls.tolist() == [2, 1] and model.nfe == 1  # rank 1's model ran once, on its one row
    assert torch.equal(v0, torch.zeros_like(v0)) and torch.equal(v1[0], torch.zeros_like(v1[0]))
    torch.testing.assert_close(v1[1:], model.velocity(x[3:], sigma[3:], cond), rtol=0, atol=0)
    model.nfe = 1
    view.finish()
    assert view.placeholders == 1 and model.nfe == 1  # one placeholder call, not counted as an evaluation


def test_the_busiest_rank_makes_no_placeholder_calls() -> None:
    """finish() pads this rank up to the busiest one: a rank that is the busiest itself pads nothing."""
    from flowrl.policy.counting import CountingAdapter
    from flowrl.rollouts.owned import OwnedRows, row_cond

    model = CountingAdapter(SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)))
    owners = torch.tensor([0, 1, 1, 2])  # one-row calls: ranks 0, 1, 2 make 1, 2, 1 calls
    view = OwnedRows(model, model.encode_prompt(["a bold handwritten 1", "a thin handwritten 2"]), 1, 3)
    view.lockstep = True  # as under a sharded denoiser (FSDP2, ZeRO-3), which one process cannot build
    index = row_cond(owners, 1, torch.device("cpu"))
    x = torch.randn(4, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    for i in range(4):
        view.velocity(x[i : i + 1], torch.full((1,), 0.5), {k: t[i : i + 1] for k, t in index.items()})
    view.finish()
    assert view.calls.tolist() == [1, 2, 1] and view.placeholders == 0
