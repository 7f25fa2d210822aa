"""Explore models (Sol-RL's rollout precision) on the real tiny SD3 transformer with a peft LoRA.

Reference: Li et al., "FP4 Explore, BF16 Train" (Sol-RL), 2026, §3; flowrl.policy.precision.
"""

from __future__ import annotations

from fnmatch import fnmatch

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_sd3_transformer_inputs

from flowrl.kernels import nvfp4_dequantize, nvfp4_fake_quantize, nvfp4_quantize
from flowrl.policy.fp8 import fp8_fake_quantize
from flowrl.policy.lora import add_frozen_copy, add_lora, use_adapter
from flowrl.policy.precision import DEFAULT_SKIP, QuantRule, build_explore, refresh

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.2")


@pytest.fixture
def policy(tiny_sd3):
    """The tiny SD3 adapter with a LoRA whose B is non-zero, so merging changes the weights."""
    params = add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=TARGETS)
    perturb(params, seed=0)
    return tiny_sd3


def perturb(params, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)


def lora_params(transformer, adapter="default"):
    return [p for n, p in transformer.named_parameters() if "lora_" in n and f".{adapter}." in n]


def velocity(model, transformer=None, seed=0):
    """The adapter's velocity on fixed inputs, optionally through another transformer."""
    g = torch.Generator().manual_seed(seed)
    x, sigma = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0.9, 0.5, 0.2])
    cond = model.encode_prompt(["a 3", "a bold 7", "a thin 1"])
    original = model.transformer
    model.transformer = transformer or original
    try:
        with torch.no_grad():
            return model.velocity(x, sigma, cond)
    finally:
        model.transformer = original


def merged_weight(transformer, name, adapter="default"):
    """W + B A * scale of one LoRA layer of the policy, computed here from the peft parts."""
    layer = transformer.get_submodule(name)
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    return (layer.base_layer.weight + (b @ a) * layer.scaling[adapter]).detach()


# --------------------------------------------------------------------------- the merged copy


def test_fp32_copy_reproduces_the_lora_model_and_is_never_trained(policy):
    explore = build_explore(policy, "fp32")
    torch.testing.assert_close(velocity(policy, explore.module), velocity(policy), rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in explore.module.parameters()) and not explore.module.training
    assert not any("lora_" in n for n, _ in explore.module.named_parameters())
    assert not hasattr(explore.module, "peft_config")
    assert all(p.requires_grad for p in lora_params(policy.transformer))  # the policy keeps training
    policy_storage = {p.data_ptr() for p in policy.transformer.parameters()}
    assert not policy_storage & {p.data_ptr() for p in explore.module.parameters()}  # nothing shared


def test_merging_differs_from_the_base_model(policy):
    explore = build_explore(policy, "fp32")
    policy.transformer.disable_adapters()
    base = velocity(policy)
    policy.transformer.enable_adapters()
    assert (velocity(policy, explore.module) - base).abs().max() > 1e-3


def test_merges_the_named_adapter(policy):
    add_frozen_copy(policy.transformer, "old")
    perturb(lora_params(policy.transformer), seed=1)  # "default" moves on, "old" stays
    old = build_explore(policy, "fp32", adapter="old")
    with use_adapter(policy.transformer, "old"):
        torch.testing.assert_close(velocity(policy, old.module), velocity(policy), rtol=1e-5, atol=1e-6)
    assert (velocity(policy, old.module) - velocity(policy)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="no LoRA adapter 'ema'"):
        build_explore(policy, "fp32", adapter="ema")


def test_a_transformer_without_lora_is_copied_as_is(tiny_sd3):
    explore = build_explore(tiny_sd3.transformer, "fp32")
    assert torch.equal(velocity(tiny_sd3, explore.module), velocity(tiny_sd3))


# --------------------------------------------------------------------------- quantised layers


