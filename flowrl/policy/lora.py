"""LoRA on the denoiser through peft, saved in the layout diffusers' ``load_lora_weights`` reads."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from ..models.adapter import ModelAdapter

LORA_FILE = "pytorch_lora_weights.safetensors"
LORA_FILES = (LORA_FILE, "pytorch_lora_weights_transformer_2.safetensors")  # Wan2.2 writes one file per expert


def find_lora(source: str | Path) -> Path:
    """The saved LoRA for a run folder, its ``lora/`` folder or a ``.safetensors`` file.

    Args:
        source: a run folder (its ``lora/`` is used), a folder holding ``pytorch_lora_weights*.safetensors``
            (as ``ModelAdapter.save_lora`` writes it), or one such file.

    Returns:
        The folder holding the LoRA file(s), or the file itself; what ``ModelAdapter.load_lora`` takes.

    Raises:
        FileNotFoundError: nothing LoRA-like at ``source`` (one line).
    """
    path = Path(source)
    for candidate in (path / "lora", path):
        if any((candidate / name).is_file() for name in LORA_FILES):
            return candidate
    if path.is_file() and path.suffix == ".safetensors":
        return path
    raise FileNotFoundError(f"no LoRA at {source}; pass a run folder, its lora/ folder or a {LORA_FILE} file")


DENOISERS = ("transformer", "transformer_2")  # diffusers pipeline components that may hold a LoRA


def adapted_denoisers(pipe: Any) -> list[str]:
    """The pipeline's denoiser components that hold a LoRA (``transformer``, Wan2.2's ``transformer_2``)."""
    return [c for c in DENOISERS if getattr(getattr(pipe, c, None), "peft_config", None)]


def load_saved_lora(model: ModelAdapter, source: str | Path) -> Path:
    """Load a saved LoRA (see :func:`find_lora`) into ``model`` (a ``ModelAdapter``) and check that it took.

    diffusers' loader passes over a file whose keys name no module of this denoiser (e.g. a training
    checkpoint's ``lora.safetensors``, keyed for peft rather than the pipeline), which would leave the base
    model in place without a word.

    Returns:
        The LoRA folder or file loaded.

    Raises:
        FileNotFoundError: nothing LoRA-like at ``source``.
        ValueError: the file is unreadable, not a LoRA of this model, holds NaN or inf, or loaded no weights
            (one line).
    """
    path = find_lora(source)
    fix = "pass a run folder, its lora/ folder or a pytorch_lora_weights.safetensors that flowrl wrote for this model"
    for file in _lora_files(path):
        check_finite_lora(file)
    before = {c: set(adapter_names(m)) for c, m in _denoiser_components(model.pipe).items()}
    try:
        with _quiet_failed_load():
            model.load_lora(path)
    except FileNotFoundError:
        raise
    except (OSError, IndexError, KeyError, ValueError, RuntimeError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"LoRA {path}: not a LoRA this model can load ({detail}); {fix}") from None
    if not adapted_denoisers(model.pipe):
        raise ValueError(f"LoRA {path}: none of its weights name a layer of this model's denoiser; {fix}")
    for file in _lora_files(path):
        component = "transformer_2" if file.name == LORA_FILES[1] else "transformer"
        module = getattr(model.pipe, component, None)
        added = set(adapter_names(module)) - before.get(component, set()) if module is not None else set()
        if len(added) == 1:
            adapter = added.pop()
            check_complete_lora(module, file, adapter, fix)
            restore_fp32_lora(module, file, adapter)
    return path


def check_complete_lora(transformer: nn.Module, file: Path, adapter: str, fix: str) -> None:
    """Refuse a LoRA file that left some of the adapter diffusers built from it without weights.

    diffusers builds the adapter's layers from the file's keys and then loads what the file holds: a file with
    one tensor deleted (``to_v.lora_B`` without its weight) leaves that weight on the ``meta`` device or at its
    random initialisation, and the model samples different images on every load, without a word.

    Args:
        transformer: the denoiser the LoRA was loaded into.
        file: the LoRA file.
        adapter: the adapter the load added.
        fix: what to pass instead, for the message.

    Raises:
        ValueError: one line naming the file, how many weights are missing and the first one.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    weights = get_peft_model_state_dict(transformer, adapter_name=adapter)
    with safe_open(str(file), framework="pt") as handle:
        keys = set(handle.keys())
    held = keys | {key.split(".", 1)[1] for key in keys if "." in key}  # "transformer." + the peft key
    missing = [key for key, weight in weights.items() if weight.is_meta]
    if not missing and any(key in held for key in weights):  # the file is in flowrl's layout: name what it lacks
        missing = [key for key in weights if key not in held]
    if missing:
        raise ValueError(
            f"LoRA {file}: {len(missing)} of the {len(weights)} weights of the adapter it describes are not in the "
            f"file (first: {missing[0]}); it is incomplete; {fix}"
        )


