"""Pipeline-class dispatch: one table from ``model_index.json``'s ``_class_name`` to an adapter.

``load_adapter`` reads ``_class_name`` from a folder's ``model_index.json`` and hands the folder
to :func:`load_pipeline_adapter`, which imports the adapter's module on first use (so loading one
family never imports the others) and calls its ``from_pretrained``. Adapters load local files
only and never enable ``trust_remote_code``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from .adapter import ModelAdapter

PIPELINES = {
    "StableDiffusion3Pipeline": ("flowrl.models.sd3", "SD3Adapter"),
    "FluxPipeline": ("flowrl.models.flux", "FluxAdapter"),
    "QwenImagePipeline": ("flowrl.models.qwen_image", "QwenImageAdapter"),
    "WanPipeline": ("flowrl.models.wan", "WanAdapter"),
}
"""diffusers pipeline class name -> (module, adapter class)."""

DISTILLED_GUIDANCE = ("FluxPipeline",)
"""Pipeline classes whose adapter takes ``model.distilled_guidance`` (a guidance embedding)."""


def read_model_index(folder: Path) -> dict[str, Any]:
    """The parsed ``model_index.json`` of a diffusers pipeline folder.

    Raises:
        FileNotFoundError: the folder has no ``model_index.json``.
        ValueError: the file is not valid JSON or not a JSON object (one line naming the file).
    """
    index = Path(folder) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"model folder {folder} has no model_index.json; point model.path at a diffusers pipeline folder"
        )
    try:
        listed = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{index} is not valid JSON ({err}); point model.path at a diffusers pipeline folder"
        ) from None
    if not isinstance(listed, dict):
        raise ValueError(
            f"{index} must hold a JSON object with a _class_name; got a {type(listed).__name__}; "
            "point model.path at a diffusers pipeline folder"
        )
    return listed


def load_pipeline_adapter(
    cls_name: Any,
    folder: Path,
    *,
    dtype: torch.dtype,
    device: str,
    model_id: str,
    distilled_guidance: float | None = None,
) -> ModelAdapter:
    """Load the adapter for pipeline class ``cls_name`` from a resolved local pipeline folder.

    Args:
        cls_name: ``_class_name`` of the folder's ``model_index.json`` (as read: any JSON value).
        folder: the pipeline folder.
        dtype: weight dtype.
        device: torch device string.
        model_id: the model's name (``model.path`` as given) for messages and the prompt cache.
        distilled_guidance: ``model.distilled_guidance``, for FLUX's guidance embedding only (the
            FLUX adapter rejects it for models without one, such as schnell).

    Raises:
        ValueError: ``distilled_guidance`` for a class without a guidance embedding, a class with
            no adapter in :data:`PIPELINES`, or a folder that needs remote code.
    """
    if distilled_guidance is not None and cls_name not in DISTILLED_GUIDANCE:
        raise ValueError(
            f"model.distilled_guidance={distilled_guidance} but {cls_name} has no guidance embedding; remove it "
            "(true CFG is sampler.guidance_scale)"
        )
    if not isinstance(cls_name, str) or cls_name not in PIPELINES:
        raise ValueError(
            f"no flowrl adapter for pipeline class {cls_name!r} in {folder}; supported: {', '.join(PIPELINES)}"
        )
    module, name = PIPELINES[cls_name]
    adapter_cls = getattr(importlib.import_module(module), name)
    extra = {"guidance_scale": distilled_guidance} if cls_name in DISTILLED_GUIDANCE else {}
    try:
        return adapter_cls.from_pretrained(folder, dtype=dtype, device=device, model_id=model_id, **extra)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"{folder} ships custom model code that flowrl does not run (trust_remote_code stays off); "
            "point model.path at a standard diffusers folder"
        ) from None