@pytest.mark.parametrize("activations", [False, True])
def test_nvfp4_layer_is_the_dequantised_weight_matmul(policy, activations):
    explore = build_explore(policy, "nvfp4", activations=activations)
    name = "transformer_blocks.0.attn.to_q"
    weight = merged_weight(policy.transformer, name)
    expected_weight = nvfp4_dequantize(nvfp4_quantize(weight))
    layer = explore.module.get_submodule(name)
    assert name in explore.quantised and torch.equal(layer.weight, expected_weight)
    x = torch.randn(5, 7, layer.in_features, generator=torch.Generator().manual_seed(0))
    x_in = nvfp4_fake_quantize(x) if activations else x
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x_in, expected_weight, layer.bias))
    assert not torch.equal(expected_weight, weight)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_emulated_fp8_w8a8_quantises_inputs_with_the_weights_scaling(policy, scaling) -> None:
    """With activations, an emulated fp8 layer quantises its input per row or per tensor as its weights are scaled,
    as ScaledMMLinear's kernel does (rows of very different size tell the two apart)."""
    explore = build_explore(policy, "fp8_e4m3", activations=True, scaling=scaling)
    layer = explore.module.get_submodule("transformer_blocks.0.ff.net.2")
    x = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(0))
    x = x * torch.tensor([1e-3, 1e2]).reshape(2, 1, 1)
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(got, F.linear(fp8_fake_quantize(x, scaling), layer.weight, layer.bias))
    other = "tensor" if scaling == "row" else "row"
    assert not torch.equal(got, F.linear(fp8_fake_quantize(x, other), layer.weight, layer.bias))


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_layer_weights_are_on_the_e4m3_grid(policy, scaling):
    explore = build_explore(policy, "fp8_e4m3", scaling=scaling)
    name = "transformer_blocks.0.ff.net.2"
    weight = merged_weight(policy.transformer, name)
    layer = explore.module.get_submodule(name)
    assert explore.emulate and torch.equal(layer.weight, fp8_fake_quantize(weight, scaling))
    amax = weight.abs().amax(dim=-1, keepdim=True) if scaling == "row" else weight.abs().amax()
    scaled = layer.weight / (amax / 448)
    torch.testing.assert_close(scaled, scaled.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=0)
    assert (layer.weight - weight).abs().max() <= amax.max() / 448 * 16  # half an E4M3 step at 448 is 16


def test_int8_dynamic_layers_are_torch_ao_dynamic_linears(policy):
    explore = build_explore(policy, "int8_dynamic")
    layer = explore.module.get_submodule("transformer_blocks.0.attn.to_q")
    assert type(layer).__name__ == "Linear" and type(layer).__module__.startswith("torch.ao.nn.quantized.dynamic")
    x = torch.randn(6, layer.in_features, generator=torch.Generator().manual_seed(0))
    reference = F.linear(x, layer.weight().dequantize(), layer.bias())
    assert ((layer(x) - reference).norm() / reference.norm()) < 0.02  # activations are quantised per call
    torch.testing.assert_close(velocity(policy, explore.module), velocity(policy), rtol=0.05, atol=0.05)


def test_bf16_explore_casts_in_and_out(policy):
    explore = build_explore(policy, "bf16")
    assert {p.dtype for p in explore.module.parameters()} == {torch.bfloat16}
    out = velocity(policy, explore.module)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, velocity(policy), rtol=0.05, atol=0.05)


# --------------------------------------------------------------------------- which layers


def test_default_rule_skips_embedders_and_final_layers(policy):
    explore = build_explore(policy, "nvfp4")
    linears = [n for n, m in explore.module.named_modules() if isinstance(m, torch.nn.Linear)]
    skipped = set(linears) - set(explore.quantised)
    assert skipped == {n for n in linears if any(fnmatch(n, p) for p in DEFAULT_SKIP)}
    assert {"context_embedder", "proj_out", "norm_out.linear", "time_text_embed.text_embedder.linear_1"} <= skipped
    fp32 = build_explore(policy, "fp32").module
    for name in skipped:
        assert torch.equal(explore.module.get_submodule(name).weight, fp32.get_submodule(name).weight)


def test_rule_patterns_and_min_features(policy):
    rule = QuantRule(skip=("*attn*",), min_features=32)  # tiny model: attention 16 wide, MLP 64, AdaLN 96
    explore = build_explore(policy, "nvfp4", rule=rule)
    assert explore.quantised and all("attn" not in n for n in explore.quantised)
    for name in explore.quantised:
        layer = explore.module.get_submodule(name)
        assert max(layer.in_features, layer.out_features) > 32
    assert "time_text_embed.timestep_embedder.linear_1" in explore.quantised  # patterns replace the defaults
    with pytest.raises(ValueError, match="selects no Linear layer"):
        build_explore(policy, "nvfp4", rule=QuantRule(min_features=10_000))