def check_finite_lora(file: Path) -> None:
    """Refuse a LoRA file holding NaN or inf: diffusers loads it as is, and every image it samples is NaN.

    An unreadable file is left to the loader, which names what is wrong with it.

    Raises:
        ValueError: one line naming the file and the first tensor that is not finite.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError):
        return
    check_finite_state(weights, f"LoRA {file}")


def check_finite_state(weights: dict[str, Tensor], source: str) -> None:
    """Refuse LoRA weights holding NaN or inf (one line: ``source``, the tensor and the fix)."""
    from ..checkpoint import nonfinite_tensor

    key = nonfinite_tensor(weights)
    if key is not None:
        raise ValueError(
            f"{source}: tensor '{key}' holds NaN or inf; the file is corrupt: pass another LoRA, or train the run "
            "that wrote it again"
        )


def _denoiser_components(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's denoiser modules by component name (``transformer``, Wan2.2's ``transformer_2``)."""
    return {c: m for c in DENOISERS if isinstance(m := getattr(pipe, c, None), nn.Module)}


def _lora_files(path: Path) -> list[Path]:
    """The LoRA file(s) :func:`find_lora`'s answer holds: the file itself, or each ``LORA_FILES`` name in the folder."""
    return [path] if path.is_file() else [path / n for n in LORA_FILES if (path / n).is_file()]


def restore_fp32_lora(transformer: nn.Module, file: Path, adapter: str) -> bool:
    """Give a LoRA that diffusers loaded into a bf16/fp16 denoiser the fp32 weights its file holds.

    diffusers creates the LoRA layers in the denoiser's dtype, so a LoRA trained in fp32 on a bf16 model
    (as :func:`add_lora` trains it) would sample with weights rounded to bf16 and its low-rank product in
    bf16: up to 0.01 off per pixel after 10 steps on the tiny FLUX, so ``flowrl sample`` / ``flowrl eval``
    would not reproduce the images the run evaluated. This upcasts the adapter's layers (peft's
    ``cast_adapter_dtype``, what peft's own ``get_peft_model`` does by default) and reloads the file's fp32
    values, keyed as :func:`save_transformer_lora <flowrl.models.adapter.save_transformer_lora>` writes them
    (``transformer.`` + the peft key). A file in another layout, or not in fp32, is left as diffusers loaded it.

    Returns:
        Whether the adapter now holds the file's fp32 weights.
    """
    from peft.tuners.tuners_utils import cast_adapter_dtype
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    lora = list(adapter_parameters(transformer, adapter).values())
    if not lora or all(p.dtype == torch.float32 for p in lora):
        return False
    prefix = "transformer."
    state = {k[len(prefix) :]: v for k, v in load_file(str(file)).items() if k.startswith(prefix)}
    if not state or any(v.dtype != torch.float32 for v in state.values()):
        return False
    if len(state) != len(lora):
        return False
    cast_adapter_dtype(transformer, adapter)
    result = set_peft_model_state_dict(transformer, state, adapter_name=adapter)
    if getattr(result, "unexpected_keys", []):
        raise ValueError(f"LoRA {file}: {len(result.unexpected_keys)} weights name no layer of the loaded adapter")
    return True


SEVERAL_ADAPTERS_WARNING = "Already found a `peft_config` attribute"
"""How peft's warning on adding a second adapter to a model starts (:func:`several_adapters`)."""


