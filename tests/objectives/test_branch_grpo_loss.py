"""BranchGRPO's micro-batch loss against its formula: the weighted sum of the clipped terms of its trained edges."""

import pytest
import torch
from test_branch_grpo import _first_update, _trainer

from flowrl.objectives.planning import chunk_children


@pytest.mark.slow
def test_first_update_loss_is_minus_the_weighted_sum_of_the_edge_advantages():
    """At ratio 1 each edge's clipped term is ``-A_e``: a micro-batch's policy loss is ``-w * sum_e A_e``.

    Pins the sum (not a mean) over the chunk's trained edges, each child's own depth-wise advantage, the
    KL term added with ``kl_beta``, and ``w = n_mb / E`` (the step's loss is the mean over its E edges).
    """
    trainer = _trainer()
    batch, _ = _first_update(trainer)
    gen = torch.Generator().manual_seed(5)  # O(1) advantages that do not cancel within a chunk, as a group's do
    tb = batch.tree._replace(advantages=[torch.randn(a.shape, generator=gen) for a in batch.tree.advantages])
    batch, kl_beta = batch._replace(tree=tb), trainer.objective.kl_beta
    assert kl_beta > 0  # the digits config trains with the KL term
    (group,) = trainer.objective.plan(batch, torch.Generator().manual_seed(0))
    edges = []
    for mb in group:
        children, _ = chunk_children(mb.index, int(tb.rollout.factors[mb.step]), tb.train[mb.step])
        loss, stats = trainer.objective.loss(trainer.model, batch, mb)
        policy = -tb.advantages[mb.step][children].double().sum() * mb.weight
        torch.testing.assert_close(loss.double(), policy + kl_beta * stats["kl"], rtol=1e-5, atol=1e-10)
        assert stats["edges"] == len(children) and stats["clipfrac"] == 0.0 and stats["kl"] > 0
        edges.append(len(children))
    assert all(mb.weight == pytest.approx(len(group) / sum(edges)) for mb in group)
    loss, stats = trainer.objective.loss(trainer.model, batch, group[0])
    twice, stats2 = trainer.objective.loss(trainer.model, batch, group[0]._replace(weight=2 * group[0].weight))
    assert stats2["kl"] == pytest.approx(2 * stats["kl"], rel=1e-6)  # the KL term carries the weight too
    torch.testing.assert_close(twice.double(), 2 * loss.double(), rtol=1e-6, atol=0)


def test_ratio_norm_divides_each_edge_term_by_its_step_length():
    """With ``objective.ratio_norm`` (GRPO-Guard's RatioNorm) the first update's loss is ``-w * sum_e A_e / dt``,
    ``dt = sigma_t - sigma_{t+1}`` of the micro-batch's step; without it, ``-w * sum_e A_e``."""
    small = ["sampler.num_steps=4", "sampler.tree.split_steps=[0,1]", "prompts.group_size=4", "objective.kl_beta=0"]
    for norm in (False, True):
        trainer = _trainer(*small, f"objective.ratio_norm={str(norm).lower()}")
        batch, _ = trainer.collect()
        gen = torch.Generator().manual_seed(5)
        tb = batch.tree._replace(advantages=[torch.randn(a.shape, generator=gen) for a in batch.tree.advantages])
        batch, sigmas = batch._replace(tree=tb), tb.rollout.sigmas
        (group,) = trainer.objective.plan(batch, torch.Generator().manual_seed(0))
        assert {mb.step for mb in group} == {0, 1, 2, 3}
        for mb in group:
            children, _ = chunk_children(mb.index, int(tb.rollout.factors[mb.step]), tb.train[mb.step])
            loss, stats = trainer.objective.loss(trainer.model, batch, mb)
            dt = float(sigmas[mb.step] - sigmas[mb.step + 1]) if norm else 1.0
            expected = -tb.advantages[mb.step][children].double().sum() * mb.weight / dt
            torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-9)
            assert stats["ratio"] == pytest.approx(1.0, abs=1e-6)
