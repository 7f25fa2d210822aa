"""LoRA: zero-init output identity, frozen base, and diffusers load_lora_weights interop."""

from pathlib import Path

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.models.sd3 import SD3Adapter
from flowrl.policy.lora import add_lora, count_parameters, load_lora_state, lora_state_dict


def _inputs(model):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *model.latent_shape(8, 8), generator=gen)
    return x, torch.tensor([0.9, 0.3]), model.encode_prompt(["a bold handwritten 1", "a thin handwritten 2"])


def _trained_and_saved(model, folder):
    """Attach a LoRA with random weights to ``model``, save it to ``folder``; the inputs, trained velocity, file."""
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    for name, p in model.transformer.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    x, s, c = _inputs(model)
    return x, s, c, model.velocity(x, s, c), model.save_lora(folder, lora_state_dict(model.transformer))


def test_new_lora_leaves_outputs_unchanged_and_trains_only_itself(tiny_sd3):
    x, s, c = _inputs(tiny_sd3)
    before = tiny_sd3.velocity(x, s, c)
    params = add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=tiny_sd3.lora_target_modules)
    torch.testing.assert_close(tiny_sd3.velocity(x, s, c), before, rtol=0, atol=0)
    trainable = [p for p in tiny_sd3.transformer.parameters() if p.requires_grad]
    assert len(trainable) == len(params) > 0 and count_parameters(params) > 0
    assert all(p.dtype == torch.float32 for p in params)


def test_saved_lora_loads_into_a_diffusers_pipeline(tiny_sd3, tmp_path):
    x, s, c, trained, path = _trained_and_saved(tiny_sd3, tmp_path)
    assert path.name == "pytorch_lora_weights.safetensors" and path.is_file()
    fresh = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    base = fresh.velocity(x, s, c)
    fresh.pipe.load_lora_weights(str(tmp_path))
    reloaded = fresh.velocity(x, s, c)
    assert not torch.allclose(base, trained)
    torch.testing.assert_close(reloaded, trained, rtol=1e-5, atol=1e-6)


def test_state_round_trip_and_mismatch_error(tiny_sd3):
    add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=tiny_sd3.lora_target_modules)
    state = lora_state_dict(tiny_sd3.transformer)
    load_lora_state(tiny_sd3.transformer, state)
    other = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    add_lora(other.transformer, rank=4, alpha=8, targets=("to_q",))
    try:
        load_lora_state(other.transformer, state)
    except ValueError as err:
        assert "same lora.rank/targets" in str(err)
    else:
        raise AssertionError("expected ValueError")


def test_another_rank_is_one_line_at_check_and_at_load(tiny_sd3):
    from flowrl.policy.lora import check_lora_state

    add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=tiny_sd3.lora_target_modules)
    state = lora_state_dict(tiny_sd3.transformer)
    check_lora_state(tiny_sd3.transformer, state)
    other = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    add_lora(other.transformer, rank=2, alpha=8, targets=tiny_sd3.lora_target_modules)
    with pytest.raises(
        ValueError, match=r"lora_A.weight: \(4, \d+\) in the checkpoint, \(2, \d+\) here\); use the same"
    ):
        check_lora_state(other.transformer, state)
    with pytest.raises(ValueError, match=r"^LoRA checkpoint does not match the model \(tensor sizes differ\)") as info:
        load_lora_state(other.transformer, state)
    assert "\n" not in str(info.value)


def _lora_with_old(model):
    """A random LoRA "default" on ``model`` and its frozen copy "old"; returns the default's parameters."""
    from flowrl.policy.lora import add_frozen_copy

    params = add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    for p in params:
        p.data.normal_(0, 0.1)
    add_frozen_copy(model.transformer, "old")
    return params


def test_frozen_copy_soft_update_and_switch(tiny_sd3):
    from flowrl.policy.lora import adapter_parameters, soft_update, use_adapter

    params = _lora_with_old(tiny_sd3)
    x, s, c = _inputs(tiny_sd3)
    v_default = tiny_sd3.velocity(x, s, c)
    with use_adapter(tiny_sd3.transformer, "old"):
        torch.testing.assert_close(tiny_sd3.velocity(x, s, c), v_default, rtol=0, atol=0)
    assert all(p.requires_grad for p in params)
    assert not any(p.requires_grad for p in adapter_parameters(tiny_sd3.transformer, "old").values())
    old = {k: v.clone() for k, v in adapter_parameters(tiny_sd3.transformer, "old").items()}
    for p in params:
        p.data.add_(1.0)
    soft_update(tiny_sd3.transformer, "old", keep=0.25)
    new = adapter_parameters(tiny_sd3.transformer, "default")
    for key, value in adapter_parameters(tiny_sd3.transformer, "old").items():
        torch.testing.assert_close(value, 0.25 * old[key] + 0.75 * new[key])
    with use_adapter(tiny_sd3.transformer, "old"):
        v_old = tiny_sd3.velocity(x, s, c)
    assert not torch.allclose(v_old, tiny_sd3.velocity(x, s, c))
    assert tiny_sd3.transformer.active_adapters() == ["default"]


