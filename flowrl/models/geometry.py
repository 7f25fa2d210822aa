"""A model's geometry read from its diffusers folder without loading weights: what a memory estimate needs.

Reads ``model_index.json``, the ``config.json`` of the transformer and the VAE, the optional
``flowrl.json`` card, and the headers of the ``*.safetensors`` files (parameter counts and the
shapes of the LoRA-targeted layers; no tensor is read). Used by :mod:`flowrl.resources` before
any model is built.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

_SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


class Geometry(NamedTuple):
    """What the estimate needs to know about a model, read from its folder without loading weights.

    Attributes:
        family: ``model_index.json`` ``_class_name``.
        vae_factor: spatial downsampling of the VAE.
        temporal_factor: temporal downsampling (video models), else 1.
        latent_channels: latent channels C.
        patch: latent pixels per token side (2 for every supported family).
        hidden: transformer width (heads x head dim).
        layers: transformer blocks.
        text_tokens: conditioning tokens per prompt.
        text_dim: conditioning width.
        vae_widths: VAE decoder channels per level, full resolution first.
        default_resolution: (height, width) when ``model.resolution`` is null.
        default_frames: frames per video when ``model.num_frames`` is null; None for image models.
        params: parameter count per component (``transformer``, ``vae``, ``text_encoder``, ...).
        lora_width: sum of (in + out) over the LoRA-targeted linear layers (LoRA parameters per unit rank).
        max_side: the largest output side the transformer's position embedding covers (SD3:
            ``pos_embed_max_size`` x patch x VAE factor); None when unbounded.
    """

    family: str
    vae_factor: int
    temporal_factor: int
    latent_channels: int
    patch: int
    hidden: int
    layers: int
    text_tokens: int
    text_dim: int
    vae_widths: tuple[int, ...]
    default_resolution: tuple[int, int]
    default_frames: int | None
    params: dict[str, int]
    lora_width: int
    max_side: int | None = None


def model_folder(path: str) -> Path | None:
    """The local pipeline folder of ``model.path`` (embedded, a folder or a cached hub id); None if absent.

    Never downloads and never waits on the network.
    """
    from . import EMBEDDED
    from .hub import is_hub_id

    if path == EMBEDDED:
        from .digits.model import DIGITS_DIR

        return DIGITS_DIR if (DIGITS_DIR / "model_index.json").is_file() else None
    local = Path(path).expanduser()
    if local.is_dir():
        return local if (local / "model_index.json").is_file() else None
    if is_hub_id(path):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "model_index.json")
        return Path(found).parent if isinstance(found, str) else None
    return None


def _json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; {} when the file is missing, malformed or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int(data: dict[str, Any], key: str, default: int) -> int:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def tensor_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the headers of the ``*.safetensors`` files in ``folder`` (no tensor is read).

    Unreadable or malformed files are skipped.
    """
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size)) if size < 100_000_000 else {}
        except (OSError, ValueError, struct.error):
            continue
        for name, info in header.items() if isinstance(header, dict) else []:
            if isinstance(info, dict) and info.get("dtype") in _SAFETENSORS_DTYPES:
                shapes[name] = [int(d) for d in info.get("shape", [])]
    return shapes


def lora_width(shapes: dict[str, list[int]], targets: tuple[str, ...] | list[str]) -> int:
    """Sum of (in + out) over the 2-D ``<module>.weight`` tensors whose module a LoRA target matches (peft's rule)."""
    total = 0
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(shape) == 2:
            if any(module == t or module.endswith("." + t) for t in targets):
                total += shape[0] + shape[1]
    return total


def _default_targets(family: str, transformer: dict[str, Any]) -> tuple[str, ...]:
    """The adapter's default LoRA targets for a pipeline class (imports only that family's module)."""
    if family == "FluxPipeline":
        from .flux import flux_lora_targets

        return flux_lora_targets(_int(transformer, "num_single_layers", 1))
    if family == "WanPipeline":
        from .wan import WAN_LORA_TARGETS

        return WAN_LORA_TARGETS
    if family == "QwenImagePipeline":
        from .qwen_image import QWEN_IMAGE_LORA_TARGETS

        return QWEN_IMAGE_LORA_TARGETS
    from .sd3 import SD3_LORA_TARGETS

    return SD3_LORA_TARGETS


