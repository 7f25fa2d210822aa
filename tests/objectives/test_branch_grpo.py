"""BranchGRPO on the embedded model: ratio exactly 1, pruning cuts only the backward pass, runs end to end."""

import json
import math
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError, load_config
from flowrl.models import load_adapter
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import Run, build_reward
from flowrl.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
SMALL = ["prompts.per_iteration=1", "sampler.chunk_size=8", "train.progress=false"]


def _trainer(*overrides: str) -> Trainer:
    cfg = load_config(REPO / "configs/branch/digits.yaml", SMALL + list(overrides))
    torch.manual_seed(0)
    return Trainer(
        cfg,
        build_policy(cfg, model=load_adapter(cfg.model.path), trainable=True),
        build_reward(cfg),
        load_prompts(cfg.prompts.train),
        load_prompts(cfg.prompts.eval),
    )


def _perturb_lora(trainer: Trainer) -> None:
    """A non-zero LoRA so the policy differs from the base model (the KL term is live)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _first_update(trainer):
    """A rollout after a LoRA perturbation and the loss stats of its first optimizer step's micro-batches."""
    _perturb_lora(trainer)
    batch, _ = trainer.collect()
    plan = trainer.objective.plan(batch, torch.Generator().manual_seed(0))
    return batch, [trainer.objective.loss(trainer.model, batch, mb)[1] for mb in plan[0]]


def test_ratio_is_exactly_one_on_the_first_update():
    trainer = _trainer()
    batch, stats = _first_update(trainer)
    assert all(s["ratio"] == 1.0 and s["approx_kl"] == 0.0 for s in stats), stats
    edges = sum(int(s["edges"]) for s in stats)
    assert edges == 58  # every edge of the tree trained exactly once
    assert len(batch.samples) == 16 and batch.tree.rollout.leaves.shape[0] == 16


def test_ratio_is_exactly_one_on_the_first_update_with_width_pruning():
    """A partly pruned frontier chunk still runs the model on the rollout's rows (fewer rows round differently)."""
    trainer = _trainer(
        "sampler.tree.split_steps=[0,2,4,6]",
        "sampler.tree.width_keep=0.5",
        "sampler.chunk_size=5",
        "objective.kl_beta=0",
    )
    batch, stats = _first_update(trainer)
    assert all(s["ratio"] == 1.0 for s in stats), stats
    edges = sum(int(s["edges"]) for s in stats)
    assert edges == sum(int(m.sum()) for m in batch.tree.train) < sum(m.numel() for m in batch.tree.train)
    # each optimizer step's n micro-batches weigh n / E, so the loop's 1 / n leaves every trained edge 1 / E
    from flowrl.objectives.planning import chunk_children

    tree = batch.tree
    for group in trainer.objective.plan(batch, torch.Generator().manual_seed(0)):
        counts = [
            len(chunk_children(mb.index, int(tree.rollout.factors[mb.step]), tree.train[mb.step])[0]) for mb in group
        ]
        assert sum(mb.weight * c for mb, c in zip(group, counts)) == pytest.approx(len(group))
        assert all(mb.weight == pytest.approx(len(group) / sum(counts)) for mb in group)


def test_group_size_must_equal_the_leaves():
    with pytest.raises(ConfigError, match="prompts.group_size=16"):
        _trainer("prompts.group_size=8")


def _total_loss(trainer, batch, plan, adv=None):
    tb = batch.tree
    if adv is not None:
        batch = batch._replace(tree=tb._replace(advantages=adv))
    trainer.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in plan[0]:
        loss, _ = trainer.objective.loss(trainer.model, batch, mb)
        (loss / len(plan[0])).backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in trainer.params]


