"""SDE sampler keys a solver objective's rollouts would ignore are refused, not silently dropped."""

import pytest

from flowrl.config import ConfigError, load_config

SMALL = ["prompts.per_iteration=2", "prompts.group_size=2", "sampler.num_steps=3"]


@pytest.mark.parametrize("objective", ["diffusion_nft", "awm"])
@pytest.mark.parametrize(
    "keys,message",
    [
        (["sampler.window=fixed", "sampler.window_size=1"], "'sampler.window' .fixed. applies to SDE and tree"),
        (["sampler.sde=dance"], "'sampler.sde' .dance. applies to SDE and tree"),
    ],
)
def test_sde_keys_of_solver_rollouts_are_refused(objective, keys, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*SMALL, f"objective.name={objective}", *keys])


@pytest.mark.parametrize(
    "keys",
    [
        ["objective.name=flow_grpo", "sampler.window=fixed", "sampler.window_size=1", "sampler.sde=dance"],
        ["objective.name=diffusion_nft", "sampler.solver=tree", "sampler.tree.split_steps=[0]", "sampler.sde=dance"],
        ["objective.name=awm", "sampler.solver=sde_window", "sampler.sde_window=[0.2,0.8]"],
    ],
)
def test_sde_keys_where_the_rollouts_use_them_pass(keys):
    load_config(None, [*SMALL, *keys])
