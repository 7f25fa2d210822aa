"""An SDE objective whose rollouts have no stochastic step is refused (noise level 0) or warned about (CPS)."""

import pytest

from flowrl.config import ConfigError, load_config
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.trainer import Trainer

FAST = ["prompts.per_iteration=2", "prompts.group_size=2", "sampler.num_steps=3", "train.eval_seeds=1"]


@pytest.mark.parametrize("objective", ["flow_grpo", "sage_grpo", "branch_grpo"])
def test_noise_level_zero_is_refused_for_sde_objectives(objective):
    with pytest.raises(ConfigError, match="'sampler.noise_level' is 0: objective.name=" + objective):
        load_config(None, [*FAST, f"objective.name={objective}", "sampler.noise_level=0"])


def test_noise_level_zero_passes_for_solver_objectives():
    load_config(None, [*FAST, "objective.name=diffusion_nft", "sampler.noise_level=0"])


def test_an_iteration_without_a_stochastic_step_says_so(tiny_sd3, capsys):
    """CPS's one step goes to sigma 0 and has no density: the plan is empty, the run says it trains nothing."""
    cfg = load_config(None, [*FAST, "sampler.num_steps=1", "sampler.sde=cps"])
    prompts = load_prompts("digits-styles")
    policy = build_policy(cfg, model=tiny_sd3, trainable=True)
    trainer = Trainer(cfg, policy, build_multi_reward(cfg.rewards), prompts, prompts[:2])
    before = [p.clone() for p in trainer.params]
    trainer.train_step()
    err = capsys.readouterr().err
    assert "iteration 1: flow_grpo planned no optimizer step" in err, err
    assert all((p == q).all() for p, q in zip(trainer.params, before))