def _vae_geometry(vae: dict[str, Any], family: str) -> tuple[int, int, tuple[int, ...]]:
    """(spatial factor, temporal factor, decoder widths) of a VAE config, as the pipelines derive them."""
    blocks = vae.get("block_out_channels")
    temporal = vae.get("temperal_downsample")  # Wan / Qwen-Image spelling
    if isinstance(blocks, list) and blocks and all(isinstance(b, int) for b in blocks):
        return 2 ** (len(blocks) - 1), 1, tuple(blocks)
    if isinstance(temporal, list):
        base = _int(vae, "base_dim", 96)
        mult = vae.get("dim_mult") if isinstance(vae.get("dim_mult"), list) else [1, 2, 4, 4]
        widths = tuple(base * int(m) for m in mult if isinstance(m, int))
        t = 2 ** sum(bool(x) for x in temporal) if family == "WanPipeline" else 1
        if family == "WanPipeline":  # as WanPipeline reads them: Wan2.2-TI2V-5B's VAE is 16x spatially, not 8x
            t = _int(vae, "scale_factor_temporal", t)
            return _int(vae, "scale_factor_spatial", 2 ** len(temporal)), t, widths or (base,)
        return 2 ** len(temporal), t, widths or (base,)
    return 8, 1, (128, 256, 512, 512)


def _default_resolution(family: str, card: dict[str, Any], transformer: dict[str, Any], factor: int) -> tuple[int, int]:
    res = card.get("resolution")
    if isinstance(res, int) and res > 0:
        return (res, res)
    if isinstance(res, list) and len(res) == 2 and all(isinstance(r, int) and r > 0 for r in res):
        return (res[0], res[1])
    if family == "WanPipeline":
        from .wan import DEFAULT_RESOLUTION

        return DEFAULT_RESOLUTION
    if family == "StableDiffusion3Pipeline":
        size = _int(transformer, "sample_size", 128) * factor
        return (size, size)
    return (128 * factor, 128 * factor)  # FLUX / Qwen-Image: the pipeline's default_sample_size x the VAE factor


def _default_text_tokens(family: str, transformer: dict[str, Any]) -> int:
    """The adapter's ``max_sequence_length`` without a model card: 256 for SD3 (T5) and FLUX.1-schnell, else 512."""
    schnell = family == "FluxPipeline" and not transformer.get("guidance_embeds", False)
    return 256 if family == "StableDiffusion3Pipeline" or schnell else 512


def _components(folder: Path, index: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """Component name -> tensor shapes, for the model components listed in ``model_index.json``."""
    out = {}
    for name, spec in index.items():
        if not name.startswith("_") and isinstance(spec, list) and spec and spec[0] is not None:
            if (folder / name / "config.json").is_file():
                out[name] = tensor_shapes(folder / name)
    return out


def _clip_tokens(folder: Path) -> int:
    """The CLIP tokens SD3 puts before T5's: its first tokenizer's ``model_max_length`` (77 without one).

    ``StableDiffusion3Pipeline`` pads both CLIP prompts to ``tokenizer.model_max_length`` (77 for the
    released models, 8 for the embedded flowrl-digits model).
    """
    return _int(_json(folder / "tokenizer" / "tokenizer_config.json"), "model_max_length", 77)


def read_geometry(folder: Path, targets: list[str] | None) -> Geometry | None:
    """The :class:`Geometry` of a diffusers pipeline folder; None when its files are missing or malformed.

    Args:
        folder: the pipeline folder (``model_index.json``).
        targets: ``lora.targets``; None = the family's defaults.
    """
    index = _json(folder / "model_index.json")
    family = index.get("_class_name")
    transformer = _json(folder / "transformer" / "config.json")
    if not isinstance(family, str) or not transformer:
        return None
    card, vae = _json(folder / "flowrl.json"), _json(folder / "vae" / "config.json")
    factor, temporal, widths = _vae_geometry(vae, family)
    components = _components(folder, index)
    lora_targets = tuple(targets) if targets else _default_targets(family, transformer)
    denoisers = [s for name, s in components.items() if name.startswith("transformer")]
    patch = transformer.get("patch_size")
    patch = patch[-1] if isinstance(patch, list) and patch else patch
    patch = max(2, patch if isinstance(patch, int) else 2)
    extra_text = _clip_tokens(folder) if family == "StableDiffusion3Pipeline" else 0  # SD3: CLIP's, then T5's
    video = family == "WanPipeline"
    return Geometry(
        family=family,
        vae_factor=factor,
        temporal_factor=temporal,
        latent_channels=_int(vae, "latent_channels", _int(vae, "z_dim", 16)),
        patch=patch,
        hidden=_int(transformer, "num_attention_heads", 24) * _int(transformer, "attention_head_dim", 64),
        layers=_int(transformer, "num_layers", 24) + _int(transformer, "num_single_layers", 0),
        text_tokens=_int(card, "max_sequence_length", _default_text_tokens(family, transformer)) + extra_text,
        text_dim=_int(transformer, "joint_attention_dim", _int(transformer, "text_dim", 4096)),
        vae_widths=widths,
        default_resolution=_default_resolution(family, card, transformer, factor),
        default_frames=_int(card, "num_frames", 81) if video else None,
        params={name: sum(math.prod(s) for s in shapes.values()) for name, shapes in components.items()},
        lora_width=sum(lora_width(s, lora_targets) for s in denoisers),
        max_side=_int(transformer, "pos_embed_max_size", 0) * patch * factor or None,
    )