# --------------------------------------------------------------------------- refresh


@pytest.mark.parametrize("precision", ["fp32", "bf16", "nvfp4", "fp8_e4m3", "int8_dynamic"])
def test_refresh_equals_a_fresh_build(policy, precision):
    options = {"activations": precision == "nvfp4"}
    explore = build_explore(policy, precision, **options)
    module, before = explore.module, velocity(policy, explore.module)
    perturb(lora_params(policy.transformer), seed=2)
    refresh(explore, policy)
    assert explore.module is module  # updated in place, no new deep copy
    after = velocity(policy, explore.module)
    assert torch.equal(after, velocity(policy, build_explore(policy, precision, **options).module))
    assert (after - before).abs().max() > 1e-3


def test_refresh_keeps_a_lora_layer_the_rule_skips_at_full_precision(policy) -> None:
    """A LoRA layer the QuantRule leaves out (to_q here) is refreshed at full precision, as a fresh build holds it."""
    rule = QuantRule(skip=(*DEFAULT_SKIP, "*to_q"))
    explore = build_explore(policy, "nvfp4", rule=rule)
    assert not any(n.endswith("to_q") for n in explore.quantised) and explore.quantised
    perturb(lora_params(policy.transformer), seed=4)
    refresh(explore, policy)
    fresh = build_explore(policy, "nvfp4", rule=rule)
    for name, param in fresh.module.named_parameters():
        assert torch.equal(explore.module.get_parameter(name), param), name
    name = "transformer_blocks.0.attn.to_q"
    assert torch.equal(explore.module.get_submodule(name).weight, merged_weight(policy.transformer, name))


def test_refresh_passes_over_layers_only_another_adapter_adapts(policy) -> None:
    """With a second adapter on other layers (ff.net.0.proj), refreshing "default" skips them: a fresh build."""
    from peft import LoraConfig

    from flowrl.policy.lora import several_adapters

    with several_adapters():
        policy.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["ff.net.0.proj"]), "other")
    policy.transformer.set_adapter("default")
    explore = build_explore(policy, "fp32")
    perturb(lora_params(policy.transformer), seed=5)
    refresh(explore, policy)
    fresh = build_explore(policy, "fp32")
    for name, param in fresh.module.named_parameters():
        assert torch.equal(explore.module.get_parameter(name), param), name


def test_refresh_of_the_fp32_copy_tracks_the_trained_lora(policy):
    explore = build_explore(policy, "fp32")
    perturb(lora_params(policy.transformer), seed=3)
    refresh(explore, policy.transformer)
    torch.testing.assert_close(velocity(policy, explore.module), velocity(policy), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"lora_bias": True}])
def test_refresh_refuses_a_lora_with_a_dora_or_bias_term(tiny_sd3, variant: dict[str, bool]) -> None:
    """refresh adds B A * scale only: a DoRA magnitude or a LoRA bias would be dropped, so it asks for build_explore."""
    from peft import LoraConfig

    tiny_sd3.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], **variant))
    explore = build_explore(tiny_sd3, "fp32")
    with pytest.raises(ValueError, match=r"refresh merges plain LoRA only; .*to_q has a bias or DoRA term"):
        refresh(explore, tiny_sd3)


