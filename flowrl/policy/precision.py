"""Rollout precision: a frozen, LoRA-merged, low-precision copy of the sampling policy (Sol-RL's explore model).

Sol-RL explores with a cheap copy of the current sampling policy: its LoRA adapter merged into the
base weights, the Linear layers quantised (NVFP4 on Blackwell), never trained. Only the seeds and
rewards of its samples are kept; the chosen seeds are regenerated at full precision for training.
This module builds that copy for one transformer and keeps it in sync; choosing seeds and wiring
it into the trainer live elsewhere.

Precisions (``PRECISIONS``):

- ``"fp32"``, ``"bf16"``: the whole copy cast; floating inputs of rank >= 2 are cast in and
  outputs cast back; timesteps (``timestep``, 1-d, or 2-d per token as Wan2.2-TI2V's) stay as given,
  as diffusers pipelines pass them.
- ``"nvfp4"``: NVFP4 emulated: each selected Linear weight is quantise-dequantised through
  :func:`flowrl.kernels.nvfp4_fake_quantize` (blocks of 16 along ``in_features``); with
  ``activations=True`` a forward pre-hook does the same to its input (W4A4 numerics).
- ``"fp8_e4m3"``: FP8 E4M3 with per-tensor or per-row (output channel) amax scales. Emulated
  (fake-quantised, any device) by default; ``emulate=False`` runs ``torch._scaled_mm`` on CUDA
  with compute capability >= 8.9 (activations scaled per tensor / per row dynamically; layers
  whose dims are not multiples of 16 stay full precision). See :mod:`flowrl.policy.fp8`.
- ``"int8_dynamic"``: ``torch.ao`` dynamic int8 quantisation of the selected layers (CPU, fp32).
- ``"native_nvfp4"``: torchao's NVFP4 W4A4 on a Blackwell GPU (compute capability >= 10.0); layers
  whose dims are not multiples of 16 stay full precision (torchao refuses them).

Which layers (``QuantRule``): like Sol-RL's ``replace_linear_with_te``, embedders and the final
layers stay at the policy's precision (name patterns, fnmatch on the module's dotted name), and
so do small layers, ``max(in_features, out_features) <= min_features`` (Sol-RL: 1000 for FLUX,
2240 for SANA). The default patterns cover SD3, FLUX, Wan and Qwen-Image. Non-Linear layers
(norms, convolutions) are never quantised.

References:
    Li et al., "FP4 Explore, BF16 Train: Diffusion Reinforcement Learning via Efficient Rollout
    Scaling" (Sol-RL), arXiv 2604.06916, 2026, §3 and its code in NVlabs/Sana (train_scripts/sol_rl).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import warnings
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..kernels import Backend, nvfp4_fake_quantize
from ..models.adapter import ModelAdapter, module_device
from .build import Policy
from .fp8 import ScaledMMLinear, check_scaled_mm, fp8_fake_quantize
from .lora import adapter_names
from .shared_input import SharedInput

Precision = Literal["fp32", "bf16", "nvfp4", "fp8_e4m3", "int8_dynamic", "native_nvfp4"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "nvfp4", "fp8_e4m3", "int8_dynamic", "native_nvfp4")
QUANTISED = ("nvfp4", "fp8_e4m3", "int8_dynamic", "native_nvfp4")  # the ones a QuantRule applies to
# embedders and output layers of SD3 / FLUX (x_, context_, time_text_embed, norm_out, proj_out),
# Wan (condition_embedder, proj_out) and Qwen-Image (img_in, txt_in)
DEFAULT_SKIP = ("*embed*", "norm_out*", "proj_out", "img_in", "txt_in")


@dataclass(frozen=True)
class QuantRule:
    """Which ``nn.Linear`` layers an explore model quantises.

    Attributes:
        skip: fnmatch patterns on the dotted module name; a match stays at full precision.
        min_features: a layer with ``max(in_features, out_features) <= min_features`` stays full
            precision (Sol-RL's ``nvfp4_min_dim``: 1000 for FLUX, 2240 for SANA; the default 0
            quantises every size, as the small embedded model needs).
    """

    skip: tuple[str, ...] = DEFAULT_SKIP
    min_features: int = 0

    def selects(self, name: str, layer: nn.Module) -> bool:
        """Whether ``layer`` (at ``name``) is quantised."""
        if not isinstance(layer, nn.Linear) or any(fnmatch(name, pattern) for pattern in self.skip):
            return False
        return max(layer.in_features, layer.out_features) > self.min_features


@dataclass
class ExploreModel:
    """A frozen low-precision copy of a policy transformer with one LoRA adapter merged in.

    Attributes:
        module: the copy; call it as the transformer. ``requires_grad`` is False everywhere.
        precision: one of ``PRECISIONS``.
        adapter: the LoRA adapter merged in (e.g. "default", or DiffusionNFT's sampling "old").
        quantised: dotted names of the Linear layers held at ``precision``.
        rule: the layer rule used.
        activations: whether inputs of the quantised layers are quantised too.
        scaling: fp8 scale granularity, "tensor" or "row".
        emulate: whether a quantised precision is emulated (fake-quantised weights).
        backend: kernel backend of the NVFP4 quantiser.
        fuse_under_compile: fp8 on ``torch._scaled_mm`` only: its layers trace the torch quantiser
            under ``torch.compile`` (:class:`~flowrl.policy.fp8.ScaledMMLinear`), also after a refresh.
        shared_input: where the copy quantises activations (``activations=True``, or fp8 on
            ``torch._scaled_mm``), the memo that lets sibling layers reading one tensor (q / k / v)
            quantise it once (:mod:`flowrl.policy.shared_input`); None otherwise or when turned off.
        fast_accum: fp8 on ``torch._scaled_mm`` only: its GEMMs use Hopper's fast accumulation
            (:class:`~flowrl.policy.fp8.ScaledMMLinear`), also after a refresh.
    """

    module: nn.Module
    precision: str
    adapter: str
    quantised: tuple[str, ...]
    rule: QuantRule
    activations: bool
    scaling: str
    emulate: bool
    backend: Backend
    fuse_under_compile: bool = False
    shared_input: SharedInput | None = None
    fast_accum: bool = False


def build_explore(
    policy: Policy | ModelAdapter | nn.Module,
    precision: Precision,
    *,
    adapter: str = "default",
    rule: QuantRule | None = None,
    activations: bool = False,
    scaling: Literal["tensor", "row"] = "tensor",
    emulate: bool | None = None,
    backend: Backend = "auto",
    fuse_under_compile: bool = False,
    share_inputs: bool = True,
    fast_accum: bool = False,
) -> ExploreModel:
    """Deep-copy the policy's transformer, merge one LoRA adapter (peft ``merge``) and set its precision.

    Args:
        policy: a :class:`~flowrl.policy.build.Policy`, a
            :class:`~flowrl.models.adapter.ModelAdapter` or the transformer ``nn.Module`` itself.
        precision: one of ``PRECISIONS`` (module docstring).
        adapter: the LoRA adapter to merge; ignored when the transformer has no LoRA.
        rule: which Linear layers to quantise; ``QuantRule()`` by default.
        activations: quantise the inputs of the quantised layers too ("nvfp4", emulated "fp8_e4m3").
        scaling: "tensor" or "row" amax scales for "fp8_e4m3".
        emulate: "fp8_e4m3" only: None emulates off CUDA and uses ``torch._scaled_mm`` on CUDA.
        backend: NVFP4 kernel backend ("auto": Triton on CUDA, the torch reference on CPU).
        fuse_under_compile: "fp8_e4m3" on ``torch._scaled_mm``: under ``torch.compile`` quantise
            activations with torch operators the compiler can fuse (``ScaledMMLinear``).
        share_inputs: where activations are quantised, quantise a tensor that several layers read
            (q / k / v) once and hand the result to each (eager calls; the same output bit for bit).
        fast_accum: "fp8_e4m3" on ``torch._scaled_mm``: accumulate the FP8 GEMMs in the tensor cores'
            fast accumulator (``use_fast_accum``; off by default until measured on a GPU).

    Returns:
        The :class:`ExploreModel`, in eval mode.

    Raises:
        ValueError: an unknown precision or adapter, an option the precision does not take, a rule
            that selects no layer, or a format this machine cannot run (one line naming the fix).
        TypeError: ``policy`` holds no transformer module.
    """
    rule = rule or QuantRule()
    transformer = policy_transformer(policy)
    emulate = _check_request(precision, transformer, activations, scaling, emulate, fuse_under_compile, fast_accum)
    module = copy.deepcopy(transformer)
    _merge_lora(module, adapter)
    module.requires_grad_(False).eval()
    chosen = tuple(n for n, m in module.named_modules() if rule.selects(n, m)) if precision in QUANTISED else ()
    if (precision == "fp8_e4m3" and not emulate) or precision == "native_nvfp4":
        # torch._scaled_mm and torchao's NVFP4 (which raises otherwise) need both weight dims divisible by 16
        chosen = tuple(n for n in chosen if not any(d % 16 for d in module.get_submodule(n).weight.shape))
    if precision in QUANTISED and not chosen:
        raise ValueError(f"QuantRule {rule} selects no Linear layer for precision={precision!r}; lower min_features")
    quantises_inputs = activations or (precision == "fp8_e4m3" and not emulate)
    explore = ExploreModel(
        module,
        precision,
        adapter,
        chosen,
        rule,
        activations,
        scaling,
        emulate,
        backend,
        fuse_under_compile,
        SharedInput() if share_inputs and quantises_inputs else None,
        fast_accum,
    )
    _apply_precision(explore, io_dtype=_float_dtype(transformer))
    if explore.shared_input is not None:  # the memo's last activation is not kept past the forward
        module.register_forward_hook(_clear_after_forward(explore.shared_input))
    return explore


@torch.no_grad()
def refresh(explore: ExploreModel, policy: Policy | ModelAdapter | nn.Module) -> None:
    """Re-merge the policy's current LoRA weights into ``explore`` in place (no new deep copy).

    Only LoRA-adapted layers are rewritten: the base weights are frozen during training
    (:func:`flowrl.policy.lora.add_lora`). Each is ``W + B A * scale`` as peft's merge computes
    it, then brought to the explore precision exactly as :func:`build_explore` does, so a refreshed
    model equals a freshly built one bit for bit.

    Args:
        explore: from :func:`build_explore`.
        policy: the same kind of object ``build_explore`` took, with newer LoRA weights.

    Raises:
        ValueError: the policy lacks ``explore.adapter``, or uses a LoRA variant refresh cannot merge.
    """
    layers = _lora_layers(policy_transformer(policy), explore.adapter)
    for name, layer in layers:
        if explore.adapter not in layer.lora_A:
            continue
        if layer.lora_bias.get(explore.adapter) or explore.adapter in getattr(layer, "lora_variant", {}):
            raise ValueError(f"refresh merges plain LoRA only; {name} has a bias or DoRA term: call build_explore")
        weight = layer.get_base_layer().weight.detach().clone()
        weight += layer.get_delta_weight(explore.adapter)  # as peft's merge: base.weight.data += delta
        _load_weight(explore, name, weight)


def policy_transformer(policy: Policy | ModelAdapter | nn.Module) -> nn.Module:
    """The transformer of a :class:`Policy`, of a :class:`ModelAdapter`, or the module itself.

    Raises:
        TypeError: ``policy`` is none of the three.
    """
    if isinstance(policy, nn.Module):
        return policy
    if isinstance(policy, Policy):
        return policy.model.transformer
    if isinstance(policy, ModelAdapter):
        return policy.transformer
    raise TypeError(f"expected a Policy, a model adapter or an nn.Module; got {type(policy).__name__}")


# --------------------------------------------------------------------------- checks and merging


def _check_request(
    precision: str,
    transformer: nn.Module,
    activations: bool,
    scaling: str,
    emulate: bool | None,
    fuse_under_compile: bool = False,
    fast_accum: bool = False,
) -> bool:
    """Validate the options before any copy; returns the resolved ``emulate``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if activations and precision not in ("nvfp4", "fp8_e4m3"):
        raise ValueError(f"activations=True applies to 'nvfp4' and 'fp8_e4m3'; got precision={precision!r}")
    if scaling not in ("tensor", "row"):
        raise ValueError(f"scaling must be 'tensor' or 'row'; got {scaling!r}")
    emulate = check_explore_device(
        precision, module_device(transformer), _float_dtype(transformer), activations=activations, emulate=emulate
    )
    for name, value in (("fuse_under_compile", fuse_under_compile), ("fast_accum", fast_accum)):
        if value and (precision != "fp8_e4m3" or emulate):
            raise ValueError(
                f"{name} applies to fp8_e4m3 on torch._scaled_mm (CUDA, emulate=False); "
                f"got precision={precision!r}, emulate={emulate}"
            )
    return emulate if precision == "fp8_e4m3" else precision == "nvfp4"


def check_explore_device(
    precision: str, device: torch.device, dtype: torch.dtype, *, activations: bool = False, emulate: bool | None = None
) -> bool | None:
    """The checks of an explore precision that need only the policy's device and dtype, not the model.

    :func:`build_explore` runs them on the policy; :func:`flowrl.resources.check_machine` runs them on the
    config (``solrl.precision``, ``model.device``, ``model.dtype``) before the model loads, so a precision this
    GPU cannot run (``native_nvfp4`` on a Hopper) is one line at ``flowrl train --check`` and at the start,
    not after minutes of loading a large model.

    Args:
        precision: one of ``PRECISIONS``.
        device: the policy's device.
        dtype: the policy's floating dtype.
        activations: quantise the quantised layers' inputs too.
        emulate: "fp8_e4m3" only: None emulates off CUDA and uses ``torch._scaled_mm`` on CUDA.

    Returns:
        For "fp8_e4m3" the resolved ``emulate``; None for the other precisions.

    Raises:
        ValueError: the precision cannot run on this device or dtype (one line with the fix).
    """
    if precision == "native_nvfp4":
        _check_native_nvfp4(device)
    if precision == "int8_dynamic" and device.type != "cpu":
        raise ValueError(
            f"int8_dynamic is torch.ao's CPU path; the policy is on {device}; "
            "use bf16 (fewer explore steps) or fp8_e4m3"
        )
    if precision == "int8_dynamic" and dtype != torch.float32:
        raise ValueError(f"int8_dynamic quantises fp32 weights; the policy is {dtype}; load it in fp32")
    if precision != "fp8_e4m3":
        return None
    emulate = device.type != "cuda" if emulate is None else emulate
    if not emulate:
        check_scaled_mm(device, activations)
    return emulate


def _check_native_nvfp4(device: torch.device) -> None:
    fix = (
        "use precision='bf16' on a Hopper or Ada GPU (its gain is the fewer explore steps; 'fp8_e4m3' ranks seeds "
        "alike but sampled SD3.5-M at 0.91x bf16's rate on an H100, docs/solrl.md), or 'nvfp4' (emulated), instead"
    )
    if device.type != "cuda":
        raise ValueError(
            f"native_nvfp4 needs a Blackwell GPU (compute capability >= 10.0); the policy is on {device}; {fix}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        raise ValueError(
            f"native_nvfp4 needs compute capability >= 10.0 (Blackwell); this GPU is {major}.{minor}; {fix}"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"native_nvfp4 needs torchao (pip install 'flowrl[torchao]'); it is not installed; {fix}")


def _merge_lora(module: nn.Module, adapter: str) -> None:
    """Merge ``adapter`` into the base layers with peft and put the base layers back in their place."""
    for name, layer in _lora_layers(module, adapter):
        layer.merge(adapter_names=[adapter])
        _set_submodule(module, name, layer.get_base_layer())
    if hasattr(module, "peft_config"):
        module.unload_lora()  # diffusers: no LoRA layers are left; this drops the adapters' config


def _lora_layers(module: nn.Module, adapter: str) -> list[tuple[str, Any]]:
    """The peft LoRA layers of ``module``, after checking ``adapter`` exists."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)]
    names = adapter_names(module)
    if layers and adapter not in names:
        raise ValueError(f"the policy has no LoRA adapter {adapter!r}; it has {names}")
    return layers


def _set_submodule(root: nn.Module, name: str, child: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, child)


def _float_dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


# --------------------------------------------------------------------------- precisions


def _apply_precision(explore: ExploreModel, io_dtype: torch.dtype) -> None:
    precision, module = explore.precision, explore.module
    if precision in ("fp32", "bf16"):
        dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        if dtype != io_dtype:
            nn.Module.to(module, dtype)  # not diffusers' ModelMixin.to, which warns about casting after loading
            _cast_io(module, dtype, io_dtype)
        return
    if precision == "native_nvfp4":
        _native_nvfp4(module, explore.quantised)
        return
    for name in explore.quantised:
        linear = module.get_submodule(name)
        _load_weight(explore, name, linear.weight.detach())
        if explore.activations:
            linear.register_forward_pre_hook(_input_quantiser(explore))


def _load_weight(explore: ExploreModel, name: str, weight: Tensor) -> None:
    """Write a merged full-precision weight into ``explore`` at ``name``, at the explore precision."""
    target = explore.module.get_submodule(name)
    if name not in explore.quantised or explore.precision in ("fp32", "bf16"):
        target.weight.copy_(weight)
    elif explore.precision == "nvfp4":
        target.weight.copy_(nvfp4_fake_quantize(weight, backend=explore.backend))
    elif explore.precision == "fp8_e4m3" and explore.emulate:
        target.weight.copy_(fp8_fake_quantize(weight, explore.scaling))
    elif explore.precision == "fp8_e4m3":
        layer = ScaledMMLinear(
            _as_linear(target, weight),
            explore.scaling,
            fuse_under_compile=explore.fuse_under_compile,
            shared_input=explore.shared_input,
            fast_accum=explore.fast_accum,
        )
        _set_submodule(explore.module, name, layer)
    elif explore.precision == "int8_dynamic":
        _set_submodule(explore.module, name, _int8_dynamic(_as_linear(target, weight)))
    else:  # native_nvfp4
        _set_submodule(explore.module, name, _native_nvfp4(_as_linear(target, weight), ("",)))


def _as_linear(target: nn.Module, weight: Tensor) -> nn.Linear:
    """A plain Linear holding ``weight`` and ``target``'s bias (for the module-replacing precisions)."""
    bias = target.bias() if callable(getattr(target, "bias", None)) else getattr(target, "bias", None)
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    return linear.requires_grad_(False)


def _clear_after_forward(memo: SharedInput) -> Any:
    def hook(*_: Any) -> None:
        if not torch.compiler.is_compiling():  # compiled code never fills the memo
            memo.clear()

    return hook


def _input_quantiser(explore: ExploreModel) -> Any:
    def quantize(x: Tensor) -> Tensor:
        if explore.precision == "nvfp4":
            return nvfp4_fake_quantize(x, backend=explore.backend)
        return fp8_fake_quantize(x, explore.scaling)  # per row or per tensor, as ScaledMMLinear quantises inputs

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        shared = explore.shared_input
        x = quantize(args[0]) if shared is None else shared.get(args[0], explore.precision, quantize)
        return (x, *args[1:])

    return hook


def _int8_dynamic(linear: nn.Linear) -> nn.Module:
    """torch.ao's dynamic int8 Linear (per-tensor symmetric weights, activations per call)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import default_dynamic_qconfig

    linear.qconfig = default_dynamic_qconfig
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.simplefilter("ignore")
        return DynamicLinear.from_float(linear)


def _native_nvfp4(module: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Quantise the named Linear layers to NVFP4 W4A4 with torchao (Blackwell).

    Their weights become torchao ``NVFP4Tensor`` objects in the format of :mod:`flowrl.kernels.nvfp4`: the same
    codes, block scales and tensor scale as our reference (``tests/core/test_native_nvfp4.py``, run on the CPU
    with torchao's own sm100 check lifted, since the matmul itself needs Blackwell), except that torchao
    clamps block scales to E4M3's smallest normal (2^-6, ours its smallest subnormal 2^-9) and multiplies by a
    reciprocal (its codes may differ at exact E2M1 ties). Activations are quantised per call on the GPU, by
    torchao's Triton kernel where its ``mslk`` package is installed (``pip install mslk-cuda``) and in torch
    otherwise: torchao's default would import ``mslk`` at the first forward and fail there without it.
    """
    from torchao.quantization import quantize_

    selected = set(names)
    quantize_(module, _native_nvfp4_config(), filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn in selected)
    return module


@functools.cache
def _native_nvfp4_config() -> Any:
    """The NVFP4 W4A4 config handed to torchao, built once per process (a refresh re-encodes layer by layer)."""
    try:
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig as Config
    except ImportError as err:
        raise ValueError(
            "native_nvfp4 needs torchao with NVFP4DynamicActivationNVFP4WeightConfig; upgrade torchao"
        ) from err
    return Config(use_triton_kernel=importlib.util.find_spec("mslk") is not None)


UNCAST_INPUTS = ("timestep",)
"""Keyword inputs a cast copy receives as given: diffusers pipelines pass timesteps in fp32 (Wan2.2-TI2V's are
(B, tokens), which a bf16 cast would round: 937.5 to 936)."""


def _cast_io(module: nn.Module, dtype: torch.dtype, io_dtype: torch.dtype) -> None:
    """Cast floating inputs of rank >= 2 (but :data:`UNCAST_INPUTS`) to ``dtype``, floating outputs to ``io_dtype``."""

    def cast(value: Any, to: torch.dtype, min_rank: int) -> Any:
        if isinstance(value, Tensor):
            return value.to(to) if value.is_floating_point() and value.ndim >= min_rank else value
        if isinstance(value, (tuple, list)):
            return type(value)(cast(v, to, min_rank) for v in value)
        if isinstance(value, dict):
            for key in list(value):
                value[key] = cast(value[key], to, min_rank)
        return value

    def cast_inputs(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        kept = {k: kwargs.pop(k) for k in UNCAST_INPUTS if k in kwargs}
        return cast(args, dtype, 2), {**cast(kwargs, dtype, 2), **kept}

    module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: cast(out, io_dtype, 0))
