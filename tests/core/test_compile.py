"""``memory.compile``: torch.compile of the denoiser on a tiny real SD3 pipeline (close to eager, ratio 1 kept)."""

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.config import load_config
from flowrl.config_files import ConfigError
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import build_policy
from flowrl.policy.memory import (
    CUDA_GRAPH_MODES,
    MemoryAdapter,
    apply_memory_settings,
    compile_denoiser,
    repeated_blocks,
)
from flowrl.policy.wrapper import AdapterWrapper
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


class _StaticBuffer(AdapterWrapper):
    """A denoiser whose every call writes into one buffer, as a replayed CUDA graph does."""

    def __init__(self, model):
        super().__init__(model)
        self.buffer = None

    def velocity(self, x, sigma, cond):
        v = self._model.velocity(x, sigma, cond)
        if self.buffer is None:
            self.buffer = torch.empty_like(v)
        return self.buffer.copy_(v)


def test_cuda_graph_mode_hands_out_velocities_that_the_next_call_cannot_overwrite(tiny_sd3):
    """memory.compile=reduce-overhead: a kept velocity (a KL's reference) survives the next denoiser call.

    On an H100 the default job with CUDA graphs stopped with "accessing tensor output of CUDAGraphs
    that has been overwritten" (2026-11-27, docs/gpu-runs/2026-11-27-h100-round2.log).
    """
    for mode, own in (("reduce-overhead", True), ("max-autotune", True), ("default", False), ("none", False)):
        memory = load_config(None, [f"memory.compile={mode}"]).memory
        fresh = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2)  # compiled in place, lazily: never called
        assert apply_memory_settings(fresh, memory).own_outputs is own
    assert "cudagraphs" in CUDA_GRAPH_MODES  # its replays share a static output too (CUDA only: tests/test_cuda.py)
    x = torch.randn(2, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    cond = tiny_sd3.encode_prompt(["a bold 1", "a thin 7"])
    sigma = torch.full((2,), 0.6)
    with torch.no_grad():
        # (own_outputs, autocast, survives): an fp32 buffer is overwritten unless copied; a bf16 one is
        # copied anyway by the cast to fp32, so own_outputs adds no second copy there
        for own, autocast, survives in ((True, "none", True), (False, "none", False), (False, "bf16", True)):
            model = MemoryAdapter(_StaticBuffer(tiny_sd3), autocast=autocast, own_outputs=own)
            first = model.velocity(x, sigma, cond)
            kept = first.clone()
            model.velocity(x, torch.full((2,), 0.2), cond)
            assert first.dtype == torch.float32
            assert torch.equal(first, kept) is survives


def test_block_scope_compiles_each_repeated_block_and_leaves_the_rest_eager():
    """memory.compile_scope=blocks: SD3's joint blocks, FLUX's double and single blocks; one-line errors."""
    from conftest import tiny_flux_transformer

    assert load_config(None).memory.compile_scope == "model"
    with pytest.raises(ConfigError, match="memory.compile_scope"):
        load_config(None, ["memory.compile_scope=layers"])
    sd3 = tiny_sd3_pipeline(num_layers=3).transformer
    flux = tiny_flux_transformer()
    assert [type(b).__name__ for b in repeated_blocks(sd3)] == ["JointTransformerBlock"] * 3
    assert {type(b).__name__ for b in repeated_blocks(flux)} == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    for model in (sd3, flux):
        compile_denoiser(model, "default", "blocks")
        assert model._compiled_call_impl is None
        assert all(block._compiled_call_impl is not None for block in repeated_blocks(model))
    with pytest.raises(ValueError, match="has no list of repeated blocks; set memory.compile_scope=model"):
        compile_denoiser(torch.nn.Linear(2, 2), "default", "blocks")
    with pytest.raises(ValueError, match="memory.compile_scope must be one of"):
        compile_denoiser(torch.nn.Linear(2, 2), "default", "layer")
    linear = torch.nn.Linear(2, 2)
    compile_denoiser(linear, "none", "blocks")  # nothing to compile, nothing to find
    assert linear._compiled_call_impl is None


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_both_wan_experts_are_compiled(scope):
    """WanAdapter.velocity calls each expert itself, never WanExperts.forward: the experts are what gets compiled."""
    from tiny_wan import tiny_wan_adapter

    experts = tiny_wan_adapter(two_experts=True).transformer
    compile_denoiser(experts, "default", scope)
    assert experts._compiled_call_impl is None
    for expert in (experts.high, experts.low):
        parts = [expert] if scope == "model" else repeated_blocks(expert)
        assert parts and all(part._compiled_call_impl is not None for part in parts)


@pytest.mark.slow
def test_compiled_blocks_share_one_graph_and_match_eager():
    """Four SD3 blocks, two graphs: three joint blocks share one, the last (``context_pre_only``) has its own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = SD3Adapter(tiny_sd3_pipeline(num_layers=4), max_sequence_length=2, resolution=(8, 8))
    x = torch.randn(2, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompt(["a bold 1", "a thin 7"])
    sigma = torch.full((2,), 0.6)
    with torch.no_grad():
        eager = model.velocity(x, sigma, cond)
        compile_denoiser(model.transformer, "default", "blocks")
        compiled = model.velocity(x, sigma, cond)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2


def test_cudagraphs_mode_is_refused_off_cuda_with_the_fix():
    """memory.compile=cudagraphs on a CPU model: one line naming the device and the fix, nothing compiled."""
    memory = load_config(None, ["memory.compile=cudagraphs"]).memory
    fresh = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2)
    with pytest.raises(ValueError, match="memory.compile=cudagraphs captures CUDA graphs and the model is on cpu; set"):
        apply_memory_settings(fresh, memory)
    assert fresh.transformer._compiled_call_impl is None


@pytest.mark.slow
def test_cudagraphs_mode_traces_the_eager_kernels_bit_for_bit(tiny_sd3):
    """The ``cudagraphs`` backend runs the traced eager kernels: velocity and LoRA gradients equal eager exactly.

    On the CPU torch traces (dynamo + AOT autograd) and skips the capture, so this checks what the mode
    computes; the replay on a GPU is ``tests/test_cuda.py``.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    policy = build_policy(load_config(None, FAST), model=tiny_sd3, trainable=True)
    model, transformer = policy.model, policy.model.transformer
    x = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompt(["a bold handwritten 1"] * 3)
    sigma = torch.full((3,), 0.6)

    def velocity_and_grads() -> list[torch.Tensor]:
        transformer.zero_grad(set_to_none=True)
        v = model.velocity(x, sigma, cond)
        v.square().mean().backward()
        return [v.detach()] + [p.grad for p in transformer.parameters() if p.grad is not None]

    eager = velocity_and_grads()
    compile_denoiser(transformer, "cudagraphs")
    assert transformer._compiled_call_impl is not None
    traced = velocity_and_grads()
    assert len(traced) == len(eager) > 1
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert counters["inductor"]["cudagraph_skips"] == 1  # torch's backend traced it; a CPU graph is not captured


def test_repeated_blocks_takes_only_module_lists_of_one_class_in_model_order() -> None:
    """A top-level ModuleList of mixed classes (a norm beside a projection) is no list of blocks; the others are."""
    lin_a, lin_b, lin_c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([lin_a, lin_b])
    model.mixed = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)])
    model.single = torch.nn.ModuleList([lin_c])
    model.head = torch.nn.Linear(2, 2)
    assert repeated_blocks(model) == [lin_a, lin_b, lin_c]


def test_eager_calls_runs_compiled_parts_eager_inside_and_restores_them_after() -> None:
    """eager_calls (FLOP counts, timing): no compiled call inside the block, every one back after it."""
    from flowrl.policy.memory import eager_calls

    model = tiny_sd3_pipeline(num_layers=2).transformer
    compile_denoiser(model, "default", "blocks")
    calls = {block: block._compiled_call_impl for block in repeated_blocks(model)}
    assert len(calls) == 2 and all(call is not None for call in calls.values())
    with eager_calls(model):
        assert all(m._compiled_call_impl is None for m in model.modules())
    assert {block: block._compiled_call_impl for block in repeated_blocks(model)} == calls