def test_the_copy_records_whether_its_precision_is_emulated(policy) -> None:
    """ExploreModel.emulate: True for fake-quantised nvfp4 and fp8 off CUDA; False for the cast and torch.ao copies."""
    expected = {"fp32": False, "bf16": False, "nvfp4": True, "fp8_e4m3": True, "int8_dynamic": False}
    assert {p: build_explore(policy, p).emulate for p in expected} == expected


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"precision": "fp4"}, "precision must be one of"),
        ({"precision": "native_nvfp4"}, "native_nvfp4 needs a Blackwell GPU .* use precision='bf16' on a Hopper"),
        ({"precision": "fp8_e4m3", "emulate": False}, r"needs CUDA \(torch._scaled_mm\)"),
        ({"precision": "int8_dynamic", "activations": True}, "activations=True applies to"),
        ({"precision": "fp32", "activations": True}, "activations=True applies to 'nvfp4' and 'fp8_e4m3'"),
        ({"precision": "bf16", "activations": True}, "activations=True applies to 'nvfp4' and 'fp8_e4m3'"),
        ({"precision": "fp8_e4m3", "scaling": "block"}, "scaling must be"),
        ({"precision": "fp8_e4m3", "fuse_under_compile": True}, "fuse_under_compile applies to fp8_e4m3 on"),
        ({"precision": "nvfp4", "fuse_under_compile": True}, "fuse_under_compile applies to fp8_e4m3 on"),
        ({"precision": "fp8_e4m3", "fast_accum": True}, "fast_accum applies to fp8_e4m3 on"),
        ({"precision": "bf16", "fast_accum": True}, "fast_accum applies to fp8_e4m3 on"),
    ],
)
def test_bad_requests_are_one_line_errors(policy, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        build_explore(policy, **kwargs)
    assert "\n" not in str(err.value)


def test_int8_needs_fp32_and_policy_needs_a_transformer(tiny_sd3):
    with pytest.raises(ValueError, match="fp32 weights"):
        build_explore(tiny_sd3.transformer.to(torch.bfloat16), "int8_dynamic")
    with pytest.raises(TypeError, match="Policy, a model adapter or an nn.Module"):
        build_explore(object(), "fp32")


def test_device_checks_refuse_int8_off_the_cpu_and_native_nvfp4_off_cuda() -> None:
    """check_explore_device (run on the config before loading): int8_dynamic is CPU-only, native_nvfp4 CUDA-only."""
    from flowrl.policy.precision import check_explore_device

    with pytest.raises(ValueError, match="int8_dynamic is torch.ao's CPU path; the policy is on cuda; use bf16"):
        check_explore_device("int8_dynamic", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="native_nvfp4 needs a Blackwell GPU .* the policy is on cpu"):
        check_explore_device("native_nvfp4", torch.device("cpu"), torch.bfloat16)
    assert check_explore_device("int8_dynamic", torch.device("cpu"), torch.float32) is None
    assert check_explore_device("fp8_e4m3", torch.device("cpu"), torch.float32) is True


class _Scaled(torch.nn.Module):
    """A Linear whose output is multiplied by a per-sample (B,) factor: a rank-1 floating input."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * factor[:, None]


def test_a_cast_copy_casts_inputs_of_rank_two_and_up_only() -> None:
    """A bf16 copy casts (B, D) inputs to bf16 but passes (B,) ones (per-sample scalars) as given; output in fp32."""
    torch.manual_seed(0)
    explore = build_explore(_Scaled(), "bf16")
    seen: list[tuple[torch.Tensor, ...]] = []
    explore.module.register_forward_pre_hook(lambda m, args: seen.append(args))
    x, factor = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0.3, 1.7])
    with torch.no_grad():
        out = explore.module(x, factor)
    assert seen[0][0].dtype == torch.bfloat16
    assert seen[0][1].dtype == torch.float32 and torch.equal(seen[0][1], factor)
    assert out.dtype == torch.float32


NEEDS_SCALED_MM = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs cc >= 8.9"
)


def lora_policy_on_cuda(model):
    """The tiny SD3 adapter's transformer on CUDA with a fresh LoRA; returns its LoRA parameters."""
    model.transformer.to("cuda")
    return add_lora(model.transformer, rank=4, alpha=8, targets=TARGETS)


@pytest.mark.cuda
@NEEDS_SCALED_MM
def test_fuse_under_compile_reaches_every_fp8_layer_and_survives_a_refresh(tiny_sd3):
    from flowrl.policy.fp8 import ScaledMMLinear

    params = lora_policy_on_cuda(tiny_sd3)
    explore = build_explore(tiny_sd3, "fp8_e4m3", rule=QuantRule(min_features=0), fuse_under_compile=True)
    layers = [m for m in explore.module.modules() if isinstance(m, ScaledMMLinear)]
    assert layers and all(layer.fuse_under_compile for layer in layers)
    perturb(params, seed=1)
    refresh(explore, tiny_sd3)
    layers = [m for m in explore.module.modules() if isinstance(m, ScaledMMLinear)]
    assert layers and all(layer.fuse_under_compile for layer in layers)


@pytest.mark.cuda
@NEEDS_SCALED_MM
def test_fast_accum_reaches_every_fp8_layer_survives_a_refresh_and_stays_close(tiny_sd3):
    """Every ScaledMMLinear of a ``fast_accum`` copy accumulates fast, also after a refresh; its velocity stays
    within 2 % (relative L2) of the default copy's, whose FP8 codes and scales are the same."""
    from flowrl.policy.fp8 import ScaledMMLinear

    params = lora_policy_on_cuda(tiny_sd3)
    rule = QuantRule(min_features=0)
    fast, precise = (build_explore(tiny_sd3, "fp8_e4m3", rule=rule, fast_accum=f) for f in (True, False))
    perturb(params, seed=1)
    refresh(fast, tiny_sd3)
    refresh(precise, tiny_sd3)
    layers = [m for m in fast.module.modules() if isinstance(m, ScaledMMLinear)]
    assert layers and all(layer.fast_accum for layer in layers)
    assert not any(m.fast_accum for m in precise.module.modules() if isinstance(m, ScaledMMLinear))
    inputs = tiny_sd3_transformer_inputs(0, "cuda")
    with torch.no_grad():
        a, b = (e.module(**inputs)[0].float() for e in (fast, precise))
    assert (a - b).norm() <= 0.02 * b.norm()


@pytest.mark.cuda
@NEEDS_SCALED_MM
def test_scaled_mm_layers_share_quantised_inputs_with_the_same_output_also_after_a_refresh(tiny_sd3):
    from flowrl.policy.fp8 import ScaledMMLinear

    params = lora_policy_on_cuda(tiny_sd3)
    perturb(params, seed=2)
    rule = QuantRule(min_features=0)
    shared = build_explore(tiny_sd3, "fp8_e4m3", rule=rule)
    plain = build_explore(tiny_sd3, "fp8_e4m3", rule=rule, share_inputs=False)
    perturb(params, seed=3)
    refresh(shared, tiny_sd3)
    refresh(plain, tiny_sd3)
    layers = [m for m in shared.module.modules() if isinstance(m, ScaledMMLinear)]
    assert layers and all(layer.shared_input is shared.shared_input for layer in layers)
    inputs = tiny_sd3_transformer_inputs(0, "cuda")
    with torch.no_grad():
        a, b = (e.module(**inputs)[0] for e in (shared, plain))
    assert torch.equal(a, b) and shared.shared_input.hits > 0


@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_fake_quantize_refuses_nan_and_inf(scaling, bad):
    """A NaN amax falls back to scale 1 in the scale rule: the input itself is checked."""
    x = torch.tensor([[bad, 1.0], [2.0, 3.0]])
    with pytest.raises(ValueError, match="fp8_e4m3 input holds NaN or inf"):
        fp8_fake_quantize(x, scaling)


def test_a_cast_copy_takes_per_token_timesteps_as_given():
    """Wan2.2-TI2V passes one fp32 timestep per token ((B, tokens), rank 2); a bf16 copy casts the latents and the
    text but not the timesteps, as diffusers' bf16 pipeline passes them (937.5 would round to 936)."""
    from tiny_wan import tiny_wan_adapter

    model = tiny_wan_adapter(expand_timesteps=True)
    explore = build_explore(model.transformer, "bf16")
    seen = {}
    explore.module.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    x = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)  # patch (1, 2, 2), as WanAdapter._run counts
    timestep = torch.tensor([937.5, 312.25])[:, None].expand(-1, tokens)
    text = model.encode_prompt(["a red fox running", "a blue cat jumping slowly"])["encoder_hidden_states"]
    with torch.no_grad():
        out = explore.module(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    assert seen["timestep"].dtype == torch.float32 and torch.equal(seen["timestep"], timestep)
    assert seen["hidden_states"].dtype == seen["encoder_hidden_states"].dtype == torch.bfloat16
    assert out.dtype == torch.float32 and out.shape == x.shape


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_fake_quantize_keeps_the_input_dtype(scaling: str) -> None:
    """A bf16 input comes back bf16 (the dequantised fp32 value rounded once), as a bf16 copy's layers need."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = fp8_fake_quantize(x, scaling)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, fp8_fake_quantize(x.float(), scaling).to(torch.bfloat16))
