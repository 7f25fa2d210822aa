"""build_policy on the embedded model: the documented wrapper stack, trainable LoRA, loading a saved LoRA,
the explicit ModelAdapter contract on every wrapper, and the one pipeline-class table."""

import importlib
import json
import shutil

import pytest
import torch

from flowrl.config import load_config
from flowrl.models import EMBEDDED, PIPELINES, load_adapter
from flowrl.models.adapter import AdapterBase, ModelAdapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import Policy, build_policy
from flowrl.policy.counting import CountingAdapter
from flowrl.policy.guidance import GuidedAdapter, apply_guidance
from flowrl.policy.lora import add_lora, lora_state_dict
from flowrl.policy.memory import MemoryAdapter, apply_memory_settings
from flowrl.policy.wrapper import AdapterWrapper
from flowrl.samplers import make_sigmas

PROTOCOL_MEMBERS = sorted({n for n in vars(ModelAdapter) if not n.startswith("_")} | set(ModelAdapter.__annotations__))


def _layers(model):
    """The classes of the stack from the outside in, down to the bare adapter."""
    layers = [type(model)]
    while isinstance(model, AdapterWrapper):
        model = model.wrapped
        layers.append(type(model))
    return layers


def _velocity(model, prompts=("a bold handwritten 3", "a thin handwritten 7")):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *model.latent_shape(8, 8), generator=gen)
    with torch.no_grad():
        return model.velocity(x, torch.tensor([0.8, 0.3]), model.encode_prompt(list(prompts)))


def test_protocol_lists_the_whole_contract():
    expected = {
        "transformer",
        "lora_target_modules",
        "dtype",
        "device",
        "default_resolution",
        "guidance",
        "model_id",
        "pipe",
        "max_sequence_length",
        "default_num_frames",
        "evaluations_per_sample",
        "encode_prompt",
        "velocity",
        "decode",
        "decoder",
        "latent_shape",
        "sigmas",
        "combine_cfg",
        "save_lora",
        "load_lora",
        "free_text_encoders",
    }
    assert set(PROTOCOL_MEMBERS) == expected


def test_default_stack_is_counting_memory_adapter():
    policy = build_policy(load_config(None, []))
    assert isinstance(policy, Policy)
    assert _layers(policy.model) == [CountingAdapter, MemoryAdapter, SD3Adapter]
    assert policy.params == [] and policy.resolution == (8, 8) and policy.latent_shape == (4, 8, 8)
    assert policy.model.model_id == EMBEDDED and policy.model.evaluations_per_sample == 1
    torch.testing.assert_close(policy.sigmas(4), make_sigmas("linear", 4), rtol=0, atol=0)


def test_cfg_stack_has_the_guided_layer_and_counts_two_evaluations():
    cfg = load_config(None, ["sampler.guidance_scale=4.5", "prompts.negative=blurry"])
    policy = build_policy(cfg)
    assert _layers(policy.model) == [CountingAdapter, MemoryAdapter, GuidedAdapter, SD3Adapter]
    guided = policy.model.wrapped.wrapped
    assert guided.scale == 4.5 and guided.negative_prompt == "blurry"
    assert policy.model.evaluations_per_sample == 2
    _velocity(policy.model)
    assert policy.model.nfe == 2 * 2


def test_trainable_lora_matches_the_trainer_order_bit_for_bit():
    cfg = load_config(None, ["lora.rank=4", "lora.alpha=8"])
    torch.manual_seed(0)
    policy = build_policy(cfg, trainable=True)
    assert len(policy.params) > 0 and all(p.requires_grad and p.dtype == torch.float32 for p in policy.params)
    assert all(not p.requires_grad for n, p in policy.model.transformer.named_parameters() if "lora_" not in n)
    torch.manual_seed(0)  # the order the Trainer used: load -> guidance -> memory -> counter -> LoRA
    model = CountingAdapter(apply_memory_settings(apply_guidance(load_adapter(), 1.0), cfg.memory))
    params = add_lora(model.transformer, rank=4, alpha=8, targets=list(model.lora_target_modules))
    assert len(params) == len(policy.params)
    for a, b in zip(params, policy.params):
        assert torch.equal(a, b)


