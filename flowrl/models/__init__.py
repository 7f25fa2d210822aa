"""Model adapters: one file per model family, all implementing :class:`ModelAdapter`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .adapter import Cond, ModelAdapter, repeat_cond, select_cond
from .hub import resolve_model_path
from .loading import FLOW_PIPELINES, load_flow_pipeline

EMBEDDED = "flowrl-digits"

__all__ = ["Cond", "EMBEDDED", "ModelAdapter", "load_adapter", "repeat_cond", "select_cond"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _pipeline_class(path: Path) -> str:
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"model folder {path} has no model_index.json; point model.path at a diffusers pipeline folder"
        )
    return json.loads(index.read_text()).get("_class_name", "")


def _quiet_hub_libraries() -> None:
    """Hide per-shard loading bars and info logs; warnings and errors still show."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_adapter(
    path: str | None = None, *, dtype: str = "float32", device: str = "cpu", distilled_guidance: float | None = None
) -> ModelAdapter:
    """Load a model adapter from a local diffusers folder, or the embedded model.

    Args:
        path: a diffusers pipeline folder, or None / "flowrl-digits" for the embedded model.
        dtype: "float32", "bfloat16" or "float16".
        device: torch device string.
        distilled_guidance: ``model.distilled_guidance``: the guidance-embedding scale of a
            guidance-distilled model (FLUX.1-dev); None = the model's default.

    Returns:
        A :class:`ModelAdapter`.

    Raises:
        FileNotFoundError: the folder or its weights are missing (the message says how to fix it).
        ValueError: the folder holds a pipeline class flowrl has no adapter for, or
            ``distilled_guidance`` is set for a model without a guidance embedding.
    """
    from .sd3 import SD3Adapter

    _quiet_hub_libraries()

    if path in (None, EMBEDDED):
        from .digits.model import DIGITS_DIR

        if not (DIGITS_DIR / "model_index.json").is_file():
            raise FileNotFoundError(
                f"embedded model weights are missing at {DIGITS_DIR}; rebuild them with `flowrl pretrain-digits`"
            )
        path = str(DIGITS_DIR)
    folder = resolve_model_path(path)  # local folder or cached hub id; one-line error when weights are missing
    cls_name = _pipeline_class(folder)
    if distilled_guidance is not None and cls_name != "FluxPipeline":
        raise ValueError(
            f"model.distilled_guidance={distilled_guidance} but {cls_name} has no guidance embedding; remove it "
            "(true CFG is sampler.guidance_scale)"
        )
    if isinstance(cls_name, str) and cls_name in FLOW_PIPELINES:
        return load_flow_pipeline(
            cls_name, folder, dtype=_DTYPES[dtype], device=device, model_id=str(path), distilled_guidance=distilled_guidance
        )
    if cls_name == "StableDiffusion3Pipeline":
        return SD3Adapter.from_pretrained(folder, dtype=_DTYPES[dtype], device=device)
    if cls_name == "WanPipeline":
        from .wan import WanAdapter

        return WanAdapter.from_pretrained(folder, dtype=_DTYPES[dtype], device=device, model_id=str(path))
    raise ValueError(
        f"no flowrl adapter for pipeline class {cls_name!r} in {folder}; supported: StableDiffusion3Pipeline, WanPipeline, "
        f"{', '.join(FLOW_PIPELINES)}"
    )
