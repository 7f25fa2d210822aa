"""Pipeline-class dispatch for the packed-latent flow models (FLUX.1, Qwen-Image).

``load_adapter`` reads ``_class_name`` from a folder's ``model_index.json`` and hands the folder
here for the classes below; each adapter's ``from_pretrained`` loads local files only and never
enables ``trust_remote_code``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

FLOW_PIPELINES = {
    "FluxPipeline": ("flowrl.models.flux", "FluxAdapter"),
    "QwenImagePipeline": ("flowrl.models.qwen_image", "QwenImageAdapter"),
}
"""diffusers pipeline class name -> (module, adapter class)."""


def load_flow_pipeline(
    cls_name: str,
    folder: Path,
    *,
    dtype: torch.dtype,
    device: str,
    model_id: str | None = None,
    distilled_guidance: float | None = None,
) -> Any:
    """Load the adapter for ``cls_name`` from a resolved local pipeline folder.

    ``distilled_guidance`` (``model.distilled_guidance``) goes to FLUX's guidance embedding; the
    FLUX adapter rejects it for models without one (schnell).

    Raises:
        ValueError: ``cls_name`` is not one of :data:`FLOW_PIPELINES`.
    """
    if cls_name not in FLOW_PIPELINES:
        raise ValueError(f"no flow-pipeline adapter for {cls_name!r}; supported: {', '.join(FLOW_PIPELINES)}")
    module, name = FLOW_PIPELINES[cls_name]
    adapter_cls = getattr(importlib.import_module(module), name)
    extra = {"guidance_scale": distilled_guidance} if cls_name == "FluxPipeline" else {}
    try:
        return adapter_cls.from_pretrained(folder, dtype=dtype, device=device, model_id=model_id, **extra)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"{folder} ships custom model code that flowrl does not run (trust_remote_code stays off); "
            "point model.path at a standard diffusers folder"
        ) from None