def test_saved_lora_reproduces_the_velocity(tmp_path):
    cfg = load_config(None, ["lora.rank=4", "lora.alpha=8"])
    trained = build_policy(cfg, trainable=True)
    with torch.no_grad():
        for p in trained.params:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    trained.model.save_lora(tmp_path / "run" / "lora", lora_state_dict(trained.model.transformer))
    expected = _velocity(trained.model)
    assert not torch.allclose(expected, _velocity(build_policy(cfg).model))  # the LoRA changes the model
    run = tmp_path / "run"
    for source in (run, run / "lora", run / "lora" / "pytorch_lora_weights.safetensors"):
        loaded = build_policy(cfg, lora=source)
        torch.testing.assert_close(_velocity(loaded.model), expected, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_one_line_errors(tmp_path):
    cfg = load_config(None, [])
    with pytest.raises(FileNotFoundError) as err:
        build_policy(cfg, lora=tmp_path / "nothing")
    assert "\n" not in str(err.value) and str(err.value).startswith(f"no LoRA at {tmp_path / 'nothing'}")
    with pytest.raises(ValueError, match="can't be combined"):
        build_policy(cfg, lora=tmp_path, trainable=True)
    with pytest.raises(TypeError, match="bare model adapter"):
        build_policy(cfg, model=build_policy(cfg).model)


def test_custom_counter_and_given_model(tiny_sd3):
    class Counter(CountingAdapter):
        pass

    policy = build_policy(load_config(None, ["model.resolution=8"]), model=tiny_sd3, counter=Counter)
    assert type(policy.model) is Counter and policy.model.wrapped.wrapped is tiny_sd3


def test_wrappers_define_the_contract_explicitly(tiny_sd3):
    for cls in (AdapterWrapper, GuidedAdapter, MemoryAdapter, CountingAdapter):
        assert not hasattr(cls, "__getattr__"), cls
    for name in PROTOCOL_MEMBERS:
        assert name in vars(AdapterWrapper), name
    cfg = load_config(None, ["sampler.guidance_scale=3.0"])
    stack = build_policy(cfg, model=tiny_sd3).model
    assert isinstance(stack, ModelAdapter) and isinstance(tiny_sd3, ModelAdapter)
    for name in PROTOCOL_MEMBERS:
        assert hasattr(stack, name), name
    for name in (
        "transformer",
        "lora_target_modules",
        "dtype",
        "device",
        "default_resolution",
        "guidance",
        "pipe",
        "max_sequence_length",
        "default_num_frames",
    ):
        assert getattr(stack, name) == getattr(tiny_sd3, name), name
    assert stack.model_id.startswith(f"{tiny_sd3.model_id}|negative:")
    assert stack.sigmas(4, 8, 8) is None and stack.latent_shape(8, 8) == tiny_sd3.latent_shape(8, 8)
    assert not hasattr(stack, "vae")  # nothing outside the contract leaks through the wrappers
    with pytest.raises(ValueError, match="image model"):
        stack.latent_shape(8, 8, 5)


def test_model_schedule_needs_a_grid_of_its_own():
    policy = build_policy(load_config(None, ["sampler.schedule=model"]))
    with pytest.raises(ValueError, match="sampler.schedule='model'.*flowrl-digits has none"):
        policy.sigmas(4)


def test_free_text_encoders_through_the_stack():
    policy = build_policy(load_config(None, []))
    released = policy.model.free_text_encoders()
    assert released > 0 and policy.model.pipe.text_encoder is None
    with pytest.raises(ValueError, match="text encoders were freed"):
        policy.model.encode_prompt(["a 1"])


def test_one_table_maps_every_pipeline_class():
    assert set(PIPELINES) == {"StableDiffusion3Pipeline", "FluxPipeline", "QwenImagePipeline", "WanPipeline"}
    for module, name in PIPELINES.values():
        assert issubclass(getattr(importlib.import_module(module), name), AdapterBase)


@pytest.mark.parametrize("content, what", [("[1, 2]", "a list"), ("{not json", "not valid JSON")])
def test_malformed_model_index_names_the_file(tmp_path, content, what):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text(content)
    with pytest.raises(ValueError) as err:
        load_adapter(str(folder))
    assert "\n" not in str(err.value) and str(folder / "model_index.json") in str(err.value) and what in str(err.value)


def test_embedded_folder_loads_by_class_name(tmp_path):
    from flowrl.models.digits.model import DIGITS_DIR

    folder = tmp_path / "copy"
    shutil.copytree(DIGITS_DIR, folder)
    model = load_adapter(str(folder))
    assert type(model) is SD3Adapter and model.model_id == str(folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "MysteryPipeline"}))
    with pytest.raises(ValueError, match="no flowrl adapter for pipeline class 'MysteryPipeline'.*WanPipeline"):
        load_adapter(str(folder))


def test_the_stack_combines_cfg_as_the_model_does_uncond_first(tiny_sd3: SD3Adapter) -> None:
    """The wrappers pass combine_cfg's (v_uncond, v_cond, scale) through in order: v_u + w (v_c - v_u)."""
    stack = build_policy(load_config(None, ["sampler.guidance_scale=3.0"]), model=tiny_sd3).model
    v_u, v_c = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([3.0, 0.5], dtype=torch.float64)
    assert torch.equal(stack.combine_cfg(v_u, v_c, 3.0), torch.tensor([7.0, 5.5], dtype=torch.float64))
    assert torch.equal(stack.combine_cfg(v_u, v_c, 3.0), tiny_sd3.combine_cfg(v_u, v_c, 3.0))


def test_the_policy_takes_the_configured_shift_schedule(tiny_sd3: SD3Adapter) -> None:
    """sampler.schedule=shift, sampler.shift=3: the policy's grid is 3t / (1 + 2t) on the linear t grid."""
    cfg = load_config(None, ["sampler.schedule=shift", "sampler.shift=3.0"])
    policy = build_policy(cfg, model=tiny_sd3)
    assert (policy.schedule, policy.shift) == ("shift", 3.0)
    expected = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0], dtype=torch.float64)
    torch.testing.assert_close(policy.sigmas(4), expected, rtol=0, atol=1e-12)


def test_the_policy_takes_the_configured_number_of_frames() -> None:
    """model.num_frames=9 on the tiny Wan (its default is 5): latent frames (9 - 1) / 4 + 1 = 3, not 2."""
    from tiny_wan import tiny_wan_adapter

    model = tiny_wan_adapter()
    assert model.default_num_frames == 5
    policy = build_policy(load_config(None, ["model.num_frames=9", "model.resolution=[16,16]"]), model=model)
    assert policy.latent_shape == (16, 3, 2, 2) == model.latent_shape(16, 16, 9)


def test_the_trainable_lora_takes_the_configured_rank_and_alpha(tiny_sd3: SD3Adapter) -> None:
    """lora.rank=4, lora.alpha=2: every adapted layer has rank 4 and peft's scale alpha / r = 0.5."""
    cfg = load_config(None, ["lora.rank=4", "lora.alpha=2.0"])
    policy = build_policy(cfg, model=tiny_sd3, trainable=True)
    layers = [m for m in policy.model.transformer.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers and {(m.r["default"], m.scaling["default"]) for m in layers} == {(4, 0.5)}
