"""``memory.compile``: torch.compile of the denoiser on a tiny real SD3 pipeline (close to eager, ratio 1 kept)."""

import pytest
import torch

from flowrl.config import load_config
from flowrl.config_files import ConfigError
from flowrl.policy import build_policy
from flowrl.policy.memory import compile_denoiser
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.trainer import Trainer

FAST = ["prompts.per_iteration=2", "prompts.group_size=3", "sampler.num_steps=3", "sampler.chunk_size=3"]


def test_compile_is_off_by_default_and_an_unknown_mode_is_named():
    assert load_config(None).memory.compile == "none"
    with pytest.raises(ConfigError, match="memory.compile"):
        load_config(None, ["memory.compile=fastest"])
    with pytest.raises(ValueError, match="memory.compile must be one of"):
        compile_denoiser(torch.nn.Linear(2, 2), "fastest")


def test_compile_none_leaves_the_module_eager():
    module = torch.nn.Linear(2, 2)
    compile_denoiser(module, "none")
    assert module._compiled_call_impl is None


class _SquareSum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * x).sum(-1)


@pytest.mark.slow
def test_more_graphs_than_torchs_default_limit_stay_compiled():
    """A run meets more than torch's 8 graphs per function (grad modes x adapters x shapes): none runs eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = _SquareSum()
    compile_denoiser(module, "default")
    variants = [(dt, grad, nd) for dt in (torch.float32, torch.float64) for grad in (False, True) for nd in (1, 2, 3)]
    for dtype, grad, ndim in variants:  # 12 distinct graphs: dtype, grad mode and rank are guarded
        x = torch.ones((2,) * ndim, dtype=dtype, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            assert torch.equal(module(x).detach(), torch.full((2,) * (ndim - 1), 2.0, dtype=dtype))
    assert counters["stats"]["unique_graphs"] == len(variants)


@pytest.mark.slow
def test_compiled_denoiser_matches_eager_and_keeps_the_first_ratio_one(tiny_sd3):
    torch._dynamo.reset()
    cfg = load_config(None, FAST + ["memory.compile=default", "objective.kl_beta=0.01"])
    policy = build_policy(cfg, model=tiny_sd3, trainable=True)
    transformer = policy.model.transformer
    assert transformer._compiled_call_impl is not None  # the same module object, compiled in place
    x = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = policy.model.encode_prompt(["a bold handwritten 1"] * 3)
    sigma = torch.full((3,), 0.6)
    with torch.no_grad():
        compiled = policy.model.velocity(x, sigma, cond)
        transformer._compiled_call_impl = None
        eager = policy.model.velocity(x, sigma, cond)
        compile_denoiser(transformer, "default")
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)  # last-bit differences only
    prompts = load_prompts("digits-styles")
    trainer = Trainer(cfg, policy, build_multi_reward(cfg.rewards), prompts, prompts[:2])
    batch, _ = trainer.collect()
    stats = trainer.update(batch)
    assert stats["first_ratio"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