@contextmanager
def several_adapters() -> Iterator[None]:
    """Add a second adapter without peft's "Already found a `peft_config` ... Make sure to know what you are doing!".

    flowrl attaches several adapters to one denoiser on purpose (DiffusionNFT's old and EMA copies, the
    demo's checkpoints); the warning printed at every such run's start said nothing a user could act on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SEVERAL_ADAPTERS_WARNING)
        yield


@contextmanager
def _quiet_failed_load() -> Iterator[None]:
    """Hold back diffusers' error log and peft's warnings while a LoRA loads; re-issue the warnings if it succeeds.

    A load that fails (tensor sizes of another model) logs every mismatch on many lines before it raises;
    :func:`load_saved_lora` reports the failure in one line instead.
    """
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.setLevel(level)
    for warning in caught:
        if not str(warning.message).startswith(SEVERAL_ADAPTERS_WARNING):  # a second run's LoRA: on purpose
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def add_lora(transformer: nn.Module, *, rank: int, alpha: float, targets: Sequence[str]) -> list[nn.Parameter]:
    """Attach a LoRA adapter (B initialised to zero, so outputs are unchanged) and freeze the rest.

    Args:
        transformer: a diffusers model with ``add_adapter`` (PeftAdapterMixin).
        rank: LoRA rank r.
        alpha: LoRA alpha (scale = alpha / r).
        targets: module names to adapt, e.g. ("to_q", "to_k", "to_v", "to_out.0").

    Returns:
        The trainable LoRA parameters, in fp32.

    References:
        Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
    """
    from peft import LoraConfig

    transformer.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets))
    try:
        transformer.add_adapter(config)
    except ValueError as err:
        raise ValueError(
            f"lora.targets {list(targets)} do not match modules of {type(transformer).__name__}: {err}"
        ) from err
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def check_lora_targets(transformer: nn.Module, targets: Sequence[str]) -> None:
    """Refuse ``lora.targets`` entries that name no module of ``transformer`` (peft's rule: the name or a suffix).

    peft adapts what the other entries match and skips a misspelled one without a word.

    Raises:
        ValueError: one line naming the entries that match nothing.
    """
    names = [name for name, _ in transformer.named_modules()]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(
            f"lora.targets {unmatched} match no module of {type(transformer).__name__}; "
            "fix or remove them (module names or their last parts, e.g. to_q)"
        )


def lora_state_dict(transformer: nn.Module, adapter: str = "default") -> dict[str, Tensor]:
    """One adapter's weights as a flat peft state dict (cloned, on CPU)."""
    from peft.utils import get_peft_model_state_dict

    weights = get_peft_model_state_dict(transformer, adapter_name=adapter)
    return {k: v.detach().cpu().clone() for k, v in weights.items()}


def adapter_names(transformer: nn.Module) -> list[str]:
    """Names of the LoRA adapters attached to a model."""
    return list(getattr(transformer, "peft_config", {}))


def load_lora_state(transformer: nn.Module, state: dict[str, Tensor], adapter: str = "default") -> None:
    """Load weights produced by :func:`lora_state_dict` into an attached adapter.

    Raises:
        ValueError: when keys are missing or unexpected (a checkpoint from another config), or a weight is NaN or inf.
    """
    from peft.utils import set_peft_model_state_dict

    check_finite_state(state, f"LoRA checkpoint (adapter {adapter!r})")
    try:
        result = set_peft_model_state_dict(transformer, state, adapter_name=adapter)
    except RuntimeError as err:  # torch's size-mismatch report: one line per tensor
        if "size mismatch" not in str(err):
            raise
        raise ValueError(
            "LoRA checkpoint does not match the model (tensor sizes differ); use the same lora.rank/targets as the "
            "run that wrote it"
        ) from None
    # with several adapters attached, peft lists the *other* adapters' weights as missing too
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{adapter}." in k]
    if missing or getattr(result, "unexpected_keys", []):
        raise lora_mismatch(len(missing), len(result.unexpected_keys))


def check_lora_state(transformer: nn.Module, state: dict[str, Tensor], adapter: str = "default") -> None:
    """Check, without loading, that ``state`` (a :func:`lora_state_dict`) fits the attached adapter: keys and shapes.

    For whole (unsharded) adapters; a resume calls it before it touches the run folder.

    Raises:
        ValueError: a key missing or unexpected, or a tensor of another shape (one line, naming it).
    """
    from peft.utils import get_peft_model_state_dict

    current = get_peft_model_state_dict(transformer, adapter_name=adapter)
    missing, unexpected = [k for k in current if k not in state], [k for k in state if k not in current]
    if missing or unexpected:
        raise lora_mismatch(len(missing), len(unexpected))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(current[key].shape):
            raise ValueError(
                f"LoRA checkpoint does not match the model ({key}: {tuple(tensor.shape)} in the checkpoint, "
                f"{tuple(current[key].shape)} here); use the same lora.rank/targets as the run that wrote it"
            )


def lora_mismatch(missing: int, unexpected: int) -> ValueError:
    """The one-line error for LoRA weights whose keys do not match the attached adapter."""
    return ValueError(
        f"LoRA checkpoint does not match the model ({missing} missing, {unexpected} unexpected keys); "
        "use the same lora.rank/targets as the run that wrote it"
    )


@contextmanager
def adapters_disabled(transformer: nn.Module) -> Iterator[None]:
    """Run the base model (the KL reference) by switching the LoRA adapters off temporarily.

    Each LoRA layer is switched with peft's own ``BaseTunerLayer.enable_adapters``, as diffusers'
    ``disable_adapters`` / ``enable_adapters`` do, on layers found once (see :func:`use_adapter`); the
    ``requires_grad`` flags peft flips are restored on exit.
    """
    layers = _tuner_layers(transformer)
    flags = _lora_flags(layers)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        _restore(flags)


def _tuner_layers(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's peft LoRA layers (``BaseTunerLayer``), in module order."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


def _lora_flags(layers: Sequence[nn.Module]) -> list[tuple[nn.Parameter, bool]]:
    """Every LoRA parameter of ``layers`` with its ``requires_grad`` flag."""
    return [(p, p.requires_grad) for layer in layers for n, p in layer.named_parameters() if "lora_" in n]


def _restore(flags: Sequence[tuple[nn.Parameter, bool]]) -> None:
    """Set each parameter's ``requires_grad`` back to its recorded flag."""
    for param, flag in flags:
        param.requires_grad_(flag)


def add_frozen_copy(transformer: nn.Module, name: str, source: str = "default") -> None:
    """Add a second, frozen LoRA adapter ``name`` with ``source``'s config and weights.

    Used for DiffusionNFT's sampling ("old") policy and the EMA adapters: one transformer, several
    adapters, no second copy of the base weights. The copy holds ``source``'s dtype (fp32, as :func:`add_lora`
    trains it): peft would create it in a bf16 denoiser's dtype, where an EMA of decay 0.9 loses the small
    steps it averages (5e-3 off a float64 EMA after 50 steps of 3e-4, on the tiny SD3 in bf16).
    """
    import copy

    from peft.tuners.tuners_utils import cast_adapter_dtype

    with several_adapters():
        transformer.add_adapter(copy.deepcopy(transformer.peft_config[source]), adapter_name=name)
    transformer.set_adapter(source)
    if all(p.dtype == torch.float32 for p in adapter_parameters(transformer, source).values()):
        cast_adapter_dtype(transformer, name)
    with torch.no_grad():
        dst = adapter_parameters(transformer, name)
        for key, param in adapter_parameters(transformer, source).items():
            dst[key].copy_(param)
    for param in adapter_parameters(transformer, name).values():
        param.requires_grad_(False)


def adapter_parameters(transformer: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """LoRA parameters of one adapter, keyed by their name with the adapter name removed."""
    tag = f".{name}."
    return {n.replace(tag, "."): p for n, p in transformer.named_parameters() if "lora_" in n and tag in n}


@torch.no_grad()
def soft_update(transformer: nn.Module, target: str, source: str = "default", keep: float = 0.0) -> None:
    """``theta_target <- keep * theta_target + (1 - keep) * theta_source`` (keep = 0 copies).

    Raises:
        ValueError: keep outside [0, 1].
    """
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"soft-update keep factor must be in [0, 1]; got {keep}")
    dst = adapter_parameters(transformer, target)
    for key, param in adapter_parameters(transformer, source).items():
        dst[key].mul_(keep).add_(param.detach().to(dst[key].dtype), alpha=1.0 - keep)


@contextmanager
def use_adapter(transformer: nn.Module, name: str) -> Iterator[None]:
    """Run with LoRA adapter ``name`` active, then switch back to "default".

    Switches each LoRA layer with peft's own ``BaseTunerLayer.set_adapter``, as diffusers'
    ``set_adapter`` does, but finds the layers once per switch and back (diffusers walks the whole
    module tree with names and checks peft's version on every call, and this runs once per
    micro-batch for DiffusionNFT's old policy: 2.7 ms saved per use on the embedded model). peft flips
    ``requires_grad`` when the active adapter changes; the flags are restored on exit.

    Raises:
        ValueError: the transformer has no adapter ``name``.
    """
    if name == "default":
        yield
        return
    if name not in adapter_names(transformer):
        raise ValueError(f"the denoiser has no LoRA adapter {name!r}; it has {adapter_names(transformer)}")
    layers = _tuner_layers(transformer)
    flags = _lora_flags(layers)
    for layer in layers:
        layer.set_adapter(name)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_adapter("default")
        _restore(flags)


def count_parameters(params: Sequence[torch.nn.Parameter]) -> int:
    """Total number of elements in a parameter list."""
    return sum(p.numel() for p in params)
