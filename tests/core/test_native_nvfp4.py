"""The native NVFP4 explore path (torchao) against our NVFP4 reference, on the CPU.

``precision="native_nvfp4"`` hands the chosen Linear layers to torchao's
``NVFP4DynamicActivationNVFP4WeightConfig``; its matmul needs a Blackwell GPU, but the weight encoding
torchao stores is computed in torch and can be read back here. These tests pin that it is the format of
:mod:`flowrl.kernels.nvfp4` (the emulation every Sol-RL figure on the CPU comes from), bit for bit, and
name the two places where torchao's rounding differs. They need torchao (``pip install
'flowrl[torchao]'``); README command (b) runs them in its torchao step (marker ``torchao``), with torchao
put on the path for that step only (importing it makes ``import diffusers`` print load warnings).

Reference: NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", 2025; Li et
al., "FP4 Explore, BF16 Train" (Sol-RL), 2026, §3.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import torch
from test_precision import TARGETS, merged_weight, perturb
from torch import nn

from bench.nvfp4_torchao import at_ties, torchao_codes, torchao_encode
from flowrl.kernels import nvfp4_dequantize, nvfp4_quantize, unpack_fp4
from flowrl.policy import precision
from flowrl.policy.lora import add_lora
from flowrl.policy.precision import build_explore, refresh

pytestmark = pytest.mark.torchao

ROOT = Path(__file__).resolve().parents[2]
E4M3_SMALLEST_NORMAL = 2.0**-6


@pytest.fixture
def ao():
    """torchao's NVFP4 tensor module (the test needs torchao; command (b) puts it on the path)."""
    pytest.importorskip("torchao", reason="needs torchao: README command (b) runs this file in its torchao step")
    from torchao.prototype.mx_formats import nvfp4_tensor

    return nvfp4_tensor


DATA = {
    "normal": lambda g: torch.randn(256, 512, generator=g),
    "normal_small": lambda g: torch.randn(256, 512, generator=g) * 0.02,
    "outlier_channel": lambda g: torch.randn(256, 512, generator=g) * torch.where(torch.arange(512) == 7, 300.0, 1.0),
    "bf16": lambda g: torch.randn(256, 512, generator=g).to(torch.bfloat16),
}


def codes_differing_only_at_ties(theirs, w: torch.Tensor) -> torch.Tensor:
    """Check torchao's NVFP4 of ``w`` against our reference: tensor scale and block scales bit for bit, codes
    equal off the E2M1 ties; returns where the codes differ (``w.shape`` bool, all at ties)."""
    ours = nvfp4_quantize(w, backend="torch")
    assert torch.equal(theirs.per_tensor_scale.view(torch.int32), ours.tensor_scale.view(torch.int32))
    our_scales = ours.scales.float() * ours.tensor_scale
    assert torch.equal(theirs.get_hp_scales().view(torch.int32), our_scales.view(torch.int32))
    differ = torchao_codes(theirs) != unpack_fp4(ours.codes).reshape(w.shape)
    assert not (differ & ~at_ties(w, our_scales)).any()
    return differ


@pytest.mark.parametrize("kind", sorted(DATA))
def test_torchao_stores_our_tensor_scale_block_scales_and_codes(ao, kind: str) -> None:
    """Same tensor scale and block scales bit for bit; the same codes but at exact E2M1 ties.

    torchao multiplies by a reciprocal of the block scale where the reference divides, so at an exact
    tie (frequent with bf16 inputs, whose few mantissa bits land on 0.25, 0.75, ... often) the two may
    round to different neighbours; nowhere else.
    """
    w = DATA[kind](torch.Generator().manual_seed(1))
    differ = codes_differing_only_at_ties(torchao_encode(w, swizzled=True), w)
    if kind == "bf16":  # the ties are really there and really differ: the exemption is not vacuous
        assert differ.sum() > 0


def test_torchao_clamps_tiny_block_scales_to_e4m3s_smallest_normal(ao) -> None:
    """A block whose scale falls below E4M3's smallest normal (2^-6 of the tensor scale) is where the two part.

    With one entry 1e5 among N(0, 1) values, a typical block's scale is ~3 / (6 * 1e5 / 2688) ~ 0.013 tensor
    scales: the reference keeps it as an E4M3 subnormal, torchao raises it to 2^-6 (coarser codes). Every other
    block scale is equal, and the reference's error is the smaller one.
    """
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 1e5
    ours, theirs = nvfp4_quantize(w, backend="torch"), torchao_encode(w, swizzled=True)
    s, q_ours, theirs_scales = ours.tensor_scale, ours.scales.float(), theirs.get_hp_scales()
    subnormal = q_ours < E4M3_SMALLEST_NORMAL
    assert subnormal.float().mean() > 0.9
    assert torch.all(theirs_scales[subnormal] == E4M3_SMALLEST_NORMAL * s)
    assert torch.equal(theirs_scales[~subnormal], (q_ours * s)[~subnormal])

    def error(x_hat: torch.Tensor) -> float:
        return float((x_hat - w).norm() / w.norm())

    assert error(nvfp4_dequantize(ours, backend="torch")) < error(theirs.dequantize(torch.float32))