def test_use_adapter_switches_like_diffusers_and_restores_every_flag(tiny_sd3):
    from flowrl.policy.lora import adapter_parameters, use_adapter

    params = _lora_with_old(tiny_sd3)
    for p in adapter_parameters(tiny_sd3.transformer, "old").values():
        p.data.add_(0.05)
    x, s, c = _inputs(tiny_sd3)
    tiny_sd3.transformer.set_adapter("old")  # diffusers' own switch, as the reference
    v_reference = tiny_sd3.velocity(x, s, c)
    tiny_sd3.transformer.set_adapter("default")
    for p in params:
        p.requires_grad_(False)  # a frozen policy (evaluation): flags other than peft's defaults survive
    with use_adapter(tiny_sd3.transformer, "old"):
        assert tiny_sd3.transformer.active_adapters() == ["old"]
        torch.testing.assert_close(tiny_sd3.velocity(x, s, c), v_reference, rtol=0, atol=0)
    assert tiny_sd3.transformer.active_adapters() == ["default"]
    assert not any(p.requires_grad for n, p in tiny_sd3.transformer.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="no LoRA adapter 'ema'; it has \\['default', 'old'\\]"):
        with use_adapter(tiny_sd3.transformer, "ema"):
            pass
    assert tiny_sd3.transformer.active_adapters() == ["default"]


def test_adapters_disabled_runs_the_base_model_like_diffusers_and_restores_every_flag(tiny_sd3):
    from flowrl.policy.lora import adapters_disabled

    params = _lora_with_old(tiny_sd3)
    x, s, c = _inputs(tiny_sd3)
    tiny_sd3.transformer.disable_adapters()  # diffusers' own switch, as the reference
    v_base = tiny_sd3.velocity(x, s, c)
    tiny_sd3.transformer.enable_adapters()
    v_lora = tiny_sd3.velocity(x, s, c)
    assert not torch.equal(v_base, v_lora)
    flags = {n: p.requires_grad for n, p in tiny_sd3.transformer.named_parameters()}
    with adapters_disabled(tiny_sd3.transformer):
        torch.testing.assert_close(tiny_sd3.velocity(x, s, c), v_base, rtol=0, atol=0)
    torch.testing.assert_close(tiny_sd3.velocity(x, s, c), v_lora, rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in tiny_sd3.transformer.named_parameters()} == flags
    for p in params:
        p.requires_grad_(False)  # a frozen policy stays frozen (diffusers' enable_adapters would thaw it)
    with adapters_disabled(tiny_sd3.transformer):
        pass
    assert not any(p.requires_grad for n, p in tiny_sd3.transformer.named_parameters() if "lora_" in n)


