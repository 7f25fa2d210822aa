"""Model adapters: one file per model family, all implementing :class:`ModelAdapter`."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

from ..rewards.weights import pickle_refusal, refused_pickle
from .adapter import Cond, ModelAdapter, repeat_cond, select_cond
from .hub import KNOWN_REPOS, check_weights, download_fix, resolve_model_path
from .loading import PIPELINES, load_pipeline_adapter, read_model_index

EMBEDDED = "flowrl-digits"
REBUILD_EMBEDDED = "rebuild them with `flowrl pretrain-digits --overwrite` (or reinstall flowrl)"

__all__ = ["Cond", "EMBEDDED", "ModelAdapter", "PIPELINES", "load_adapter", "repeat_cond", "select_cond"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _quiet_hub_libraries() -> None:
    """Hide per-shard loading bars and info logs; warnings and errors still show.

    torch's note on a pickle protocol its safe loader does not expect is hidden too: a ``.bin`` it then refuses
    is one line (:func:`~flowrl.rewards.weights.pickle_refusal`), and one it loads needs no note.
    """
    warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def pipeline_folder(path: str | None) -> Path:
    """The local pipeline folder for ``model.path`` (the embedded model, a folder or a hub id), weights checked.

    Raises:
        FileNotFoundError: the folder or its weights are missing.
        ValueError: a local folder's ``model_index.json`` is not a JSON object, or a weight file is damaged.
    """
    if path in (None, EMBEDDED):
        from .digits.model import DIGITS_DIR

        if not (DIGITS_DIR / "model_index.json").is_file():
            raise FileNotFoundError(f"embedded model weights are missing at {DIGITS_DIR}; {REBUILD_EMBEDDED}")
        read_model_index(DIGITS_DIR)
        check_weights(DIGITS_DIR, EMBEDDED, fix=REBUILD_EMBEDDED)
        return DIGITS_DIR
    local = Path(path).expanduser()
    if local.is_dir():
        read_model_index(local)  # a malformed index fails here in one line, before the weight check reads it
    return resolve_model_path(path)  # local folder or cached hub id; one-line error when weights are missing


def load_adapter(
    path: str | None = None, *, dtype: str = "float32", device: str = "cpu", distilled_guidance: float | None = None
) -> ModelAdapter:
    """Load a model adapter from a local diffusers folder, a cached hub id, or the embedded model.

    The folder's ``model_index.json`` ``_class_name`` picks the adapter from
    :data:`~flowrl.models.loading.PIPELINES` (SD3, FLUX.1, Qwen-Image, Wan).

    Args:
        path: a diffusers pipeline folder or hub id, or None / "flowrl-digits" for the embedded model.
        dtype: "float32", "bfloat16" or "float16".
        device: torch device string.
        distilled_guidance: ``model.distilled_guidance``: the guidance-embedding scale of a
            guidance-distilled model (FLUX.1-dev); None = the model's default.

    Returns:
        A :class:`ModelAdapter`.

    Raises:
        FileNotFoundError: the folder or its weights are missing (the message says how to fix it).
        ValueError: a damaged weight file (the message names it and the fix), a component whose config
            the loaders cannot read or find, a malformed ``model_index.json``, a pipeline class flowrl has
            no adapter for, ``distilled_guidance`` for a model without a guidance embedding, or a folder
            that needs remote code.
    """
    _quiet_hub_libraries()
    folder = pipeline_folder(path)
    cls_name = read_model_index(folder).get("_class_name", "")
    model_id = EMBEDDED if path in (None, EMBEDDED) else str(path)
    fix = REBUILD_EMBEDDED if model_id == EMBEDDED else download_fix(model_id, KNOWN_REPOS.get(str(cls_name)))
    try:
        return load_pipeline_adapter(
            cls_name,
            folder,
            dtype=_DTYPES[dtype],
            device=device,
            model_id=model_id,
            distilled_guidance=distilled_guidance,
        )
    except (OSError, pickle.UnpicklingError) as err:
        if isinstance(err, OSError) and err.errno is not None:  # the filesystem's own error: the CLI names the path
            raise
        if (refused := refused_pickle(err)) is not None:
            raise ValueError(pickle_refusal(f"model {model_id!r}", folder, refused)) from None
        # diffusers / transformers raise errno-less OSErrors for a component's unreadable or missing config
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"model {model_id!r} could not be loaded from {folder} ({reason}); {fix}") from None
    except ValueError as err:
        if "expected shape" not in str(err):
            raise
        # diffusers' size check: a component's config.json no longer describes its weights (edited or swapped)
        shape = str(err).split(" because ", 1)[-1].split(". ", 1)[0]
        raise ValueError(
            f"model {model_id!r} could not be loaded from {folder}: a component's config.json does not describe its "
            f"weights ({shape}); restore that config.json, or {fix}"
        ) from None