@pytest.mark.parametrize("width_mode", ["best_worst", "per_branch"])
def test_pruned_edges_get_no_gradient_and_leave_rollouts_and_rewards_unchanged(width_mode):
    prune = [
        "sampler.tree.depth_prune=[2,3]",
        "sampler.tree.width_keep=0.5",
        "sampler.tree.split_steps=[0,2,4,6]",
        f"sampler.tree.width_mode={width_mode}",
    ]
    full, pruned = _trainer("sampler.tree.split_steps=[0,2,4,6]"), _trainer(*prune)
    a, _ = full.collect()
    b, _ = pruned.collect()
    for x, y in zip(a.tree.rollout.nodes, b.tree.rollout.nodes):  # forward pass unchanged
        assert torch.equal(x, y)
    for x, y in zip(a.tree.rollout.log_probs, b.tree.rollout.log_probs):
        assert torch.equal(x, y)
    assert torch.equal(a.rewards, b.rewards)
    for x, y in zip(a.tree.advantages, b.tree.advantages):
        assert torch.equal(x, y)
    masks = b.tree.train
    assert all(m.all() for m in a.tree.train)
    assert not masks[1].any() and not masks[2].any()  # child depths 2 and 3
    assert 0 < int(torch.cat(masks[7:]).sum()) < torch.cat(masks[7:]).numel()  # width pruning after the last split (6)
    plan = pruned.objective.plan(b, torch.Generator().manual_seed(0))
    assert sum(len(g) for g in plan) > 0
    adv = [x.clone().requires_grad_(True) for x in b.tree.advantages]
    _total_loss(pruned, b, plan, adv)
    for t, (g, m) in enumerate(zip(adv, masks)):
        grad = torch.zeros_like(g) if g.grad is None else g.grad
        assert torch.equal(grad[~m], torch.zeros_like(grad[~m])), t  # pruned edges: no gradient
        assert (grad[m] != 0).all(), t  # every trained edge: a gradient
    # changing what pruned edges would teach changes nothing
    wild = [torch.where(m, x, torch.full_like(x, 5.0)) for x, m in zip(b.tree.advantages, masks)]
    loss1, grads1 = _total_loss(pruned, b, plan)
    loss2, grads2 = _total_loss(pruned, b, plan, wild)
    assert loss1 == loss2 and all(torch.equal(x, y) for x, y in zip(grads1, grads2))