def test_a_lora_target_that_names_no_module_is_refused(tiny_sd3):
    """lora.targets=[to_q, to_kk]: peft would adapt to_q and skip the typo silently; build_policy names it."""
    from flowrl.config import load_config
    from flowrl.policy import build_policy

    cfg = load_config(None, ["lora.targets=[to_q,to_kk]"])
    with pytest.raises(ValueError, match=r"lora.targets \['to_kk'\] match no module of SD3Transformer2DModel"):
        build_policy(cfg, model=tiny_sd3, trainable=True)
    assert not hasattr(tiny_sd3.transformer, "peft_config")
    cfg = load_config(None, ["lora.targets=[to_q,transformer_blocks.0.attn.to_k]"])
    policy = build_policy(cfg, model=tiny_sd3, trainable=True)
    adapted = {n.split(".lora_A")[0] for n, _ in policy.model.transformer.named_parameters() if "lora_A" in n}
    assert adapted == {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"}


def test_a_bf16_models_saved_lora_reloads_in_fp32_as_it_trained(tmp_path):
    """flowrl trains the LoRA in fp32 on a bf16 denoiser; diffusers' loader would make it bf16 (other velocities
    than the run evaluated). load_saved_lora restores the file's fp32 weights: the same velocity, bit for bit."""
    from flowrl.policy.lora import load_saved_lora, restore_fp32_lora

    def bf16_model():
        return SD3Adapter(tiny_sd3_pipeline().to(torch.bfloat16), max_sequence_length=2, resolution=(8, 8))

    x, s, c, trained, file = _trained_and_saved(bf16_model(), tmp_path)
    plain = bf16_model()
    plain.pipe.load_lora_weights(str(tmp_path))  # diffusers alone: bf16 LoRA layers
    assert {p.dtype for n, p in plain.transformer.named_parameters() if "lora_" in n} == {torch.bfloat16}
    assert not torch.equal(plain.velocity(x, s, c), trained)
    fresh = bf16_model()
    load_saved_lora(fresh, tmp_path)
    lora = {n: p for n, p in fresh.transformer.named_parameters() if "lora_" in n}
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}
    assert {p.dtype for n, p in fresh.transformer.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    torch.testing.assert_close(fresh.velocity(x, s, c), trained, rtol=0, atol=0)
    assert not restore_fp32_lora(fresh.transformer, file, next(iter(fresh.transformer.peft_config)))  # already fp32


def test_a_frozen_copy_on_a_bf16_model_keeps_fp32_and_its_ema_the_small_steps():
    """DiffusionNFT's old / EMA, AWM's EMA and SAGE's adapters copy the fp32 LoRA; on a bf16 denoiser peft would make
    them bf16, where an EMA of decay 0.9 over steps of 3e-4 drifted 5e-3 from its float64 value. Now fp32: ~1e-7."""
    from flowrl.policy.lora import adapter_parameters, add_frozen_copy, soft_update, use_adapter

    model = SD3Adapter(tiny_sd3_pipeline().to(torch.bfloat16), max_sequence_length=2, resolution=(8, 8))
    params = add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    add_frozen_copy(model.transformer, "ema")
    ema = adapter_parameters(model.transformer, "ema")
    assert {p.dtype for p in ema.values()} == {torch.float32} and not any(p.requires_grad for p in ema.values())
    x, s, c = _inputs(model)
    with torch.no_grad():
        trained_velocity = model.velocity(x, s, c)
        with use_adapter(model.transformer, "ema"):
            torch.testing.assert_close(model.velocity(x, s, c), trained_velocity, rtol=0, atol=0)  # an exact copy
    reference = {k: v.double().clone() for k, v in adapter_parameters(model.transformer, "default").items()}
    for _ in range(50):
        with torch.no_grad():
            for p in params:
                p.add_(3e-4 * torch.sign(torch.randn(p.shape, generator=gen)) + 2e-4)
        soft_update(model.transformer, "ema", keep=0.9)
        trained = adapter_parameters(model.transformer, "default")
        reference = {k: 0.9 * v + 0.1 * trained[k].double() for k, v in reference.items()}
    ema = adapter_parameters(model.transformer, "ema")
    assert max((ema[k].double() - v).abs().max().item() for k, v in reference.items()) < 1e-6


def test_a_frozen_copy_adds_its_adapter_without_pefts_multiple_adapters_warning(tiny_sd3):
    import warnings

    from flowrl.policy.lora import add_frozen_copy

    add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=tiny_sd3.lora_target_modules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_frozen_copy(tiny_sd3.transformer, "ema")
    assert not [w for w in caught if "peft_config" in str(w.message)], [str(w.message) for w in caught]
    assert set(tiny_sd3.transformer.peft_config) == {"default", "ema"}


def test_a_second_saved_lora_loads_without_pefts_multiple_adapters_warning(tiny_sd3, tmp_path):
    """The demo and `flowrl eval` load several runs' LoRAs into one model, on purpose: no peft warning."""
    import warnings

    from flowrl.policy.lora import load_saved_lora

    _trained_and_saved(tiny_sd3, tmp_path)
    fresh = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_saved_lora(fresh, tmp_path)
        load_saved_lora(fresh, tmp_path)
    assert not [w for w in caught if "peft_config" in str(w.message)], [str(w.message) for w in caught]
    assert len(fresh.transformer.peft_config) == 2


def test_count_parameters_sums_the_elements_of_every_tensor() -> None:
    """count_parameters counts elements, not tensors: (2, 3) and (4,) hold 10."""
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    assert count_parameters(params) == 10


def test_soft_update_refuses_a_keep_factor_outside_zero_one_and_keeps_the_target_at_one(tiny_sd3: SD3Adapter) -> None:
    """keep must lie in [0, 1]: 1.5 and -0.1 raise one line; keep=1 leaves the target as it was, keep=0 copies."""
    from flowrl.policy.lora import adapter_parameters, soft_update

    params = _lora_with_old(tiny_sd3)
    old = {k: v.clone() for k, v in adapter_parameters(tiny_sd3.transformer, "old").items()}
    for p in params:
        p.data.add_(1.0)
    for keep in (1.5, -0.1):
        with pytest.raises(ValueError, match=rf"keep factor must be in \[0, 1\]; got {keep}"):
            soft_update(tiny_sd3.transformer, "old", keep=keep)
    assert all(torch.equal(v, old[k]) for k, v in adapter_parameters(tiny_sd3.transformer, "old").items())
    soft_update(tiny_sd3.transformer, "old", keep=1.0)
    assert all(torch.equal(v, old[k]) for k, v in adapter_parameters(tiny_sd3.transformer, "old").items())
    soft_update(tiny_sd3.transformer, "old", keep=0.0)
    new = adapter_parameters(tiny_sd3.transformer, "default")
    assert all(torch.equal(v, new[k]) for k, v in adapter_parameters(tiny_sd3.transformer, "old").items())


def test_a_lora_target_matches_a_whole_last_name_part_not_any_suffix(tiny_sd3: SD3Adapter) -> None:
    """peft matches a target as the module's name or a dotted suffix of it: "o_q" is not "to_q", "attn.to_q" is."""
    from flowrl.policy.lora import check_lora_targets

    with pytest.raises(ValueError, match=r"lora.targets \['o_q'\] match no module"):
        check_lora_targets(tiny_sd3.transformer, ["to_k", "o_q"])
    check_lora_targets(tiny_sd3.transformer, ["attn.to_q", "to_k", "transformer_blocks.0.attn.to_v"])


def test_find_lora_takes_a_run_folder_its_lora_folder_or_a_safetensors_file_only(tmp_path: Path) -> None:
    """find_lora: run folder -> its lora/, a folder with the file -> itself, a .safetensors -> itself; else one line."""
    from flowrl.policy.lora import LORA_FILE, find_lora

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / LORA_FILE).write_bytes(b"")
    assert find_lora(tmp_path) == tmp_path / "lora"
    assert find_lora(tmp_path / "lora") == tmp_path / "lora"
    assert find_lora(tmp_path / "lora" / LORA_FILE) == tmp_path / "lora" / LORA_FILE
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    for source in (other, tmp_path / "lora" / "missing.safetensors", tmp_path / "empty"):
        with pytest.raises(FileNotFoundError, match="no LoRA at"):
            find_lora(source)