@pytest.fixture
def blackwell_gates_lifted(ao, monkeypatch):
    """Lift the two "is this a Blackwell GPU" checks, ours and torchao's, and nothing else.

    ``native_nvfp4`` refuses any device but a compute-capability-10 GPU (ours: tested in
    tests/core/test_precision.py; torchao: an assert in its config handler). Past those checks the layer
    selection, the LoRA merge, torchao's weight encoding and the refresh run on the CPU as on the GPU; only
    the forward (an FP4 ``torch._scaled_mm``) needs the hardware, and no test here calls it.
    """
    from torchao.prototype.mx_formats import inference_workflow

    monkeypatch.setattr(precision, "_check_native_nvfp4", lambda device: None)
    monkeypatch.setattr(inference_workflow, "is_sm_at_least_100", lambda: True)


def assert_encodes(ao, layer: nn.Linear, weight: torch.Tensor) -> None:
    """``layer`` holds torchao's NVFP4 of ``weight``, with our reference's codes and scales."""
    assert isinstance(layer.weight, ao.NVFP4Tensor)
    codes_differing_only_at_ties(layer.weight, weight)


def test_native_nvfp4_encodes_the_chosen_layers_of_the_merged_policy_and_refresh_re_encodes_them(
    ao, blackwell_gates_lifted, tiny_sd3
) -> None:
    """On the real tiny SD3 transformer with a peft LoRA: the chosen layers hold the NVFP4 of W + B A s.

    The default rule's layers, and no other, become torchao NVFP4 tensors (embedders and final layers stay
    fp32); after a training step changes the LoRA, ``refresh`` re-encodes exactly the LoRA layers from the
    new merged weights, as a fresh build would.
    """
    transformer = tiny_sd3.transformer
    params = add_lora(transformer, rank=4, alpha=8, targets=TARGETS)
    explore = build_explore(transformer, "native_nvfp4")
    assert explore.quantised and not any("embed" in n or n == "proj_out" for n in explore.quantised)
    for name, layer in explore.module.named_modules():
        if isinstance(layer, nn.Linear) and name not in explore.quantised:
            assert type(layer.weight) is nn.Parameter  # kept at the policy's precision
    perturb(params, seed=1)  # a training step's change of the LoRA
    refresh(explore, transformer)
    fresh = build_explore(transformer, "native_nvfp4")
    for name in explore.quantised:
        layer, refreshed = transformer.get_submodule(name), explore.module.get_submodule(name)
        weight = merged_weight(transformer, name) if hasattr(layer, "lora_A") else layer.weight.detach()
        assert_encodes(ao, refreshed, weight)
        assert torch.equal(refreshed.weight.qdata, fresh.module.get_submodule(name).weight.qdata)


def test_native_nvfp4_keeps_layers_whose_dims_are_not_multiples_of_16_at_full_precision(
    ao, blackwell_gates_lifted
) -> None:
    """torchao raises on such a weight; the explore copy leaves it at the policy's precision instead."""
    net = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 32))
    explore = build_explore(net, "native_nvfp4")
    assert explore.quantised == ("0",)
    assert isinstance(explore.module[0].weight, ao.NVFP4Tensor)
    assert type(explore.module[2].weight) is nn.Parameter and type(explore.module[4].weight) is nn.Parameter
    with pytest.raises(RuntimeError, match="divisible by 16"):  # what the filter spares the user
        precision._native_nvfp4(nn.Sequential(nn.Linear(48, 40)), ("0",))


def test_native_nvfp4_quantises_activations_in_torch_when_mslk_is_not_installed(ao, blackwell_gates_lifted) -> None:
    """torchao's default quantises activations with a Triton kernel from the separate ``mslk`` package, imported
    at the first forward: without it every explore forward on a Blackwell GPU would fail there. The copy asks
    for torchao's torch quantiser instead, so on this CPU the forward gets past the activations and stops only at
    the FP4 matmul, which needs the hardware.
    """
    import importlib.util

    if importlib.util.find_spec("mslk") is not None:
        pytest.skip("mslk is installed here: the Triton quantiser is the one to use")
    explore = build_explore(nn.Sequential(nn.Linear(64, 32)).to(torch.bfloat16), "native_nvfp4")
    assert explore.module[0].weight.act_quant_kwargs.use_triton_kernel is False
    with pytest.raises(Exception) as failure:  # torch._scaled_mm refuses FP4 operands off a Blackwell GPU
        explore.module(torch.randn(5, 64, dtype=torch.bfloat16))
    assert "mslk" not in str(failure.value)


def test_the_tested_torchao_is_the_pinned_one(ao) -> None:
    """pyproject's ``torchao`` extra pins the version these tests ran against."""
    import torchao

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torchao"]
    pinned = re.fullmatch(r"torchao==(\S+)", extra[0])
    assert pinned and pinned.group(1) == torchao.__version__