def _two_iterations(config: str, tmp_path, *extra: str) -> list[dict]:
    small = [
        "prompts.per_iteration=2",
        "sampler.chunk_size=8",
        "train.iterations=2",
        "train.eval_every=2",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
        "train.progress=false",
        f"output.dir={tmp_path / 'run'}",
    ]
    cfg = load_config(REPO / config, small + list(extra))
    summary = Run(cfg).execute()
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 2 and (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    return trained


@pytest.mark.slow
def test_branch_grpo_two_iterations_end_to_end(tmp_path):
    rows = _two_iterations("configs/branch/digits.yaml", tmp_path)
    assert rows[0]["train/first_ratio"] == 1.0
    assert rows[0]["tree/trained_edges"] == 2 * 58
    assert rows[0]["nfe"] == 2 * 43 + 2 * 2 * 43  # rollout: 43 per tree; training: policy + KL reference per parent


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/nft/digits.yaml", "configs/awm/digits.yaml"])
def test_solver_objectives_train_on_tree_leaves(config, tmp_path):
    rows = _two_iterations(
        config, tmp_path, "sampler.solver=tree", "prompts.group_size=16", "sampler.tree.split_noise_scale=1.0"
    )
    assert rows[0]["nfe"] > 2 * 43  # rollout of 2 trees + the objective's training passes


def test_every_shipped_tree_config_has_a_consistent_tree():
    from flowrl.tree.rollouts import tree_spec

    found = 0
    for path in sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate"):
        cfg = load_config(path)
        if cfg.objective["name"] == "branch_grpo" or cfg.sampler.solver == "tree":
            tree_spec(cfg)  # group size = leaves, valid splits
            found += 1
    assert found >= 3


def test_tree_leaves_scored_in_a_process_match_inline_scoring():
    """BranchGRPO with train.rewards_async=process: the leaves' pieces are shared by the trainer and the worker."""
    inline = _trainer("train.score_chunk_size=4")
    proc = _trainer("train.score_chunk_size=4", "train.rewards_async=process")
    try:
        a, info_a = inline.collect()
        b, info_b = proc.collect()
        assert torch.equal(a.rewards, b.rewards) and torch.equal(a.images, b.images)
        assert all(torch.equal(x, y) for x, y in zip(a.tree.advantages, b.tree.advantages))
        assert inline.update(a) == proc.update(b)
    finally:
        proc.close()


def test_mixed_ode_sde_tree_trains_only_window_and_split_edges():
    """sampler.window on a tree: SDE inside the window and at splits, Euler ODE elsewhere (not trained)."""
    trainer = _trainer("sampler.window=fixed", "sampler.window_start=4", "sampler.window_size=2")
    batch, _ = trainer.collect()
    levels = batch.tree.rollout.noise_levels
    sde_steps = [t for t in range(len(levels)) if float(levels[t]) > 0]
    assert sde_steps == [0, 3, 4, 5, 6, 9]  # splits 0, 3, 6, 9 and the window 4..5
    for t, mask in enumerate(batch.tree.train):
        assert bool(mask.any()) == (t in sde_steps)
        if t not in sde_steps:
            assert torch.equal(batch.tree.rollout.log_probs[t], torch.zeros_like(batch.tree.rollout.log_probs[t]))
    stats = trainer.update(batch)
    assert stats["first_ratio"] == 1.0 and all(math.isfinite(v) for v in stats.values())


def test_an_overflowing_leaf_reward_is_skipped_by_the_update_guard():
    """A weighted total that overflows to inf: the guard skips the tree iteration (as for flat rollouts), no crash."""
    from flowrl.rewards.combine import MultiReward
    from flowrl.tree.rollouts import edge_advantages

    trainer = _trainer("sampler.num_steps=3", "sampler.tree.split_steps=[0]", "prompts.group_size=2")

    def huge(images, prompts, **_):
        return torch.full((images.shape[0],), 3e38)

    trainer.reward = MultiReward({"a": (huge, 1.0), "b": (huge, 1.0)})  # 6e38 > float32 max: total inf
    before = [p.detach().clone() for p in trainer.params]
    assert trainer.train_step()["train/skipped_updates"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before))
    batch, _ = trainer.collect()
    tb = edge_advantages(
        batch.tree.rollout,
        torch.tensor([1.0, float("inf")]),
        batch.tree.cond,
        trainer.tree,
        trainer.cfg.sampler.tree,
        clip=5.0,
        iteration=0,
        chunk_size=8,
    )
    assert all(bool(a.isnan().all()) for a in tb.advantages)


def test_width_pruning_with_the_last_split_on_the_last_step_is_refused():
    """The last segment is empty there: width_keep would prune nothing, silently."""
    with pytest.raises(ConfigError, match=r"sampler.tree.width_keep=0.5 .*\(step 9\) is the last"):
        _trainer("sampler.tree.width_keep=0.5")
    from flowrl.tree.rollouts import tree_spec

    assert tree_spec(
        load_config(REPO / "configs/branch/digits.yaml", ["sampler.tree.width_keep=0.5", "sampler.num_steps=12"])
    )


def test_an_advantage_method_other_than_the_sum_is_refused_on_tree_edges():
    """Depth-wise advantages replace the advantage estimator: advantage.method=per_prompt would be ignored."""
    with pytest.raises(ConfigError, match="advantage.method=per_prompt does not apply to tree edges"):
        _trainer("sampler.tree.split_steps=[]", "prompts.group_size=1", "advantage.method=per_prompt")


@pytest.mark.parametrize("depths", ["[0,1]", "[15,16]"])
def test_a_depth_prune_outside_the_child_depths_is_refused(depths):
    """Child depths run 1..T; depth 0 or a depth past T (without a slide) pruned nothing, silently."""
    with pytest.raises(ConfigError, match=r"sampler.tree.depth_prune \[(0|15, 16)\] are not child depths"):
        _trainer(f"sampler.tree.depth_prune={depths}")
    from flowrl.tree.rollouts import tree_spec

    slide = ["sampler.tree.depth_prune=[15,16]", "sampler.tree.depth_prune_slide_every=2"]
    assert tree_spec(load_config(REPO / "configs/branch/digits.yaml", slide))  # a slide brings them in