def test_restore_fp32_lora_leaves_an_adapter_whose_file_holds_other_layers_as_loaded(tmp_path: Path) -> None:
    """A file with fewer fp32 weights than the loaded adapter has is not this adapter's file: nothing is cast or
    loaded, restore_fp32_lora returns False and the adapter stays in the bf16 diffusers gave it."""
    from safetensors.torch import load_file, save_file

    from flowrl.policy.lora import restore_fp32_lora

    def bf16_model() -> SD3Adapter:
        return SD3Adapter(tiny_sd3_pipeline().to(torch.bfloat16), max_sequence_length=2, resolution=(8, 8))

    *_, file = _trained_and_saved(bf16_model(), tmp_path)
    weights = load_file(str(file))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    part = tmp_path / "part.safetensors"
    save_file(dict(sorted(weights.items())[:2]), str(part))
    plain = bf16_model()
    plain.pipe.load_lora_weights(str(tmp_path), weight_name=file.name)
    adapter = next(iter(plain.transformer.peft_config))
    before = {n: p.clone() for n, p in plain.transformer.named_parameters() if "lora_" in n}
    assert not restore_fp32_lora(plain.transformer, part, adapter)
    after = {n: p for n, p in plain.transformer.named_parameters() if "lora_" in n}
    assert {p.dtype for p in after.values()} == {torch.bfloat16}
    assert all(torch.equal(after[n], v) for n, v in before.items())
    assert restore_fp32_lora(plain.transformer, file, adapter)  # the whole file: restored


def test_a_saved_lora_holding_nan_or_inf_is_refused_naming_the_file_and_tensor(tiny_sd3, tmp_path: Path) -> None:
    """diffusers loads a LoRA of NaN bytes as is (every sampled image NaN); flowrl refuses it before loading."""
    from safetensors.torch import load_file, save_file

    from flowrl.policy.lora import adapter_names, load_saved_lora

    *_, file = _trained_and_saved(tiny_sd3, tmp_path)
    weights = load_file(str(file))
    key = sorted(weights)[1]
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, str(file))
    fresh = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    with pytest.raises(ValueError) as info:
        load_saved_lora(fresh, tmp_path)
    assert str(info.value).startswith(f"LoRA {file}: tensor '{key}' holds NaN or inf; the file is corrupt: ")
    assert "\n" not in str(info.value) and not adapter_names(fresh.transformer)


def test_load_lora_state_refuses_an_infinite_weight(tiny_sd3) -> None:
    add_lora(tiny_sd3.transformer, rank=4, alpha=8, targets=tiny_sd3.lora_target_modules)
    state = lora_state_dict(tiny_sd3.transformer)
    key = sorted(state)[0]
    state[key][0] = float("inf")
    with pytest.raises(ValueError, match=f"LoRA checkpoint \\(adapter 'default'\\): tensor '{key}' holds NaN or inf"):
        load_lora_state(tiny_sd3.transformer, state)