def test_pruning_options_carry_every_tree_pruning_key():
    """Each ``sampler.tree`` pruning key reaches :func:`train_masks` under its keyword (none left at its default)."""
    from flowrl.tree.rollouts import pruning_options

    keys = [
        "sampler.tree.depth_prune=[5]",
        "sampler.tree.depth_prune_slide_every=2",
        "sampler.tree.depth_prune_stop=3",
        "sampler.tree.width_keep=0.5",
        "sampler.tree.width_mode=per_branch",
        "sampler.tree.prune_until=7",
        "sampler.num_steps=12",
    ]
    options = pruning_options(load_config(REPO / "configs/branch/digits.yaml", keys).sampler.tree)
    assert options == {
        "depth_prune": [5],
        "slide_every": 2,
        "stop_depth": 3,
        "width_keep": 0.5,
        "width_mode": "per_branch",
        "prune_until": 7,
    }


def test_a_tree_without_noise_is_refused():
    """Solver objectives on tree leaves may load with sampler.noise_level=0; the tree geometry refuses it."""
    from flowrl.tree.rollouts import tree_spec

    cfg = load_config(
        REPO / "configs/nft/digits.yaml", ["sampler.solver=tree", "prompts.group_size=16", "sampler.noise_level=0"]
    )
    with pytest.raises(ConfigError, match="sampler.noise_level must be > 0 for tree rollouts"):
        tree_spec(cfg)


def test_a_cps_tree_step_to_sigma_zero_is_not_trained():
    """CPS's last step (to sigma 0) has noise level 0.5 but std 0: no density, so none of its edges is trained.

    Pins ``has_density`` in ``edge_advantages``: with the noise levels alone that step's edges were masked in.
    """
    trainer = _trainer(
        "sampler.sde=cps",
        "sampler.noise_level=0.5",
        "sampler.num_steps=4",
        "sampler.tree.split_steps=[0,1]",
        "prompts.group_size=4",
    )
    batch, _ = trainer.collect()
    assert batch.tree.rollout.noise_levels.tolist() == [0.5] * 4 and float(batch.tree.rollout.sigmas[-1]) == 0.0
    assert [bool(m.any()) for m in batch.tree.train] == [True, True, True, False]
    stats = trainer.update(batch)
    assert stats["first_ratio"] == 1.0 and all(math.isfinite(v) for v in stats.values())


def test_the_configured_split_noise_scale_reaches_the_trees() -> None:
    """sampler.tree.split_noise_scale (4 in the digits config) scales the split steps' noise, 1 elsewhere."""
    trainer = _trainer()
    splits = set(trainer.cfg.sampler.tree.split_steps)
    batch, _ = trainer.collect()
    scales = batch.tree.rollout.noise_scales.tolist()
    assert scales == [4.0 if t in splits else 1.0 for t in range(len(scales))] and splits


def test_zero_std_groups_counts_the_trees_whose_every_leaf_advantage_is_zero() -> None:
    """A tree of tied leaves counts; a tree where only the leaves at its mean reward have advantage 0 does not."""
    from flowrl.rewards.combine import MultiReward

    trainer = _trainer(
        "sampler.num_steps=3", "sampler.tree.split_steps=[0, 1]", "prompts.group_size=4", "prompts.per_iteration=2"
    )

    def tied(images: torch.Tensor, prompts: list[str], **_: object) -> torch.Tensor:
        assert images.shape[0] == 8  # both trees' 4 leaves in one scored chunk
        return torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 2.0])  # tree 0 tied; tree 1 mean 1

    trainer.reward = MultiReward({"tied": (tied, 1.0)})
    batch, info = trainer.collect()
    assert batch.tree.advantages[-1].eq(0).tolist() == [True] * 4 + [False, True, True, False]
    assert float(info["zero_std_groups"]) == 1.0
